//! Seeded random GGUF files of any Llama shape, each matrix stored in the
//! ggml type the caller names: quantized models at sizes no fixture has
//! (the 1B shape in Q4_K, say) for benches and tests.
//!
//! Float tensors get [`random_weights`](crate::model::random_weights)'
//! distributions. A quantized matrix gets random quants (every bit of the
//! block but its f16 scale fields) and one scale per matrix, chosen so that
//! its values have the standard deviation the float tensor would have and
//! (for the types with an offset) a mean near zero.

use rayon::prelude::*;

use crate::backend::quant::{dequantize, scale_fields};
use crate::model::gguf::{GgmlType, GgufArray, GgufValue, GgufWriter};
use crate::model::random::{chunk_rng, matrix_std, tensor};
use crate::model::{ModelConfig, ModelError, RopeScaling, RopeStyle};

/// Blocks filled from one seeded stream (parallel and deterministic).
const BLOCKS_PER_CHUNK: usize = 4096;
/// Blocks dequantized to measure a matrix's spread before it is scaled.
const SAMPLE_BLOCKS: usize = 64;

/// The bytes of a GGUF v3 file (architecture `llama`) of `cfg`'s shape with
/// seeded random weights, the same for the same `(cfg, seed, ty)`. `ty`
/// names each matrix's storage from its GGUF base name (`token_embd`,
/// `output`, `attn_q`, `attn_k`, `attn_v`, `attn_output`, `ffn_gate`,
/// `ffn_down`, `ffn_up`); norms are f32. llama.cpp's "Q4_K_M" mix, for
/// instance:
///
/// ```
/// use handoff::model::gguf::{GgmlType, random_gguf};
/// use handoff::model::ModelConfig;
///
/// let cfg = ModelConfig { dim: 256, hidden_dim: 512, head_dim: 64, ..ModelConfig::tiny_gqa() };
/// let bytes = random_gguf(&cfg, 7, |name| match name {
///     "token_embd" | "output" | "ffn_down" => GgmlType::Q6K,
///     _ => GgmlType::Q4K,
/// })?;
/// let w = handoff::model::gguf::load_gguf_bytes(bytes)?;
/// assert_eq!(w.config.dim, 256);
/// # Ok::<(), handoff::model::ModelError>(())
/// ```
///
/// Refused with [`ModelError::InvalidConfig`]: a config the `llama`
/// architecture cannot state (rotate-half RoPE, Llama 3 RoPE scaling,
/// attention biases), a type this crate does not compute with, and a
/// quantized matrix whose rows are not whole blocks.
pub fn random_gguf(
    cfg: &ModelConfig,
    seed: u64,
    ty: impl Fn(&str) -> GgmlType,
) -> Result<Vec<u8>, ModelError> {
    cfg.validate()?;
    let refuse = |what: &str| {
        Err(ModelError::InvalidConfig(format!(
            "a GGUF of architecture llama cannot hold {what}"
        )))
    };
    if cfg.rope_style != RopeStyle::Interleaved {
        return refuse("rotate-half RoPE (llama's is interleaved)");
    }
    if cfg.attention_bias {
        return refuse("attention biases");
    }
    let u32_of = |what: &str, n: usize| {
        u32::try_from(n).map_err(|_| ModelError::InvalidConfig(format!("{what} of {n}")))
    };
    let mut w = GgufWriter::new()
        .kv("general.architecture", GgufValue::String("llama".into()))
        .kv(
            "llama.block_count",
            GgufValue::U32(u32_of("layers", cfg.n_layers)?),
        )
        .kv(
            "llama.embedding_length",
            GgufValue::U32(u32_of("dim", cfg.dim)?),
        )
        .kv(
            "llama.feed_forward_length",
            GgufValue::U32(u32_of("hidden dim", cfg.hidden_dim)?),
        )
        .kv(
            "llama.attention.head_count",
            GgufValue::U32(u32_of("heads", cfg.n_heads)?),
        )
        .kv(
            "llama.attention.head_count_kv",
            GgufValue::U32(u32_of("KV heads", cfg.n_kv_heads)?),
        )
        .kv(
            "llama.attention.key_length",
            GgufValue::U32(u32_of("head dim", cfg.head_dim)?),
        )
        .kv(
            "llama.context_length",
            GgufValue::U32(u32_of("context", cfg.max_seq_len)?),
        )
        .kv("llama.rope.freq_base", GgufValue::F32(cfg.rope_theta))
        .kv(
            "llama.attention.layer_norm_rms_epsilon",
            GgufValue::F32(cfg.norm_eps),
        )
        .kv(
            "tokenizer.ggml.tokens",
            GgufValue::Array(GgufArray::String(
                (0..cfg.vocab_size).map(|i| format!("<{i}>")).collect(),
            )),
        );
    match cfg.rope_scaling {
        RopeScaling::None => {}
        RopeScaling::Linear { factor } => {
            w = w
                .kv(
                    "llama.rope.scaling.type",
                    GgufValue::String("linear".into()),
                )
                .kv("llama.rope.scaling.factor", GgufValue::F32(factor));
        }
        RopeScaling::Llama3 { .. } => return refuse("Llama 3 RoPE scaling"),
    }

    let (d, h, v) = (cfg.dim, cfg.hidden_dim, cfg.vocab_size);
    let qd = cfg.n_heads * cfg.head_dim;
    let kvd = cfg.n_kv_heads * cfg.head_dim;
    let std = matrix_std(cfg);
    // Each tensor's own seed stream, numbered in file order.
    let mut id = 0u64;
    // A matrix: GGUF name, base name for `ty`, rows, cols, spread.
    let mut put = |w: GgufWriter, name: &str, base: &str, rows: usize, cols: usize, s: f32| {
        id += 1;
        let t = ty(base);
        let data = random_tensor(t, rows, cols, seed, id, s)
            .map_err(|why| ModelError::InvalidConfig(format!("{name} as {t}: {why}")))?;
        Ok::<_, ModelError>(w.tensor(name, &[cols as u64, rows as u64], t, data))
    };
    let norm = |w: GgufWriter, name: &str, layer: usize| {
        let id = u64::MAX - layer as u64;
        w.f32_tensor(name, &[d as u64], &tensor(d, seed, id, 1.0, 0.05))
    };
    let embd_std = if cfg.tied_embeddings { std.output } else { 1.0 };
    w = put(w, "token_embd.weight", "token_embd", v, d, embd_std)?;
    for l in 0..cfg.n_layers {
        let n = |t: &str| format!("blk.{l}.{t}.weight");
        w = norm(w, &n("attn_norm"), 2 * l);
        w = put(w, &n("attn_q"), "attn_q", qd, d, std.into_dim)?;
        w = put(w, &n("attn_k"), "attn_k", kvd, d, std.into_dim)?;
        w = put(w, &n("attn_v"), "attn_v", kvd, d, std.into_dim)?;
        w = put(w, &n("attn_output"), "attn_output", d, qd, std.from_heads)?;
        w = norm(w, &n("ffn_norm"), 2 * l + 1);
        w = put(w, &n("ffn_gate"), "ffn_gate", h, d, std.into_dim)?;
        w = put(w, &n("ffn_down"), "ffn_down", d, h, std.from_hidden)?;
        w = put(w, &n("ffn_up"), "ffn_up", h, d, std.into_dim)?;
    }
    w = norm(w, "output_norm.weight", 2 * cfg.n_layers);
    if !cfg.tied_embeddings {
        w = put(w, "output.weight", "output", v, d, std.output)?;
    }
    Ok(w.finish())
}

