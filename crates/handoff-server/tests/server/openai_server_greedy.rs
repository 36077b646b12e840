//! Story: greedy decoding through HTTP gives exactly the tokens the engine
//! gives without it. The embedded random-weights model answers, streamed
//! and whole, several clients at once, with the ids `examples/generate.rs`
//! prints for the same weights (written to a llama2.c file) and prompts;
//! a Hugging Face checkpoint served with `--model` answers with the ids
//! transformers recorded for it, and, having no tokenizer, refuses text
//! prompts with a 400 that says to send ids.

use crate::support::openai_client;

use handoff::model::{ModelConfig, random_weights, write_llama2c};
use openai_client::{Server, post};
use serde_json::{Value, json};

/// The embedded model's seed (crates/handoff-server/src/stack.rs).
const RANDOM_SEED: u64 = 2026;
const NEW: usize = 12;

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap_or_else(|| panic!("no token ids in {v}"))
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

/// The ids a completion answered with, whole or streamed.
fn completion_ids(server: &Server, prompt: &[u32], stream: bool) -> Vec<u32> {
    let a = post(
        server,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": NEW, "temperature": 0,
            "stream": stream, "return_token_ids": true}),
        None,
    );
    assert_eq!(a.status, 200, "{}", a.body);
    if !stream {
        return ids(&a.json()["choices"][0]["token_ids"]);
    }
    a.events()
        .iter()
        .filter(|e| *e != "[DONE]")
        .flat_map(|e| {
            let v: Value = serde_json::from_str(e).unwrap();
            ids(&v["choices"][0]["token_ids"])
        })
        .collect()
}

#[test]
fn http_greedy_equals_generate_on_the_random_model() {
    let prompts: Vec<Vec<u32>> = vec![
        vec![1, 2, 3],
        (0..40).map(|i| (i * 37 + 11) % 384).collect(),
        vec![300, 5, 255, 17, 9],
    ];
    let file =
        std::env::temp_dir().join(format!("handoff-openai-random-{}.bin", std::process::id()));
    let weights = random_weights(&ModelConfig::tiny_gqa(), RANDOM_SEED);
    std::fs::write(&file, write_llama2c(&weights).unwrap()).unwrap();
    let csv: Vec<String> = prompts
        .iter()
        .map(|p| p.iter().map(u32::to_string).collect::<Vec<_>>().join(","))
        .collect();
    let mut args = vec!["--model", file.to_str().unwrap()];
    for p in &csv {
        args.extend(["--prompt-ids", p]);
    }
    let new = NEW.to_string();
    args.extend(["--max-new-tokens", &new, "--temperature", "0"]);
    let generated = crate::support::run_example("generate", &args);
    let _ = std::fs::remove_file(&file);
    let Some(out) = generated else {
        return;
    };
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let expected: Vec<Vec<u32>> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| l.split(' ').map(|t| t.parse().unwrap()).collect())
        .collect();
    assert_eq!(expected.len(), prompts.len());

    let Some(server) = Server::start(&[]) else {
        return;
    };
    let server = std::sync::Arc::new(server);
    // Every prompt, whole and streamed, from concurrent clients.
    let clients: Vec<_> = prompts
        .iter()
        .flat_map(|p| [(p.clone(), false), (p.clone(), true)])
        .map(|(p, stream)| {
            let server = server.clone();
            std::thread::spawn(move || completion_ids(&server, &p, stream))
        })
        .collect();
    let answers: Vec<Vec<u32>> = clients.into_iter().map(|c| c.join().unwrap()).collect();
    for (i, want) in expected.iter().enumerate() {
        assert_eq!(&answers[2 * i], want, "prompt {i}, whole");
        assert_eq!(&answers[2 * i + 1], want, "prompt {i}, streamed");
    }
}

#[test]
fn a_checkpoint_without_tokenizer_answers_with_transformers_ids() {
    let fixture = crate::support::hf_fixture();
    let Some(server) = Server::start(&["--model", fixture.to_str().unwrap()]) else {
        return;
    };
    let name = openai_client::curl(&[&server.url("/v1/models")]).json()["data"][0]["id"].clone();
    assert_eq!(name, "hf_tiny_llama");
    for case in crate::support::hf_expected() {
        let a = post(
            &server,
            "/v1/completions",
            &json!({"model": name, "prompt": case.prompt, "max_tokens": case.greedy.len(),
                "temperature": 0}),
            None,
        );
        assert_eq!(a.status, 200, "{}", a.body);
        let choice = &a.json()["choices"][0];
        assert_eq!(ids(&choice["token_ids"]), case.greedy);
        assert_eq!(choice["text"], "", "no tokenizer: no invented text");
    }
    let text = post(
        &server,
        "/v1/completions",
        &json!({"prompt": "hello", "max_tokens": 2}),
        None,
    );
    assert_eq!(text.status, 400);
    assert!(
        text.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("token ids"),
        "{}",
        text.body
    );
    let chat = post(
        &server,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}]}),
        None,
    );
    assert_eq!(chat.status, 400, "{}", chat.body);
}
