//! Story: an operator reads the server's log. Every API request leaves one
//! structured line under the target `access` when it is answered: its
//! tenant (from the key; `none` when no key identified one), endpoint,
//! outcome, status, prompt and completion tokens and duration. The text of
//! the prompt appears nowhere in the log.

use crate::support::openai_client::{Server, post};

use std::time::{Duration, Instant};

use serde_json::json;

const SECRET: &str = "the-launch-code-is-swordfish";

/// The log's access lines.
fn access_lines(log: &str) -> Vec<String> {
    log.lines()
        .filter(|l| l.contains(" access: request "))
        .map(str::to_string)
        .collect()
}

#[test]
fn one_access_line_per_request_with_tenant_tokens_outcome_and_no_text() {
    let keys = std::env::temp_dir().join(format!("handoff-access-keys-{}", std::process::id()));
    std::fs::write(&keys, "sk-seven 7\n").unwrap();
    let Some(server) = Server::start(&["--api-keys", keys.to_str().unwrap()]) else {
        return;
    };
    let ok = post(
        &server,
        "/v1/completions",
        &json!({"prompt": SECRET, "max_tokens": 3}),
        Some("sk-seven"),
    );
    assert_eq!(ok.status, 200, "{}", ok.body);
    let prompt_tokens = ok.json()["usage"]["prompt_tokens"].as_u64().unwrap();
    let stranger = post(
        &server,
        "/v1/completions",
        &json!({"prompt": SECRET, "max_tokens": 3}),
        Some("sk-nobody"),
    );
    assert_eq!(stranger.status, 401);
    let bad = post(
        &server,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": SECRET}], "max_tokens": 0}),
        Some("sk-seven"),
    );
    assert_eq!(bad.status, 400, "{}", bad.body);

    let until = Instant::now() + Duration::from_secs(10);
    let lines = loop {
        let lines = access_lines(&server.log());
        if lines.len() >= 3 || Instant::now() > until {
            break lines;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(lines.len(), 3, "{lines:#?}");
    let finished = &lines[0];
    for field in [
        "tenant=\"7\"".to_string(),
        "endpoint=\"completions\"".into(),
        "outcome=\"finished\"".into(),
        "status=200".into(),
        format!("prompt_tokens={prompt_tokens}"),
        "completion_tokens=3".into(),
        "duration_ms=".into(),
    ] {
        assert!(finished.contains(&field), "{field} missing: {finished}");
    }
    assert!(lines[1].contains("tenant=\"none\""), "{}", lines[1]);
    assert!(lines[1].contains("status=401"), "{}", lines[1]);
    assert!(lines[2].contains("tenant=\"7\""), "{}", lines[2]);
    assert!(lines[2].contains("endpoint=\"chat\""), "{}", lines[2]);
    assert!(lines[2].contains("status=400"), "{}", lines[2]);
    assert!(lines[2].contains("outcome=\"invalid\""), "{}", lines[2]);
    let log = server.log();
    assert!(
        !log.contains(SECRET),
        "the prompt's text is in the log:\n{log}"
    );
    let _ = std::fs::remove_file(&keys);
}
