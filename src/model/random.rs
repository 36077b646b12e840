//! Seeded random weights for any [`ModelConfig`]: tests, benches, demos.
//!
//! Weights are uniform with the variance of a standard initialisation
//! (`1/in` for projections), norms near 1, and an output projection scaled
//! so that logits spread over a few units: greedy decoding has clear winners
//! and outputs differ from prompt to prompt.

use rayon::prelude::*;

use crate::model::{LayerWeights, ModelConfig, ModelWeights, RopeScaling, RopeStyle};
use crate::rng::SplitMix64;

const CHUNK: usize = 1 << 16;

/// The stream of chunk `c` of tensor `id`: each chunk seeded on its own, so
/// tensors fill in parallel and still the same for the same seed.
pub(crate) fn chunk_rng(seed: u64, id: u64, c: usize) -> SplitMix64 {
    SplitMix64::new(
        seed ^ id.wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ (c as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93),
    )
}

/// Fills a tensor with `center + U(-a, a)`, `a = std * sqrt(3)`; chunks are
/// seeded independently so generation is parallel and still deterministic.
pub(crate) fn tensor(len: usize, seed: u64, id: u64, center: f32, std: f32) -> Vec<f32> {
    let a = std * 3f32.sqrt();
    let mut v = vec![0f32; len];
    let fill = |(c, chunk): (usize, &mut [f32])| {
        let mut rng = chunk_rng(seed, id, c);
        for x in chunk {
            *x = center + a * (2.0 * rng.next_f32() - 1.0);
        }
    };
    if len > 4 * CHUNK {
        v.par_chunks_mut(CHUNK).enumerate().for_each(fill);
    } else {
        v.chunks_mut(CHUNK).enumerate().for_each(fill);
    }
    v
}

/// The standard deviations of a config's random matrices: a standard
/// initialisation (`1/in`) for the projections, and an output head whose
/// logits have a standard deviation of about 4.
pub(crate) struct MatrixStd {
    /// Projections from the model dimension (q, k, v, gate, up).
    pub into_dim: f32,
    /// The attention output projection (from the heads).
    pub from_heads: f32,
    /// The down projection (from the hidden dimension).
    pub from_hidden: f32,
    /// The output head (and a tied embedding).
    pub output: f32,
}

pub(crate) fn matrix_std(cfg: &ModelConfig) -> MatrixStd {
    let inv = |n: usize| 1.0 / (n.max(1) as f32).sqrt();
    MatrixStd {
        into_dim: inv(cfg.dim),
        from_heads: inv(cfg.n_heads * cfg.head_dim),
        from_hidden: inv(cfg.hidden_dim),
        output: 4.0 * inv(cfg.dim),
    }
}

/// Random weights for `cfg`, the same for the same `(cfg, seed)`.
pub fn random_weights(cfg: &ModelConfig, seed: u64) -> ModelWeights {
    let (d, h, v) = (cfg.dim, cfg.hidden_dim, cfg.vocab_size);
    let qd = cfg.n_heads * cfg.head_dim;
    let kvd = cfg.n_kv_heads * cfg.head_dim;
    let std = matrix_std(cfg);
    let mut id = 0u64;
    let mut next = || {
        id += 1;
        id
    };
    let embedding = tensor(
        v * d,
        seed,
        next(),
        0.0,
        if cfg.tied_embeddings { std.output } else { 1.0 },
    );
    let layers = (0..cfg.n_layers)
        .map(|_| {
            let bias =
                |n: usize, id: u64| cfg.attention_bias.then(|| tensor(n, seed, id, 0.0, 0.1));
            let mut l = LayerWeights {
                attn_norm: tensor(d, seed, next(), 1.0, 0.05),
                wq: tensor(qd * d, seed, next(), 0.0, std.into_dim),
                wk: tensor(kvd * d, seed, next(), 0.0, std.into_dim),
                wv: tensor(kvd * d, seed, next(), 0.0, std.into_dim),
                wo: tensor(d * qd, seed, next(), 0.0, std.from_heads),
                bq: bias(qd, next()),
                bk: bias(kvd, next()),
                bv: bias(kvd, next()),
                q_norm: None,
                k_norm: None,
                post_attn_norm: None,
                ffn_norm: tensor(d, seed, next(), 1.0, 0.05),
                post_ffn_norm: None,
                w1: tensor(h * d, seed, next(), 0.0, std.into_dim),
                w2: tensor(d * h, seed, next(), 0.0, std.from_hidden),
                w3: tensor(h * d, seed, next(), 0.0, std.into_dim),
            };
            // Drawn last, so configs without them keep every other draw.
            if cfg.qk_norm {
                l.q_norm = Some(tensor(cfg.head_dim, seed, next(), 1.0, 0.05));
                l.k_norm = Some(tensor(cfg.head_dim, seed, next(), 1.0, 0.05));
            }
            if cfg.gemma.is_some() {
                l.post_attn_norm = Some(tensor(d, seed, next(), 1.0, 0.05));
                l.post_ffn_norm = Some(tensor(d, seed, next(), 1.0, 0.05));
            }
            l
        })
        .collect();
    let final_norm = tensor(d, seed, next(), 1.0, 0.05);
    let lm_head = (!cfg.tied_embeddings).then(|| tensor(v * d, seed, next(), 0.0, std.output));
    ModelWeights {
        config: cfg.clone(),
        embedding,
        layers,
        final_norm,
        lm_head,
    }
}

impl ModelConfig {
    /// A small Llama-shaped config for tests: GQA (4 query heads over 2 KV
    /// heads), separate output projection, llama2.c conventions.
    pub fn tiny_gqa() -> Self {
        ModelConfig {
            dim: 64,
            hidden_dim: 160,
            n_layers: 3,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 16,
            vocab_size: 384,
            max_seq_len: 1024,
            rope_theta: 10_000.0,
            rope_style: RopeStyle::Interleaved,
            rope_scaling: RopeScaling::None,
            norm_eps: 1e-5,
            tied_embeddings: false,
            attention_bias: false,
            qk_norm: false,
            gemma: None,
        }
    }

    /// The shape of Llama-3.2-1B (with `n_layers` layers instead of 16, to
    /// fit memory): dim 2048, 32 heads over 8 KV heads of 64, SwiGLU 8192,
    /// vocab 128256, tied embeddings, RoPE base 500000 with Llama 3's
    /// scaling (factor 32 over 8192 pre-training positions), rotate-half.
    pub fn llama_3_2_1b_shape(n_layers: usize) -> Self {
        ModelConfig {
            dim: 2048,
            hidden_dim: 8192,
            n_layers,
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: 64,
            vocab_size: 128_256,
            max_seq_len: 131_072,
            rope_theta: 500_000.0,
            rope_style: RopeStyle::Half,
            rope_scaling: RopeScaling::Llama3 {
                factor: 32.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 8192,
            },
            norm_eps: 1e-5,
            tied_embeddings: true,
            attention_bias: false,
            qk_norm: false,
            gemma: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_per_seed_and_shaped_by_config() {
        let cfg = ModelConfig {
            attention_bias: true,
            ..ModelConfig::tiny_gqa()
        };
        let a = random_weights(&cfg, 1);
        assert_eq!(a, random_weights(&cfg, 1));
        assert_ne!(a.layers[0].wq, random_weights(&cfg, 2).layers[0].wq);
        a.check_shapes().unwrap();
    }
}
