//! `gguf`: arbitrary bytes as a GGUF file.

use handoff::model::gguf::{GgufFile, load_gguf_bytes};

use super::loaded::{self, Outcome};

/// Parses `data` (every metadata value and tensor is read back through the
/// public accessors), then loads it as a model; what loads must pass
/// [`loaded::check`], with at most two values per input byte (4-bit blocks
/// hold 32 values in 18 bytes at best).
pub fn gguf_outcome(data: &[u8]) -> Outcome {
    if let Ok(f) = GgufFile::from_bytes(data.to_vec()) {
        for (k, v) in f.metadata_entries() {
            assert!(f.metadata(k).is_some(), "key {k} listed but not found");
            let _ = (
                v.as_str(),
                v.as_u64(),
                v.as_f32(),
                v.as_str_array(),
                v.type_name(),
            );
        }
        for t in f.tensors() {
            assert_eq!(f.tensor_bytes(t).len() as u64, t.byte_len(), "{}", t.name());
        }
    }
    match load_gguf_bytes(data.to_vec()) {
        Ok(w) => loaded::check(&w, data.len() * 2, 1),
        Err(e) => loaded::refused(&e),
    }
}

pub fn gguf(data: &[u8]) {
    let _ = gguf_outcome(data);
}