/// One `[rows, cols]` matrix stored as `ty`, with values of standard
/// deviation about `std`; `Err` says why `ty` cannot hold it.
fn random_tensor(
    ty: GgmlType,
    rows: usize,
    cols: usize,
    seed: u64,
    id: u64,
    std: f32,
) -> Result<Vec<u8>, String> {
    let n = rows * cols;
    let floats = || tensor(n, seed, id, 0.0, std);
    match ty {
        GgmlType::F32 => return Ok(floats().iter().flat_map(|x| x.to_le_bytes()).collect()),
        GgmlType::F16 => {
            let v = floats().into_iter().map(half::f16::from_f32);
            return Ok(v.flat_map(|x| x.to_le_bytes()).collect());
        }
        GgmlType::Bf16 => {
            let v = floats().into_iter().map(half::bf16::from_f32);
            return Ok(v.flat_map(|x| x.to_le_bytes()).collect());
        }
        _ => {}
    }
    let fields = match scale_fields(ty) {
        Some(f) if ty.computable() => f,
        _ => return Err("this crate does not compute with it".into()),
    };
    let be = ty.block_elems() as usize;
    let bb = ty.block_bytes() as usize;
    if !cols.is_multiple_of(be) {
        return Err(format!("rows of {cols} are not whole blocks of {be}"));
    }
    let blocks = n / be;
    let mut data = vec![0u8; blocks * bb];
    data.par_chunks_mut(BLOCKS_PER_CHUNK * bb)
        .enumerate()
        .for_each(|(c, chunk)| {
            let mut rng = chunk_rng(seed, id, c);
            for word in chunk.chunks_mut(8) {
                let r = rng.next_u64().to_le_bytes();
                word.copy_from_slice(&r[..word.len()]);
            }
        });
    // The scale fields at (1, offset) first, to measure the quants' spread;
    // every value is linear in the fields together, so scaling both by one
    // factor scales the matrix by it.
    let offset = offset_field(ty);
    let set = |data: &mut [u8], scale: f32| {
        for b in data.chunks_exact_mut(bb) {
            for (i, &at) in fields.iter().enumerate() {
                let x = if i == 0 { scale } else { scale * offset };
                b[at..at + 2].copy_from_slice(&half::f16::from_f32(x).to_le_bytes());
            }
        }
    };
    let sample = blocks.min(SAMPLE_BLOCKS) * bb;
    set(&mut data[..sample], 1.0);
    let mut y = vec![0f32; blocks.min(SAMPLE_BLOCKS) * be];
    dequantize(ty, &data[..sample], &mut y);
    let rms = (y.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>() / y.len() as f64).sqrt();
    let scale = if rms > 0.0 {
        (f64::from(std) / rms) as f32
    } else {
        0.0
    };
    data.par_chunks_mut(BLOCKS_PER_CHUNK * bb)
        .for_each(|chunk| set(chunk, scale));
    Ok(data)
}

