//! Loader for llama2.c "legacy" (version 0) model files.
//!
//! Layout (all little-endian): seven `i32` (dim, hidden_dim, n_layers,
//! n_heads, n_kv_heads, vocab_size, seq_len; a negative vocab_size means a
//! separate classifier follows), then f32 tensors in a fixed order (see
//! `shared/models/README.md`). The file size is checked against the header
//! before anything is allocated, every tensor is checked for non-finite
//! values, and any malformed input gets a typed [`ModelError`], never a
//! panic.

use std::path::Path;

use crate::model::error::map_file;
use crate::model::{LayerWeights, ModelConfig, ModelError, ModelWeights, RopeScaling, RopeStyle};

const HEADER_BYTES: usize = 7 * 4;
/// "ak42": the magic of llama2.c's versioned exports (version 1 and 2).
const VERSIONED_MAGIC: i32 = 0x616b_3432;
/// No dimension of a real model comes near this; it keeps size arithmetic
/// far from overflow.
const MAX_DIM: usize = 1 << 24;

/// Loads a llama2.c `.bin` file (mapped, so the file is never held in
/// memory beside the weights made from it).
pub fn load_llama2c(path: &Path) -> Result<ModelWeights, ModelError> {
    let bytes = map_file(path)?;
    parse_llama2c(bytes.as_slice())
}

/// Parses the bytes of a llama2.c `.bin` file.
pub fn parse_llama2c(bytes: &[u8]) -> Result<ModelWeights, ModelError> {
    let config = parse_header(bytes)?;
    let shared = header_i32(bytes, 5)? > 0;
    let plan = tensor_plan(&config, shared);
    check_size(bytes.len(), &plan)?;

    let mut r = Reader {
        bytes,
        offset: HEADER_BYTES,
    };
    let c = &config;
    let (l, d, h) = (c.n_layers, c.dim, c.hidden_dim);
    let (qd, kvd) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
    // Each tensor's bytes, checked in full (every element finite) before
    // any is copied; then each layer's part is copied once, from the file.
    let embedding = r.take("token_embedding", c.vocab_size * d)?;
    let rms_att = r.take("rms_att_weight", l * d)?;
    let wq = r.take("wq", l * qd * d)?;
    let wk = r.take("wk", l * kvd * d)?;
    let wv = r.take("wv", l * kvd * d)?;
    let wo = r.take("wo", l * d * qd)?;
    let rms_ffn = r.take("rms_ffn_weight", l * d)?;
    let w1 = r.take("w1", l * h * d)?;
    let w2 = r.take("w2", l * d * h)?;
    let w3 = r.take("w3", l * h * d)?;
    let final_norm = r.take("rms_final_weight", d)?;
    // Legacy RoPE tables: skipped (recomputed), but present.
    r.take("freq_cis_real", c.max_seq_len * c.head_dim / 2)?;
    r.take("freq_cis_imag", c.max_seq_len * c.head_dim / 2)?;
    let lm_head = if shared {
        None
    } else {
        Some(r.take("wcls", c.vocab_size * d)?)
    };
    if r.offset != bytes.len() {
        return Err(ModelError::BadHeader(format!(
            "{} bytes follow the last tensor: the header does not describe this file",
            bytes.len() - r.offset
        )));
    }
    for t in [
        &embedding,
        &rms_att,
        &wq,
        &wk,
        &wv,
        &wo,
        &rms_ffn,
        &w1,
        &w2,
        &w3,
        &final_norm,
    ]
    .into_iter()
    .chain(lm_head.as_ref())
    {
        t.check_finite()?;
    }

    let layers = (0..l)
        .map(|i| LayerWeights {
            attn_norm: rms_att.part(i, d),
            wq: wq.part(i, qd * d),
            wk: wk.part(i, kvd * d),
            wv: wv.part(i, kvd * d),
            wo: wo.part(i, d * qd),
            bq: None,
            bk: None,
            bv: None,
            q_norm: None,
            k_norm: None,
            post_attn_norm: None,
            ffn_norm: rms_ffn.part(i, d),
            post_ffn_norm: None,
            w1: w1.part(i, h * d),
            w2: w2.part(i, d * h),
            w3: w3.part(i, h * d),
        })
        .collect();
    let (embedding, final_norm) = (embedding.part(0, c.vocab_size * d), final_norm.part(0, d));
    let lm_head = lm_head.map(|t| t.part(0, c.vocab_size * d));
    Ok(ModelWeights {
        config,
        embedding,
        layers,
        final_norm,
        lm_head,
    })
}

