//! tests/fixtures/hf_tiny_llama (and hf_tiny_llama3, the same shape with
//! Llama 3.1's RoPE scaling), written by transformers itself
//! (scripts/make_hf_fixture.py): where they are, and what transformers
//! recorded for them in expected.json.

use std::path::Path;

pub const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/hf_tiny_llama");
pub const FIXTURE_LLAMA3: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/hf_tiny_llama3");

/// One recorded prompt.
pub struct Case {
    pub prompt: Vec<u32>,
    /// transformers' float32 logits at every position.
    pub logits: Vec<Vec<f64>>,
    /// transformers' greedy continuation.
    pub greedy: Vec<u32>,
}

/// The recorded prompts of [`FIXTURE`], in file order.
pub fn expected() -> Vec<Case> {
    expected_in(FIXTURE)
}

/// The recorded prompts of the fixture in `dir`, in file order.
pub fn expected_in(dir: &str) -> Vec<Case> {
    let raw = std::fs::read(Path::new(dir).join("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&raw).unwrap();
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            prompt: ids(&c["prompt"]),
            logits: c["logits"]
                .as_array()
                .unwrap()
                .iter()
                .map(|row| {
                    row.as_array()
                        .unwrap()
                        .iter()
                        .map(|x| x.as_f64().unwrap())
                        .collect()
                })
                .collect(),
            greedy: ids(&c["greedy_new_tokens"]),
        })
        .collect()
}