/// The second scale field relative to the first, for the types that have
/// one, so that the block's values centre near zero: Q4_1/Q5_1 add `m` to
/// `d * q` (q up to 15 or 31); Q4_K/Q5_K subtract `dmin * m` from
/// `d * sc * q` (sc and m both 6-bit, alike on average).
fn offset_field(ty: GgmlType) -> f32 {
    match ty {
        GgmlType::Q4_1 => -7.5,
        GgmlType::Q5_1 => -15.5,
        GgmlType::Q4K => 7.5,
        GgmlType::Q5K => 15.5,
        _ => 0.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::CpuBackend;
    use crate::model::Model;
    use crate::model::gguf::load_gguf_bytes;

    fn cfg() -> ModelConfig {
        ModelConfig {
            dim: 256,
            hidden_dim: 512,
            head_dim: 64,
            n_layers: 2,
            vocab_size: 320,
            ..ModelConfig::tiny_gqa()
        }
    }

    fn rms_mean(v: &[f32]) -> (f64, f64) {
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
        let var = v
            .iter()
            .map(|&x| (f64::from(x) - mean).powi(2))
            .sum::<f64>()
            / n;
        (var.sqrt(), mean)
    }

    #[test]
    fn every_computable_type_loads_with_the_spread_of_random_weights() {
        let want = crate::model::random_weights(&cfg(), 3);
        for ty in GgmlType::every().filter(|t| t.computable()) {
            let bytes = random_gguf(&cfg(), 3, |_| ty).unwrap();
            assert_eq!(bytes, random_gguf(&cfg(), 3, |_| ty).unwrap(), "{ty}");
            assert_ne!(bytes, random_gguf(&cfg(), 4, |_| ty).unwrap(), "{ty}");
            let w = load_gguf_bytes(bytes).unwrap();
            assert_eq!(w.config, cfg(), "{ty}");
            let pairs = [
                (&w.embedding, &want.embedding),
                (&w.layers[1].wq, &want.layers[1].wq),
                (&w.layers[0].wo, &want.layers[0].wo),
                (&w.layers[1].w2, &want.layers[1].w2),
                (w.lm_head.as_ref().unwrap(), want.lm_head.as_ref().unwrap()),
            ];
            for (got, like) in pairs {
                let ((s, m), (ws, _)) = (rms_mean(got), rms_mean(like));
                assert!(got.iter().all(|x| x.is_finite()), "{ty}");
                assert!(
                    (0.9..1.1).contains(&(s / ws)),
                    "{ty}: spread {s} against {ws}"
                );
                assert!(m.abs() < 0.15 * ws, "{ty}: mean {m} against spread {ws}");
            }
            assert_eq!(w.layers[1].attn_norm.len(), 256);
        }
    }

    #[test]
    fn a_quantized_mix_is_placed_in_its_blocks_and_runs() {
        let q4km = |name: &str| match name {
            "token_embd" | "output" | "ffn_down" => GgmlType::Q6K,
            _ => GgmlType::Q4K,
        };
        let bytes = random_gguf(&cfg(), 9, q4km).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        std::fs::write(&path, &bytes).unwrap();
        let blocks = Model::load(CpuBackend::with_threads(1), &path).unwrap();
        let wide =
            Model::new(CpuBackend::with_threads(1), load_gguf_bytes(bytes).unwrap()).unwrap();
        // Q4_K is 4.5 bits a weight, Q6_K 6.5: under a quarter of f32's.
        assert!(blocks.weight_bytes() * 4 < wide.weight_bytes());
        let l = blocks.logits_for_prompt(&[1, 2, 3]).unwrap();
        assert!(l.iter().flatten().all(|x| x.is_finite()));
    }

    #[test]
    fn what_llama_cannot_state_or_blocks_cannot_hold_is_refused() {
        let half = ModelConfig {
            rope_style: RopeStyle::Half,
            ..cfg()
        };
        let bias = ModelConfig {
            attention_bias: true,
            ..cfg()
        };
        let llama3 = ModelConfig {
            rope_scaling: ModelConfig::llama_3_2_1b_shape(1).rope_scaling,
            ..cfg()
        };
        for c in [half, bias, llama3] {
            let e = random_gguf(&c, 1, |_| GgmlType::Q8_0).unwrap_err();
            assert!(matches!(e, ModelError::InvalidConfig(_)), "{e}");
        }
        let tiny = ModelConfig::tiny_gqa(); // dim 64: not whole Q4_K blocks
        let e = random_gguf(&tiny, 1, |_| GgmlType::Q4K).unwrap_err();
        assert!(e.to_string().contains("whole blocks"), "{e}");
        let e = random_gguf(&cfg(), 1, |_| GgmlType::Q2K).unwrap_err();
        assert!(e.to_string().contains("does not compute"), "{e}");
        let linear = ModelConfig {
            rope_scaling: RopeScaling::Linear { factor: 2.0 },
            ..cfg()
        };
        let w = load_gguf_bytes(random_gguf(&linear, 1, |_| GgmlType::Q8_0).unwrap()).unwrap();
        assert_eq!(w.config, linear);
    }
}