/// Serializes weights in the llama2.c legacy format (for tests, fixtures
/// and tools). Refuses what the format cannot express: attention biases,
/// rotate-half RoPE, RoPE scaling, a RoPE base other than 10000, an eps other than 1e-5,
/// or `head_dim != dim / n_heads`.
pub fn write_llama2c(w: &ModelWeights) -> Result<Vec<u8>, ModelError> {
    w.check_shapes()?;
    let c = &w.config;
    let inexpressible = if c.attention_bias {
        Some("attention biases")
    } else if c.rope_style != RopeStyle::Interleaved {
        Some("rotate-half RoPE")
    } else if c.rope_scaling != RopeScaling::None {
        Some("RoPE frequency scaling")
    } else if c.rope_theta != 10_000.0 || c.norm_eps != 1e-5 {
        Some("a RoPE base other than 10000 or an eps other than 1e-5")
    } else if c.head_dim * c.n_heads != c.dim {
        Some("head_dim != dim / n_heads")
    } else if c.tied_embeddings != w.lm_head.is_none() {
        Some("tied_embeddings disagreeing with the presence of lm_head")
    } else {
        None
    };
    if let Some(what) = inexpressible {
        return Err(ModelError::InvalidConfig(format!(
            "the llama2.c format cannot express {what}"
        )));
    }
    let to_i32 = |x: usize| {
        i32::try_from(x).map_err(|_| ModelError::InvalidConfig(format!("{x} exceeds i32")))
    };
    let vocab = to_i32(c.vocab_size)?;
    let header = [
        to_i32(c.dim)?,
        to_i32(c.hidden_dim)?,
        to_i32(c.n_layers)?,
        to_i32(c.n_heads)?,
        to_i32(c.n_kv_heads)?,
        if c.tied_embeddings { vocab } else { -vocab },
        to_i32(c.max_seq_len)?,
    ];
    let mut out: Vec<u8> = header.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut put = |v: &[f32]| out.extend(v.iter().flat_map(|x| x.to_le_bytes()));
    put(&w.embedding);
    let fields: [fn(&LayerWeights) -> &[f32]; 9] = [
        |l| &l.attn_norm,
        |l| &l.wq,
        |l| &l.wk,
        |l| &l.wv,
        |l| &l.wo,
        |l| &l.ffn_norm,
        |l| &l.w1,
        |l| &l.w2,
        |l| &l.w3,
    ];
    for f in fields {
        for l in &w.layers {
            put(f(l));
        }
    }
    put(&w.final_norm);
    let half = c.head_dim / 2;
    let (mut re, mut im) = (Vec::new(), Vec::new());
    for pos in 0..c.max_seq_len {
        for i in 0..half {
            let freq = 1.0 / 10_000f32.powf((2 * i) as f32 / c.head_dim as f32);
            let a = pos as f32 * freq;
            re.push(a.cos());
            im.push(a.sin());
        }
    }
    put(&re);
    put(&im);
    if let Some(h) = &w.lm_head {
        put(h);
    }
    Ok(out)
}

