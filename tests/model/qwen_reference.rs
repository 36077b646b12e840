//! Story: a user serves a Qwen2 GGUF, or a Qwen3 checkpoint (GGUF or a
//! Hugging Face folder), and expects the tokens the architecture defines.
//!
//! tests/fixtures/tiny_qwen2_gguf and tiny_qwen3 were written by
//! scripts/make_qwen_fixtures.py: seeded random weights (Qwen2 with q/k/v
//! biases and tied output; Qwen3 with per-head q/k RMS norms and a head_dim
//! of 32 where hidden/heads is 16), and the logits of a float64 forward pass
//! that script writes from each architecture, independent of handoff, at
//! every position of three prompts, with its greedy continuations. The
//! Qwen3 GGUF and HF folder hold the same weights and share the record.

use std::path::{Path, PathBuf};

use handoff::backend::CpuBackend;
use handoff::model::gguf::load_gguf;
use handoff::model::{Model, ModelWeights, RopeStyle, load_hf};

use crate::support::hf_fixture::expected_in;
use crate::support::serving_path::{assert_logits, batch_greedy, handoff_greedy};

/// Logits may differ from the float64 reference by this much relative to
/// the row's largest magnitude (float32 accumulation).
const REL_TOL: f64 = 1e-4;

const QWEN2: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/tiny_qwen2_gguf"
);
const QWEN3: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tiny_qwen3");

fn gguf(dir: &str) -> PathBuf {
    Path::new(dir).join("model.gguf")
}

fn hf(dir: &str) -> PathBuf {
    Path::new(dir).join("hf")
}

/// The logits at every position, greedy one by one and greedy as one batch
/// of mixed prompt lengths all equal the reference's.
fn conforms(model: &Model, dir: &str, what: &str) {
    let cases = expected_in(dir);
    assert_eq!(cases.len(), 3);
    assert_logits(model, &cases, REL_TOL, what);
    for case in &cases {
        let ours = handoff_greedy(model, &case.prompt, case.greedy.len(), 4);
        assert_eq!(ours, case.greedy, "{what}: prompt {:?}", case.prompt);
    }
    let lens: Vec<usize> = cases.iter().map(|c| c.prompt.len()).collect();
    assert_eq!(lens, [3, 20, 1], "the batch mixes prompt lengths");
    let want: Vec<Vec<u32>> = cases.iter().map(|c| c.greedy.clone()).collect();
    assert_eq!(batch_greedy(model, &cases, 4), want, "{what}: as one batch");
}

#[test]
fn a_qwen2_gguf_reads_as_qwen2_biases_rotate_half_tied() {
    let w = load_gguf(&gguf(QWEN2)).unwrap();
    let c = &w.config;
    assert_eq!((c.dim, c.hidden_dim, c.n_layers), (64, 128, 2));
    assert_eq!((c.n_heads, c.n_kv_heads, c.head_dim), (4, 2, 16));
    assert_eq!(
        (c.vocab_size, c.max_seq_len, c.rope_theta),
        (128, 128, 1000.0)
    );
    assert_eq!(c.rope_style, RopeStyle::Half);
    assert!(c.attention_bias && !c.qk_norm && c.tied_embeddings);
    for l in &w.layers {
        assert_eq!(l.bq.as_ref().map(Vec::len), Some(64));
        assert_eq!(l.bk.as_ref().map(Vec::len), Some(32));
        assert_eq!(l.bv.as_ref().map(Vec::len), Some(32));
        assert!(l.q_norm.is_none() && l.k_norm.is_none());
    }
}

#[test]
fn a_qwen2_gguf_serves_the_reference_logits_and_tokens() {
    let model = Model::load(CpuBackend::new(), &gguf(QWEN2)).unwrap();
    conforms(&model, QWEN2, "qwen2 GGUF");
}

#[test]
fn qwen3_from_gguf_and_from_hugging_face_read_as_the_same_model() {
    let g = load_gguf(&gguf(QWEN3)).unwrap();
    let h = load_hf(&hf(QWEN3)).unwrap();
    let c = &h.config;
    assert_eq!((c.n_heads, c.n_kv_heads, c.head_dim), (4, 2, 32));
    assert_ne!(c.head_dim, c.dim / c.n_heads, "head_dim is its own");
    assert_eq!(c.rope_style, RopeStyle::Half);
    assert!(c.qk_norm && !c.attention_bias && !c.tied_embeddings);
    for l in &h.layers {
        assert_eq!(l.q_norm.as_ref().map(Vec::len), Some(32));
        assert_eq!(l.k_norm.as_ref().map(Vec::len), Some(32));
        assert!(l.bq.is_none());
    }
    // The same weights and config: the GGUF's context and eps agree too.
    assert_eq!(g, h);
    let fp = |w: ModelWeights| Model::cpu(w).unwrap().fingerprint();
    assert_eq!(fp(g.clone()), fp(h));
    // The q/k norms are part of the fingerprint: other gains, other model.
    let mut other = g.clone();
    if let Some(q) = other.layers[1].q_norm.as_mut() {
        q[3] += 0.5;
    }
    assert_ne!(fp(other), fp(g));
}

#[test]
fn qwen3_from_hugging_face_serves_the_reference_logits_and_tokens() {
    let model = Model::load(CpuBackend::new(), &hf(QWEN3)).unwrap();
    conforms(&model, QWEN3, "qwen3 HF");
}

#[test]
fn qwen3_from_gguf_serves_the_reference_logits_and_tokens() {
    let model = Model::load(CpuBackend::new(), &gguf(QWEN3)).unwrap();
    conforms(&model, QWEN3, "qwen3 GGUF");
}

#[test]
fn without_its_q_k_norms_qwen3_is_a_different_model() {
    // The norms matter on this fixture: dropping them changes the tokens,
    // so the stories above would catch a pass that skipped them.
    let mut w = load_hf(&hf(QWEN3)).unwrap();
    w.config.qk_norm = false;
    for l in &mut w.layers {
        (l.q_norm, l.k_norm) = (None, None);
    }
    let model = Model::cpu(w).unwrap();
    let cases = expected_in(QWEN3);
    let differs = cases
        .iter()
        .any(|c| handoff_greedy(&model, &c.prompt, c.greedy.len(), 4) != c.greedy);
    assert!(differs, "the q/k norms change no token of the fixture");
}
