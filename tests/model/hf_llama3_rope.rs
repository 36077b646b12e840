//! Story: a user serves a Llama 3.x checkpoint. Those stretch RoPE's
//! frequencies (`rope_type: "llama3"`); an engine that read only the base
//! would rotate every position by the wrong angle and generate plausible
//! nonsense, so before this was implemented the loader refused the file.
//!
//! tests/fixtures/hf_tiny_llama3 was written by transformers itself
//! (`scripts/make_hf_fixture.py hf_tiny_llama3`): a random LlamaForCausalLM
//! whose scaling keeps one frequency, blends one and stretches the other six,
//! with transformers' float32 logits and greedy tokens for three prompts.

use crate::support::hf_fixture;
use crate::support::naive_llama;
use crate::support::serving_path;

use std::path::Path;

use handoff::model::{Model, ModelWeights, RopeScaling, load_hf};
use hf_fixture::{FIXTURE_LLAMA3, expected_in};
use naive_llama::to_f64;
use serving_path::handoff_greedy;

/// Logit tolerance of the conformance issue: float32 transformers vs handoff.
const LOGIT_TOL: f64 = 1e-4;

fn weights() -> ModelWeights {
    load_hf(Path::new(FIXTURE_LLAMA3)).unwrap()
}

/// Largest |a - b| over every logit of every position.
fn max_diff(a: &[Vec<f64>], b: &[Vec<f64>]) -> f64 {
    assert_eq!(a.len(), b.len(), "position count");
    a.iter()
        .zip(b)
        .flat_map(|(ra, rb)| ra.iter().zip(rb).map(|(x, y)| (x - y).abs()))
        .fold(
            0.0,
            |m, d| if d.is_nan() { f64::INFINITY } else { m.max(d) },
        )
}

fn handoff_logits(model: &Model, prompt: &[u32]) -> Vec<Vec<f64>> {
    model
        .logits_for_prompt(prompt)
        .unwrap()
        .iter()
        .map(|row| to_f64(row))
        .collect()
}

#[test]
fn the_loader_reads_the_scaling_transformers_saved() {
    let c = weights().config;
    assert_eq!(c.rope_theta, 1000.0);
    assert_eq!(
        c.rope_scaling,
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 32,
        }
    );
    assert_eq!(c.max_seq_len, 128, "the window is max_position_embeddings");
}

#[test]
fn an_independent_forward_pass_over_the_loaded_weights_reproduces_transformers() {
    let m = naive_llama::from_weights(&weights());
    for case in expected_in(FIXTURE_LLAMA3) {
        let d = max_diff(&m.logits_for_prompt(&case.prompt), &case.logits);
        assert!(d <= LOGIT_TOL, "prompt {:?}: {d:e}", case.prompt);
        assert_eq!(m.greedy(&case.prompt, case.greedy.len()).0, case.greedy);
    }
}

#[test]
fn handoff_matches_transformers_logits_and_greedy_tokens() {
    let model = Model::cpu(weights()).unwrap();
    for case in expected_in(FIXTURE_LLAMA3) {
        let d = max_diff(&handoff_logits(&model, &case.prompt), &case.logits);
        assert!(d <= LOGIT_TOL, "prompt {:?}: {d:e}", case.prompt);
        for page_size in [1, 4, 16] {
            assert_eq!(
                handoff_greedy(&model, &case.prompt, case.greedy.len(), page_size),
                case.greedy,
                "prompt {:?}, page size {page_size}",
                case.prompt
            );
        }
    }
}

#[test]
fn the_fixture_would_catch_an_engine_that_ignored_the_scaling() {
    let mut w = weights();
    w.config.rope_scaling = RopeScaling::None;
    let plain = Model::cpu(w).unwrap();
    let case = &expected_in(FIXTURE_LLAMA3)[1];
    let d = max_diff(&handoff_logits(&plain, &case.prompt), &case.logits);
    assert!(
        d > 1000.0 * LOGIT_TOL,
        "plain RoPE is only {d:e} off transformers: the fixture does not exercise the scaling"
    );
}

#[test]
fn the_transformers_4_spelling_serves_the_same_model() {
    // Llama 3.x checkpoints on the Hub spell it as transformers 4 did: a
    // top-level rope_theta and a rope_scaling object with the same keys.
    let dir = tempfile::tempdir().unwrap();
    let src = Path::new(FIXTURE_LLAMA3);
    std::fs::copy(
        src.join("model.safetensors"),
        dir.path().join("model.safetensors"),
    )
    .unwrap();
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    let obj = config.as_object_mut().unwrap();
    let mut params = obj.remove("rope_parameters").unwrap();
    let theta = params
        .as_object_mut()
        .unwrap()
        .remove("rope_theta")
        .unwrap();
    obj.insert("rope_theta".into(), theta);
    obj.insert("rope_scaling".into(), params);
    std::fs::write(
        dir.path().join("config.json"),
        serde_json::to_vec(&config).unwrap(),
    )
    .unwrap();

    let old = load_hf(dir.path()).unwrap();
    assert_eq!(old, weights());
    let model = Model::cpu(old).unwrap();
    let case = &expected_in(FIXTURE_LLAMA3)[1];
    let d = max_diff(&handoff_logits(&model, &case.prompt), &case.logits);
    assert!(d <= LOGIT_TOL, "{d:e}");
}
