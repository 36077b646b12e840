//! Story: a user points the official `openai` Python client at the server
//! (with an API key): the model list, chats and completions whole and
//! streamed (the same tokens either way, greedy), a seeded sampled
//! completion twice (the same tokens), eight concurrent streaming chats
//! (all alike), and the client's own error classes for an over-window
//! prompt, `n=2`, an unknown model and a bad key.
//!
//! The client runs in the virtual environment `scripts/openai-venv.sh`
//! creates (`.ci/run` does); without it (no Python, no PyPI) the test says
//! so on stderr and returns.

use crate::support::openai_client;

use std::path::Path;
use std::process::Command;

use openai_client::Server;
use serde_json::Value;

const WINDOW: usize = 256;

#[test]
fn the_official_python_client_works_against_the_server() {
    let python = crate::support::openai_python();
    if !python.is_file() {
        eprintln!(
            "skipped: no {} (run scripts/openai-venv.sh: it needs python3 and PyPI)",
            python.display()
        );
        return;
    }
    let keys = std::env::temp_dir().join(format!("handoff-openai-pykeys-{}", std::process::id()));
    std::fs::write(&keys, "sk-test 42\n").unwrap();
    let window = WINDOW.to_string();
    let server = Server::start(&[
        "--api-keys",
        keys.to_str().unwrap(),
        "--max-context",
        &window,
    ]);
    let _ = std::fs::remove_file(&keys);
    let Some(server) = server else {
        return;
    };
    let over = (WINDOW + 1).to_string();
    let out = Command::new(&python)
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/server/support/drive.py"))
        .args([&server.url("/v1"), "sk-test", "handoff-random", &over])
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "drive.py failed:\n{}\nserver log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        server.log()
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();

    assert_eq!(r["models"], serde_json::json!(["handoff-random"]));
    let chat = &r["chat"]["ok"];
    assert_eq!(chat["object"], "chat.completion", "{r}");
    assert_eq!(chat["role"], "assistant");
    assert_eq!(chat["finish_reason"], "length");
    assert_eq!(chat["usage"]["completion_tokens"], 12);
    assert_eq!(chat["token_ids"].as_array().unwrap().len(), 12);
    let stream = &r["chat_stream"]["ok"];
    assert_eq!(stream["token_ids"], chat["token_ids"], "streamed = whole");
    assert_eq!(stream["content"], chat["content"]);
    assert_eq!(stream["roles"], serde_json::json!(["assistant"]));
    assert_eq!(stream["finish_reason"], "length");
    assert_eq!(stream["usage"], chat["usage"]);

    let completion = &r["completion"]["ok"];
    assert_eq!(
        completion["usage"]["prompt_tokens"], 16,
        "bytes of the prompt"
    );
    assert_eq!(
        r["completion_stream"]["ok"]["token_ids"],
        completion["token_ids"]
    );
    assert_eq!(r["completion_stream"]["ok"]["text"], completion["text"]);

    assert_eq!(
        r["seeded"][0]["ok"], r["seeded"][1]["ok"],
        "same seed, same draw"
    );
    assert_eq!(r["seeded"][0]["ok"].as_array().unwrap().len(), 8);

    for c in r["concurrent"].as_array().unwrap() {
        assert_eq!(c["ok"]["token_ids"], chat["token_ids"], "{c}");
    }

    let err = |k: &str| r[k]["error"].clone();
    assert_eq!(err("over_window")["status"], 413, "{r}");
    assert_eq!(err("over_window")["code"], "context_length_exceeded");
    assert_eq!(err("n2")["class"], "BadRequestError");
    assert_eq!(err("unknown_model")["class"], "NotFoundError");
    assert_eq!(err("bad_key")["class"], "AuthenticationError");
    assert_eq!(err("bad_key")["code"], "invalid_api_key");
}
