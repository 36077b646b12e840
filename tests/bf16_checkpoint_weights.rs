//! Llama 3 checkpoints ship bf16 weights. Widened to f32 at load, a 1B model
//! took twice its file's size in memory, and each decode step streamed twice
//! the bytes it needed. The CPU backend now keeps a matrix whose every value
//! is exactly a bf16 as bf16 and widens it exactly inside its kernels: half
//! the memory, and the same numbers bit for bit, so everything checked
//! against the f32 path (transformers' logits, batch invariance) still holds.

use handoff::backend::CpuBackend;
use handoff::model::{Model, ModelConfig, ModelWeights, RopeStyle, random_weights};
use handoff::{Engine, EngineConfig, KvDtype, Outcome, Request, RequestId, Role, TenantId};

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
    }
}

/// Truncates every weight to bf16, as a bf16 checkpoint reads.
fn as_bf16_checkpoint(mut w: ModelWeights) -> ModelWeights {
    let round = |v: &mut Vec<f32>| {
        for x in v.iter_mut() {
            *x = f32::from_bits(x.to_bits() & 0xffff_0000);
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
    let cfg = EngineConfig::builder(Role::Colocated, m.kv_geometry(KvDtype::BF16))
        .max_context(128)
        .page_size(16)
        .pool_tokens(2048)
        .build()
        .unwrap();
    let mut e = Engine::new(m, cfg).unwrap();
    let handles: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            e.submit(Request::new(
                RequestId(i as u64),
                TenantId(1),
                p.clone(),
                new,
            ))
            .unwrap()
        })
        .collect();
    e.run_until_idle();
    assert!(e.pool_stats().is_full());
    handles
        .into_iter()
        .map(|h| {
            let (tokens, outcome) = h.try_collect();
            assert!(matches!(outcome, Some(Outcome::Finished(_))), "{outcome:?}");
            tokens
        })
        .collect()
}

#[test]
fn a_bf16_checkpoint_takes_half_the_memory_and_gives_the_same_logits_bit_for_bit() {
    let w = as_bf16_checkpoint(random_weights(&config(), 11));
    let compact = model(&w, true);
    let wide = model(&w, false);

    // Matrices halve; the norm vectors (a few KB) stay f32.
    let (c, f) = (compact.weight_bytes(), wide.weight_bytes());
    assert!(c * 2 <= f + 64 * 1024, "compact {c} bytes, f32 {f} bytes");
    assert!(c * 2 >= f - 64 * 1024, "compact {c} bytes, f32 {f} bytes");

    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 5) % 384).collect();
    let a = compact.logits_for_prompt(&prompt).unwrap();
    let b = wide.logits_for_prompt(&prompt).unwrap();
    let bits = |v: &[Vec<f32>]| -> Vec<u32> { v.iter().flatten().map(|x| x.to_bits()).collect() };
    assert_eq!(
        bits(&a),
        bits(&b),
        "logits differ between bf16 and f32 storage"
    );
}

#[test]
fn generation_from_bf16_weights_equals_f32_weights_alone_and_in_a_batch() {
    let w = as_bf16_checkpoint(random_weights(&config(), 12));
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

#[test]
fn weights_that_are_not_exactly_bf16_stay_f32() {
    // Random f32 weights: nearly no value is exactly a bf16.
    let w = random_weights(&config(), 13);
    let compact = model(&w, true);
    let wide = model(&w, false);
    assert_eq!(compact.weight_bytes(), wide.weight_bytes());
}
