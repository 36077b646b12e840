//! Story: a user serves a Hugging Face Llama checkpoint and expects the
//! tokens transformers would produce. tests/fixtures/hf_tiny_llama was
//! written by transformers itself (scripts/make_hf_fixture.py): a random
//! LlamaForCausalLM with GQA (4 query / 2 KV heads), a separate lm_head, RoPE
//! base 1000 in the newer `rope_parameters` spelling, and random RMSNorm
//! weights, plus transformers' float32 logits at every position of three
//! prompts and its greedy continuations.
//!
//! Three layers of evidence, so a disagreement points at its cause:
//! 1. the loader reads exactly the bytes and hyper-parameters transformers saved;
//! 2. those weights, through an independent naive f64 forward pass
//!    (tests/support/naive_llama.rs), reproduce transformers' logits: the loader's
//!    mapping (names, layouts, rotate-half RoPE) is right;
//! 3. handoff's own forward pass reproduces them too (logits within 1e-4
//!    at every position; greedy tokens exactly, through paged prefill+decode).

use crate::support::hf_fixture;
use crate::support::naive_llama;
use crate::support::serving_path;

use std::path::Path;

use handoff::model::{Model, ModelWeights, RopeStyle, load_hf};
use hf_fixture::{FIXTURE, expected};
use naive_llama::{argmax_gap, to_f64};
use safetensors::SafeTensors;
use serving_path::handoff_greedy;

/// Logit tolerance of the issue: float32 transformers vs handoff.
const LOGIT_TOL: f64 = 1e-4;

fn weights() -> ModelWeights {
    load_hf(Path::new(FIXTURE)).unwrap()
}

/// Largest |a - b| over all positions, with where it happened.
fn max_diff(a: &[Vec<f64>], b: &[Vec<f64>]) -> (f64, usize, usize) {
    assert_eq!(a.len(), b.len(), "position count");
    let mut worst = (0.0, 0, 0);
    for (p, (ra, rb)) in a.iter().zip(b).enumerate() {
        assert_eq!(ra.len(), rb.len(), "vocab size at position {p}");
        for (i, (x, y)) in ra.iter().zip(rb).enumerate() {
            let d = (x - y).abs();
            if d.is_nan() || d > worst.0 {
                worst = (d, p, i);
            }
        }
    }
    worst
}

#[test]
fn loader_reads_the_hyper_parameters_transformers_saved() {
    let c = weights().config;
    assert_eq!((c.dim, c.hidden_dim, c.n_layers), (64, 128, 2));
    assert_eq!((c.n_heads, c.n_kv_heads, c.head_dim), (4, 2, 16));
    assert_eq!((c.vocab_size, c.max_seq_len), (128, 128));
    assert_eq!(c.rope_theta, 1000.0, "rope_parameters.rope_theta");
    assert_eq!(c.rope_style, RopeStyle::Half);
    assert_eq!(c.norm_eps, 1e-5);
    assert!(!c.tied_embeddings && !c.attention_bias);
}

#[test]
fn loader_reads_every_tensor_byte_for_byte() {
    let w = weights();
    let bytes = std::fs::read(Path::new(FIXTURE).join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let f32s = |name: &str| -> Vec<f32> {
        st.tensor(name)
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    };
    assert_eq!(w.embedding, f32s("model.embed_tokens.weight"));
    assert_eq!(w.final_norm, f32s("model.norm.weight"));
    let lm_head = w.lm_head.as_deref().expect("separate lm_head");
    assert_eq!(lm_head, f32s("lm_head.weight"));
    assert_ne!(lm_head, w.embedding.as_slice(), "the fixture is untied");
    assert_eq!(w.layers.len(), 2);
    for (l, layer) in w.layers.iter().enumerate() {
        let p = format!("model.layers.{l}");
        for (got, name) in [
            (&layer.attn_norm, "input_layernorm.weight"),
            (&layer.wq, "self_attn.q_proj.weight"),
            (&layer.wk, "self_attn.k_proj.weight"),
            (&layer.wv, "self_attn.v_proj.weight"),
            (&layer.wo, "self_attn.o_proj.weight"),
            (&layer.ffn_norm, "post_attention_layernorm.weight"),
            (&layer.w1, "mlp.gate_proj.weight"),
            (&layer.w2, "mlp.down_proj.weight"),
            (&layer.w3, "mlp.up_proj.weight"),
        ] {
            assert_eq!(*got, f32s(&format!("{p}.{name}")), "{p}.{name}");
        }
        assert!(layer.bq.is_none() && layer.bk.is_none() && layer.bv.is_none());
    }
}

#[test]
fn loaded_weights_reproduce_transformers_through_an_independent_forward_pass() {
    let m = naive_llama::from_weights(&weights());
    for case in expected() {
        let ours = m.logits_for_prompt(&case.prompt);
        let (d, pos, tok) = max_diff(&ours, &case.logits);
        assert!(
            d <= LOGIT_TOL,
            "prompt {:?}: naive forward over loaded weights differs from transformers by {d:e} \
             at position {pos}, token {tok}",
            case.prompt
        );
        let (greedy, gaps) = m.greedy(&case.prompt, case.greedy.len());
        assert_eq!(greedy, case.greedy, "prompt {:?}", case.prompt);
        // The fixture's promise: every greedy choice is far from a tie.
        let min_gap = gaps.iter().cloned().fold(f64::INFINITY, f64::min);
        assert!(min_gap > 100.0 * LOGIT_TOL, "greedy gap {min_gap}");
        assert_eq!(argmax_gap(case.logits.last().unwrap()).0, greedy[0]);
    }
}

#[test]
fn handoff_logits_match_transformers_at_every_position() {
    let model = Model::cpu(weights()).unwrap();
    for case in expected() {
        let ours: Vec<Vec<f64>> = model
            .logits_for_prompt(&case.prompt)
            .unwrap()
            .iter()
            .map(|row| to_f64(row))
            .collect();
        let (d, pos, tok) = max_diff(&ours, &case.logits);
        assert!(
            d <= LOGIT_TOL,
            "prompt {:?}: handoff differs from transformers by {d:e} at position {pos}, token {tok}",
            case.prompt
        );
    }
}

#[test]
fn handoff_greedy_tokens_equal_transformers() {
    let model = Model::cpu(weights()).unwrap();
    for case in expected() {
        let ours = handoff_greedy(&model, &case.prompt, case.greedy.len(), 4);
        assert_eq!(ours, case.greedy, "prompt {:?}", case.prompt);
    }
    // The sharded copy of the same checkpoint serves the same tokens.
    let sharded = Model::cpu(load_hf(&Path::new(FIXTURE).join("sharded")).unwrap()).unwrap();
    let case = &expected()[1];
    assert_eq!(
        handoff_greedy(&sharded, &case.prompt, case.greedy.len(), 4),
        case.greedy
    );
}
