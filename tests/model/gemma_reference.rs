//! Story: a user serves a Gemma 3 checkpoint (GGUF or a Hugging Face
//! folder) and expects the tokens the architecture defines: embeddings
//! scaled by sqrt(hidden), norms before and after attention and the MLP,
//! per-head q/k norms, two RoPE bases, sliding-window attention on the
//! local layers, GELU gating, tied output.
//!
//! tests/fixtures/tiny_gemma3 was written by scripts/make_gemma_fixtures.py:
//! seeded random weights (6 layers, the last one global; a window of 8; one
//! KV head of 32) and the logits of a float64 forward pass that script
//! writes from the architecture, independent of handoff, at every position
//! of four prompts (one of 66 tokens: past the window and across a
//! 64-position tile), with their greedy continuations. capped.json is the
//! same weights with another attention scale and final logit soft-capping
//! (Gemma 2's), with its own record.

use std::path::{Path, PathBuf};

use handoff::backend::CpuBackend;
use handoff::model::gguf::load_gguf;
use handoff::model::{Model, ModelWeights, RopeStyle, load_hf, load_hf_bytes};

use crate::support::hf_fixture::{Case, expected_in};
use crate::support::serving_path::{assert_logits, batch_greedy, handoff_greedy};

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tiny_gemma3");

fn gguf() -> PathBuf {
    Path::new(DIR).join("model.gguf")
}

fn hf() -> PathBuf {
    Path::new(DIR).join("hf")
}

/// Cases of `file` (expected.json or expected_capped.json).
fn cases(file: &str) -> Vec<Case> {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(Path::new(DIR).join(file), dir.path().join("expected.json")).unwrap();
    expected_in(dir.path().to_str().unwrap())
}

/// The logits at every position, greedy one by one (pages of 4 and of 16)
/// and greedy as one batch of mixed prompt lengths all equal the
/// reference's.
fn conforms(model: &Model, cases: &[Case], what: &str) {
    let lens: Vec<usize> = cases.iter().map(|c| c.prompt.len()).collect();
    assert_eq!(
        lens,
        [3, 20, 1, 66],
        "past the window, across a tile, mixed"
    );
    assert_logits(model, cases, 1e-4, what);
    for case in cases {
        for page in [4, 16] {
            let ours = handoff_greedy(model, &case.prompt, case.greedy.len(), page);
            assert_eq!(ours, case.greedy, "{what}: prompt {:?}", case.prompt);
        }
    }
    let want: Vec<Vec<u32>> = cases.iter().map(|c| c.greedy.clone()).collect();
    assert_eq!(batch_greedy(model, cases, 4), want, "{what}: as one batch");
}

#[test]
fn gemma3_from_gguf_and_from_hugging_face_read_as_the_same_model() {
    let g = load_gguf(&gguf()).unwrap();
    let h = load_hf(&hf()).unwrap();
    let c = &h.config;
    assert_eq!((c.n_heads, c.n_kv_heads, c.head_dim), (4, 1, 32));
    assert_eq!((c.rope_theta, c.rope_style), (1e6, RopeStyle::Half));
    assert!(c.qk_norm && c.tied_embeddings && !c.attention_bias);
    let gm = c.gemma.expect("a Gemma config");
    assert_eq!((gm.sliding_window, gm.global_every), (8, 6));
    assert_eq!((gm.local_rope_theta, gm.query_pre_attn_scalar), (1e4, 32.0));
    assert_eq!(gm.final_logit_softcap, None);
    assert_eq!(
        (0..6).map(|i| gm.is_global(i)).collect::<Vec<_>>(),
        [false, false, false, false, false, true]
    );
    for l in &h.layers {
        assert_eq!(l.post_attn_norm.as_ref().map(Vec::len), Some(64));
        assert_eq!(l.post_ffn_norm.as_ref().map(Vec::len), Some(64));
    }
    // The GGUF stores 1 + w; Hugging Face w, to which the loader adds 1.
    assert_eq!(g, h);
    let fp = |w: ModelWeights| Model::cpu(w).unwrap().fingerprint();
    assert_eq!(fp(g.clone()), fp(h.clone()));
    // The window is part of the model's identity.
    let mut other = g.clone();
    if let Some(gm) = other.config.gemma.as_mut() {
        gm.sliding_window = 9;
    }
    assert_ne!(fp(other), fp(g));
}

#[test]
fn gemma3_from_hugging_face_serves_the_reference_logits_and_tokens() {
    let model = Model::load(CpuBackend::new(), &hf()).unwrap();
    conforms(&model, &cases("expected.json"), "gemma3 HF");
}

#[test]
fn gemma3_from_gguf_serves_the_reference_logits_and_tokens() {
    let model = Model::load(CpuBackend::new(), &gguf()).unwrap();
    conforms(&model, &cases("expected.json"), "gemma3 GGUF");
}

#[test]
fn another_attention_scale_and_soft_capped_logits_serve_their_reference() {
    // transformers 5's per-layer-type rope_parameters, query_pre_attn_scalar
    // 24 (not head_dim) and final_logit_softcapping 5, same weights.
    let config = std::fs::read(Path::new(DIR).join("capped.json")).unwrap();
    let st = std::fs::read(hf().join("model.safetensors")).unwrap();
    let w = load_hf_bytes(&config, &[("model.safetensors", &st)]).unwrap();
    let gm = w.config.gemma.expect("a Gemma config");
    assert_eq!(
        (gm.query_pre_attn_scalar, gm.final_logit_softcap),
        (24.0, Some(5.0))
    );
    assert_eq!((w.config.rope_theta, gm.local_rope_theta), (1e6, 1e4));
    let model = Model::cpu(w).unwrap();
    let cases = cases("expected_capped.json");
    for row in model.logits_for_prompt(&cases[1].prompt).unwrap() {
        assert!(row.iter().all(|x| x.abs() <= 5.0), "capped at 5");
    }
    conforms(&model, &cases, "gemma3 capped");
}

#[test]
fn without_its_window_gemma3_is_a_different_model() {
    // The window matters on this fixture: attending to everything on the
    // local layers changes the tokens of the long prompt, so the stories
    // above would catch a pass that ignored it.
    let mut w = load_hf(&hf()).unwrap();
    if let Some(gm) = w.config.gemma.as_mut() {
        gm.sliding_window = w.config.max_seq_len;
    }
    let model = Model::cpu(w).unwrap();
    let cases = cases("expected.json");
    let long = &cases[3];
    assert_ne!(
        handoff_greedy(&model, &long.prompt, long.greedy.len(), 4),
        long.greedy,
        "the window changes no token of the long prompt"
    );
}
