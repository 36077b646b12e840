//! Story: a Qwen2 checkpoint carries biases on its Q, K and V projections,
//! added before RoPE. A forward pass that skipped one of them would still
//! produce plausible text, just not the model's: nothing else in the suite
//! loads a model with biases through the forward pass, so this file checks
//! handoff against the independent naive reference (tests/support/naive_llama.rs) on
//! seeded random weights with biases and rotate-half RoPE, the Qwen2 shape.
//!
//! The biases are scaled up so that dropping any one of them moves the
//! logits far beyond the tolerance; the last test proves it on the
//! reference side, so the comparison cannot pass with a bias ignored.

use crate::support::naive_llama;
use crate::support::serving_path;

use handoff::model::{Model, ModelConfig, ModelWeights, RopeStyle, random_weights};
use naive_llama::to_f64;
use serving_path::handoff_greedy;

/// The logit tolerance.
const TOL: f64 = 1e-4;

/// Qwen2-shaped weights: GQA, rotate-half RoPE, Q/K/V biases of standard
/// deviation about 1 (as large as the projections themselves).
fn weights() -> ModelWeights {
    let cfg = ModelConfig {
        attention_bias: true,
        qk_norm: false,
        gemma: None,
        rope_style: RopeStyle::Half,
        rope_scaling: Default::default(),
        rope_theta: 1_000_000.0,
        norm_eps: 1e-6,
        ..ModelConfig::tiny_gqa()
    };
    let mut w = random_weights(&cfg, 2024);
    for l in &mut w.layers {
        for b in [&mut l.bq, &mut l.bk, &mut l.bv] {
            for x in b.as_mut().expect("attention_bias gives biases") {
                *x *= 10.0;
            }
        }
    }
    w
}

/// A deterministic prompt of `n` token ids below `vocab`.
fn prompt(n: usize, seed: u64, vocab: usize) -> Vec<u32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((s >> 33) % vocab as u64) as u32
        })
        .collect()
}

/// Largest |a - b| over every position and token, with its position.
fn max_diff(reference: &[Vec<f64>], ours: &[Vec<f64>]) -> (f64, usize) {
    assert_eq!(reference.len(), ours.len(), "positions");
    let mut worst = (0.0, 0);
    for (p, (r, o)) in reference.iter().zip(ours).enumerate() {
        assert_eq!(r.len(), o.len(), "vocab at position {p}");
        for (a, b) in r.iter().zip(o) {
            let d = (a - b).abs();
            if d.is_nan() || d > worst.0 {
                worst = (d, p);
            }
        }
    }
    worst
}

fn handoff_logits(model: &Model, p: &[u32]) -> Vec<Vec<f64>> {
    let rows = model.logits_for_prompt(p).unwrap();
    rows.iter().map(|r| to_f64(r)).collect()
}

#[test]
fn handoff_logits_with_qkv_biases_match_the_reference_at_every_position() {
    let w = weights();
    let reference = naive_llama::from_weights(&w);
    let model = Model::cpu(w).unwrap();
    for (n, seed) in [(1, 0), (23, 7), (70, 99)] {
        let p = prompt(n, seed, reference.vocab_size);
        let (d, pos) = max_diff(
            &reference.logits_for_prompt(&p),
            &handoff_logits(&model, &p),
        );
        assert!(d <= TOL, "{n} tokens: differs by {d:e} at position {pos}");
    }
}

#[test]
fn handoff_greedy_tokens_with_qkv_biases_equal_the_reference() {
    let w = weights();
    let reference = naive_llama::from_weights(&w);
    let model = Model::cpu(w).unwrap();
    for (n, seed, new) in [(5, 1, 24), (40, 3, 24)] {
        let p = prompt(n, seed, reference.vocab_size);
        let (expected, gaps) = reference.greedy(&p, new);
        // Equality is only meaningful where no choice is within rounding of a tie.
        let min_gap = gaps.iter().cloned().fold(f64::INFINITY, f64::min);
        assert!(min_gap > 10.0 * TOL, "prompt of {n}: top-2 gap {min_gap:e}");
        // Paged prefill + decode, pages of 4 so attention crosses pages.
        assert_eq!(
            handoff_greedy(&model, &p, new, 4),
            expected,
            "prompt of {n}"
        );
    }
}

/// The comparison above can only catch a skipped bias if skipping it moves
/// the logits well past the tolerance: check that for each of bq, bk, bv in
/// turn, on the reference side.
#[test]
fn dropping_any_one_bias_moves_logits_far_beyond_the_tolerance() {
    let w = weights();
    let full = naive_llama::from_weights(&w);
    let p = prompt(23, 7, full.vocab_size);
    let expected = full.logits_for_prompt(&p);
    for which in ["bq", "bk", "bv"] {
        let mut dropped = naive_llama::from_weights(&w);
        for l in &mut dropped.layers {
            match which {
                "bq" => l.bq = None,
                "bk" => l.bk = None,
                _ => l.bv = None,
            }
        }
        let (d, _) = max_diff(&expected, &dropped.logits_for_prompt(&p));
        assert!(
            d > 1000.0 * TOL,
            "without {which} logits move by only {d:e}"
        );
    }
}
