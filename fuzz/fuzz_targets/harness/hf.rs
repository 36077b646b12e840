//! `hf`: one fuzz input split into a Hugging Face `config.json` and one or
//! two safetensors shards.

use handoff::model::{RopeStyle, load_hf_bytes};

use super::loaded::{self, Outcome};

/// Shard file names, as a two-file checkpoint would name them.
pub const SHARD_NAMES: [&str; 2] = [
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
];

/// The parts of one input. Layout: one flags byte (bit 0: two shards), a
/// little-endian u16 config length and the config bytes; with two shards, a
/// little-endian u32 length of the first shard and its bytes; the rest is the
/// last shard. A length longer than what remains takes what remains, so
/// every byte string is some input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HfInput<'a> {
    pub config: &'a [u8],
    pub shards: [Option<&'a [u8]>; 2],
}

fn take<'a>(data: &mut &'a [u8], n: usize) -> &'a [u8] {
    let (head, rest) = data.split_at(n.min(data.len()));
    *data = rest;
    head
}

fn take_len(data: &mut &[u8], width: usize) -> usize {
    let mut le = [0u8; 8];
    le[..width.min(data.len())].copy_from_slice(take(data, width));
    u64::from_le_bytes(le) as usize
}

impl<'a> HfInput<'a> {
    pub fn split(mut data: &'a [u8]) -> Self {
        let two = take(&mut data, 1).first().is_some_and(|f| f & 1 == 1);
        let n = take_len(&mut data, 2);
        let config = take(&mut data, n);
        let first = if two {
            let n = take_len(&mut data, 4);
            Some(take(&mut data, n))
        } else {
            None
        };
        let shards = match first {
            Some(first) => [Some(first), Some(data)],
            None => [Some(data), None],
        };
        Self { config, shards }
    }

    /// The inverse of [`HfInput::split`] (for seeds); lengths must fit.
    pub fn join(config: &[u8], shards: &[&[u8]]) -> Vec<u8> {
        let mut out = vec![u8::from(shards.len() == 2)];
        out.extend(u16::try_from(config.len()).unwrap().to_le_bytes());
        out.extend(config);
        if let [first, _] = shards {
            out.extend(u32::try_from(first.len()).unwrap().to_le_bytes());
        }
        for s in shards {
            out.extend(*s);
        }
        out
    }

    pub fn files(&self) -> Vec<(&'static str, &'a [u8])> {
        SHARD_NAMES
            .iter()
            .zip(self.shards)
            .filter_map(|(n, s)| Some((*n, s?)))
            .collect()
    }
}

/// Loads the split input; what loads must pass [`loaded::check`] (f16/bf16
/// store a value in 2 bytes) and use rotate-half RoPE.
pub fn hf_outcome(data: &[u8]) -> Outcome {
    let input = HfInput::split(data);
    match load_hf_bytes(input.config, &input.files()) {
        Ok(w) => {
            assert_eq!(w.config.rope_style, RopeStyle::Half);
            loaded::check(&w, data.len(), 2)
        }
        Err(e) => loaded::refused(&e),
    }
}

pub fn hf(data: &[u8]) {
    let _ = hf_outcome(data);
}