fn header_i32(bytes: &[u8], i: usize) -> Result<i32, ModelError> {
    let b = bytes
        .get(i * 4..i * 4 + 4)
        .ok_or_else(|| ModelError::Truncated {
            tensor: "header".into(),
            expected: HEADER_BYTES,
            available: bytes.len(),
        })?;
    Ok(i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

fn parse_header(bytes: &[u8]) -> Result<ModelConfig, ModelError> {
    let mut v = [0i32; 7];
    for (i, x) in v.iter_mut().enumerate() {
        *x = header_i32(bytes, i)?;
    }
    if v[0] == VERSIONED_MAGIC {
        return Err(ModelError::BadHeader(
            "this is a versioned llama2.c export (magic \"ak42\"); only the legacy version-0 \
             format is supported: export with --version 0"
                .into(),
        ));
    }
    let names = [
        "dim",
        "hidden_dim",
        "n_layers",
        "n_heads",
        "n_kv_heads",
        "vocab_size",
        "seq_len",
    ];
    let mut u = [0usize; 7];
    for i in 0..7 {
        let x = if i == 5 {
            v[i].unsigned_abs()
        } else {
            v[i].max(0) as u32
        };
        if v[i] == 0 || (i != 5 && v[i] < 0) || x as usize > MAX_DIM {
            return Err(ModelError::BadHeader(format!(
                "{} = {} is not a plausible size (1..={MAX_DIM})",
                names[i], v[i]
            )));
        }
        u[i] = x as usize;
    }
    let [
        dim,
        hidden_dim,
        n_layers,
        n_heads,
        n_kv_heads,
        vocab_size,
        seq_len,
    ] = u;
    if !dim.is_multiple_of(n_heads) {
        return Err(ModelError::BadHeader(format!(
            "n_heads {n_heads} does not divide dim {dim}"
        )));
    }
    let config = ModelConfig {
        dim,
        hidden_dim,
        n_layers,
        n_heads,
        n_kv_heads,
        head_dim: dim / n_heads,
        vocab_size,
        max_seq_len: seq_len,
        rope_theta: 10_000.0,
        rope_style: RopeStyle::Interleaved,
        rope_scaling: RopeScaling::None,
        norm_eps: 1e-5,
        tied_embeddings: v[5] > 0,
        attention_bias: false,
        qk_norm: false,
        gemma: None,
    };
    config
        .validate()
        .map_err(|e| ModelError::BadHeader(e.to_string()))?;
    Ok(config)
}

/// `(tensor, elements)` in file order.
fn tensor_plan(c: &ModelConfig, shared: bool) -> Vec<(&'static str, u128)> {
    let (l, d, h) = (c.n_layers as u128, c.dim as u128, c.hidden_dim as u128);
    let qd = (c.n_heads * c.head_dim) as u128;
    let kvd = (c.n_kv_heads * c.head_dim) as u128;
    let v = c.vocab_size as u128;
    let rope = (c.max_seq_len * c.head_dim / 2) as u128;
    let mut plan = vec![
        ("token_embedding", v * d),
        ("rms_att_weight", l * d),
        ("wq", l * qd * d),
        ("wk", l * kvd * d),
        ("wv", l * kvd * d),
        ("wo", l * d * qd),
        ("rms_ffn_weight", l * d),
        ("w1", l * h * d),
        ("w2", l * d * h),
        ("w3", l * h * d),
        ("rms_final_weight", d),
        ("freq_cis_real", rope),
        ("freq_cis_imag", rope),
    ];
    if !shared {
        plan.push(("wcls", v * d));
    }
    plan
}

/// Names the first tensor the file is too short for, before allocating.
fn check_size(len: usize, plan: &[(&'static str, u128)]) -> Result<(), ModelError> {
    let mut end = HEADER_BYTES as u128;
    for &(name, elems) in plan {
        let need = elems * 4;
        let available = (len as u128).saturating_sub(end);
        if need > available {
            return Err(ModelError::Truncated {
                tensor: name.into(),
                expected: usize::try_from(need).unwrap_or(usize::MAX),
                available: usize::try_from(available).unwrap_or(usize::MAX),
            });
        }
        end += need;
    }
    Ok(())
}

struct Reader<'a> {
    bytes: &'a [u8],
    offset: usize,
}

/// One tensor's little-endian f32 bytes in the file.
struct Raw<'a> {
    name: &'static str,
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, name: &'static str, elems: usize) -> Result<Raw<'a>, ModelError> {
        let available = self.bytes.len() - self.offset;
        let need = elems.checked_mul(4).ok_or_else(|| ModelError::Truncated {
            tensor: name.into(),
            expected: usize::MAX,
            available,
        })?;
        if need > available {
            return Err(ModelError::Truncated {
                tensor: name.into(),
                expected: need,
                available,
            });
        }
        let bytes = &self.bytes[self.offset..self.offset + need];
        self.offset += need;
        Ok(Raw { name, bytes })
    }
}

fn f32_at(b: &[u8]) -> f32 {
    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

impl Raw<'_> {
    /// Every element finite, or the first that is not, by index.
    fn check_finite(&self) -> Result<(), ModelError> {
        match self
            .bytes
            .chunks_exact(4)
            .position(|b| !f32_at(b).is_finite())
        {
            Some(index) => Err(ModelError::NonFinite {
                tensor: self.name.into(),
                index,
            }),
            None => Ok(()),
        }
    }

    /// Elements `[i * n, (i + 1) * n)` (in range: the reader took them).
    fn part(&self, i: usize, n: usize) -> Vec<f32> {
        self.bytes
            .get(i * n * 4..(i + 1) * n * 4)
            .unwrap_or(&[])
            .chunks_exact(4)
            .map(f32_at)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(v: [i32; 7]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn header_claiming_huge_sizes_is_refused_without_allocating() {
        let b = header([
            1 << 20,
            1 << 20,
            1 << 20,
            1 << 10,
            1 << 10,
            1 << 20,
            1 << 20,
        ]);
        assert!(matches!(
            parse_llama2c(&b),
            Err(ModelError::Truncated { ref tensor, .. }) if tensor == "token_embedding"
        ));
    }

    #[test]
    fn short_header_and_zero_sizes_are_typed() {
        assert!(matches!(
            parse_llama2c(&[1, 2, 3]),
            Err(ModelError::Truncated { .. })
        ));
        let b = header([64, 172, 0, 8, 4, 512, 512]);
        assert!(matches!(parse_llama2c(&b), Err(ModelError::BadHeader(_))));
        let b = header([VERSIONED_MAGIC, 2, 0, 0, 0, 0, 0]);
        assert!(matches!(parse_llama2c(&b), Err(ModelError::BadHeader(_))));
        let b = header([64, 172, 1, 8, 3, 512, 512]);
        assert!(matches!(parse_llama2c(&b), Err(ModelError::BadHeader(_))));
    }
}
