//! Llama 3 checkpoints ship bf16 weights, Llama 2's f16. Widened to f32 at
//! load, a 1B model took twice its file's size in memory, and each decode
//! step streamed twice the bytes it needed. The CPU backend now keeps a
//! matrix whose every value is exactly a bf16 (or an f16) in that format and
//! widens it exactly inside its kernels: half the memory, and the same
//! numbers bit for bit, so everything checked against the f32 path
//! (transformers' logits, batch invariance) still holds.

use handoff::backend::CpuBackend;
use handoff::model::{Model, ModelConfig, ModelWeights, RopeStyle, random_weights};
use handoff::{Engine, EngineConfig, KvDtype};

/// Wide enough (dim and hidden >= 256) that its matrices use the row-major
/// kernels, as a real model's do; small enough for a debug test.
fn config() -> ModelConfig {
    ModelConfig {
        dim: 256,
        hidden_dim: 512,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 64,
        vocab_size: 384,
        max_seq_len: 128,
        rope_theta: 500_000.0,
        rope_style: RopeStyle::Half,
        rope_scaling: Default::default(),
        norm_eps: 1e-5,
        tied_embeddings: true,
        attention_bias: false,
        qk_norm: false,
        gemma: None,
    }
}

/// A bf16 checkpoint's values.
fn bf16(x: f32) -> f32 {
    f32::from_bits(x.to_bits() & 0xffff_0000)
}

/// An f16 checkpoint's values.
fn f16(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// Every weight as a checkpoint in the format of `round` reads.
fn as_checkpoint(mut w: ModelWeights, round: fn(f32) -> f32) -> ModelWeights {
    let round = |v: &mut Vec<f32>| {
        for x in v.iter_mut() {
            *x = round(*x);
        }
    };
    round(&mut w.embedding);
    round(&mut w.final_norm);
    if let Some(h) = w.lm_head.as_mut() {
        round(h);
    }
    for l in &mut w.layers {
        for v in [
            &mut l.attn_norm,
            &mut l.wq,
            &mut l.wk,
            &mut l.wv,
            &mut l.wo,
            &mut l.ffn_norm,
            &mut l.w1,
            &mut l.w2,
            &mut l.w3,
        ] {
            round(v);
        }
    }
    w
}

fn model(w: &ModelWeights, compact: bool) -> Model {
    Model::new(
        CpuBackend::with_threads(2).compact_weights(compact),
        w.clone(),
    )
    .unwrap()
}

fn generate(m: Model, prompts: &[Vec<u32>], new: usize) -> Vec<Vec<u32>> {
    let cfg = EngineConfig::colocated(m.kv_geometry(KvDtype::BF16))
        .max_context(128)
        .page_size(16)
        .pool_tokens(2048)
        .build()
        .unwrap();
    let mut e = Engine::new(m, cfg).unwrap();
    let requests = crate::support::prompt_requests(prompts, new);
    crate::support::finished_tokens(&mut e, requests)
}

/// Half the bytes, and logits identical bit for bit to f32 storage.
fn half_the_memory_same_logits(round: fn(f32) -> f32, seed: u64) {
    let w = as_checkpoint(random_weights(&config(), seed), round);
    let compact = model(&w, true);
    let wide = model(&w, false);

    // Matrices halve; the norm vectors (5 KB) stay f32. `weight_bytes`
    // counts what the allocations hold, so spare capacity shows too.
    let (c, f) = (compact.weight_bytes(), wide.weight_bytes());
    assert!(c * 2 <= f + 8 * 1024, "compact {c} bytes, f32 {f} bytes");
    assert!(c * 2 >= f - 8 * 1024, "compact {c} bytes, f32 {f} bytes");

    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 5) % 384).collect();
    let a = compact.logits_for_prompt(&prompt).unwrap();
    let b = wide.logits_for_prompt(&prompt).unwrap();
    let bits = |v: &[Vec<f32>]| -> Vec<u32> { v.iter().flatten().map(|x| x.to_bits()).collect() };
    assert_eq!(bits(&a), bits(&b), "logits differ from f32 storage");
}

#[test]
fn a_bf16_checkpoint_takes_half_the_memory_and_gives_the_same_logits_bit_for_bit() {
    half_the_memory_same_logits(bf16, 11);
}

#[test]
fn an_f16_checkpoint_takes_half_the_memory_and_gives_the_same_logits_bit_for_bit() {
    half_the_memory_same_logits(f16, 14);
}

#[test]
fn generation_from_16_bit_weights_equals_f32_weights_alone_and_in_a_batch() {
    for (round, seed) in [(bf16 as fn(f32) -> f32, 12), (f16, 15)] {
        let w = as_checkpoint(random_weights(&config(), seed), round);
        let prompts: Vec<Vec<u32>> = (0..6)
            .map(|p| {
                (0..(3 + 9 * p))
                    .map(|i| (i * 31 + p * 7 + 1) % 384)
                    .collect()
            })
            .collect();
        let wide = generate(model(&w, false), &prompts, 12);
        let compact = generate(model(&w, true), &prompts, 12);
        assert_eq!(compact, wide);
        // Alone, each prompt gives what it gave in the batch.
        for (p, want) in prompts.iter().zip(&compact) {
            assert_eq!(
                &generate(model(&w, true), std::slice::from_ref(p), 12)[0],
                want
            );
        }
    }
}

#[test]
fn weights_that_are_not_exactly_16_bit_stay_f32() {
    // Random f32 weights: nearly no value is exactly a bf16 or an f16.
    let w = random_weights(&config(), 13);
    let compact = model(&w, true);
    let wide = model(&w, false);
    assert_eq!(compact.weight_bytes(), wide.weight_bytes());
}
