//! Story: a script tokenizes texts and conversations with
//! `examples/tokenize.rs` and parses its stdout: a JSON array of id arrays
//! (BOS only where the model says), or with `--chat` an array of
//! `{"rendered", "ids"}`. The ids must be the model's own: Python
//! `tokenizers`' for the Hugging Face fixture folder, the reference
//! implementation's for the SmolLM2 GGUF (see tests/text_tokenizer.rs). Bad input is exit status 2, the reason on stderr, nothing on
//! stdout.

use crate::support::text_support;

use std::path::Path;

use serde_json::{Value, json};
use text_support::{run_example, smollm2_path};

fn fixture(rel: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(rel);
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn hf_dir() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/text/hf_tiny")
        .display()
        .to_string()
}

fn stdout_json(out: &std::process::Output) -> Value {
    assert!(
        out.status.success(),
        "exit {:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn texts_become_the_ids_python_tokenizers_gives() {
    let f = fixture("tests/fixtures/text/hf_tiny/expected.json");
    let cases = f["texts"].as_array().unwrap();
    let texts: Vec<&Value> = cases.iter().map(|c| &c["text"]).collect();
    let want: Vec<&Value> = cases.iter().map(|c| &c["ids"]).collect();
    let Some(out) = run_example(
        "tokenize",
        &["--model", &hf_dir()],
        &json!(texts).to_string(),
    ) else {
        return;
    };
    assert_eq!(stdout_json(&out), json!(want));
}

#[test]
fn conversations_become_the_rendered_template_and_its_ids() {
    let input = json!([[{"role": "user", "content": "hi"}], []]);
    let Some(out) = run_example(
        "tokenize",
        &["--model", &hf_dir(), "--chat"],
        &input.to_string(),
    ) else {
        return;
    };
    // <|user|>=2, "hi" = 22 23 in Python tokenizers' encoding, <|end|>=4, <|assistant|>=3.
    assert_eq!(
        stdout_json(&out),
        json!([
            {"rendered": "<|user|>hi<|end|><|assistant|>", "ids": [2, 22, 23, 4, 3]},
            {"rendered": "<|assistant|>", "ids": [3]}
        ])
    );
}

#[test]
fn smollm2_texts_become_the_ids_the_reference_gives() {
    if !smollm2_path().is_file() {
        eprintln!("SKIP: {} is absent", smollm2_path().display());
        return;
    }
    let f = fixture("tests/fixtures/text/smollm2_tokens.json");
    let cases = f["texts"].as_array().unwrap();
    let texts: Vec<&Value> = cases.iter().map(|c| &c["text"]).collect();
    let want: Vec<&Value> = cases.iter().map(|c| &c["ids"]).collect();
    let model = smollm2_path().display().to_string();
    let Some(out) = run_example("tokenize", &["--model", &model], &json!(texts).to_string()) else {
        return;
    };
    assert_eq!(stdout_json(&out), json!(want));
}

#[test]
fn bad_input_exits_2_with_the_reason_and_nothing_on_stdout() {
    let no_tokenizer = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf_tiny_llama")
        .display()
        .to_string();
    let hf = hf_dir();
    let cases: Vec<(&str, Vec<&str>, &str)> = vec![
        ("no model", vec![], "[]"),
        ("unknown flag", vec!["--model", &hf, "--bogus"], "[]"),
        ("not JSON", vec!["--model", &hf], "hello"),
        ("not an array", vec!["--model", &hf], "{\"a\": 1}"),
        ("not a string", vec!["--model", &hf], "[\"ok\", 3]"),
        (
            "not a conversation",
            vec!["--model", &hf, "--chat"],
            "[\"hi\"]",
        ),
        (
            "message without content",
            vec!["--model", &hf, "--chat"],
            "[[{\"role\": \"user\"}]]",
        ),
        (
            "folder without a tokenizer",
            vec!["--model", &no_tokenizer],
            "[\"hi\"]",
        ),
        (
            "missing model",
            vec!["--model", "/nonexistent/m.gguf"],
            "[\"hi\"]",
        ),
    ];
    for (what, args, stdin) in cases {
        let Some(out) = run_example("tokenize", &args, stdin) else {
            return;
        };
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{what}: {stderr}");
        assert!(out.stdout.is_empty(), "{what}: stdout {:?}", out.stdout);
        assert!(
            stderr.contains("error:") && !stderr.contains("panicked"),
            "{what}: {stderr}"
        );
    }
}
