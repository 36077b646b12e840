//! Story: a newcomer runs the README's third command, the server with
//! SmolLM2-135M-Instruct, and asks it what the capital of France is, with
//! curl and then streaming through the official `openai` Python client.
//! The answer names Paris, ends on the model's own end-of-turn token
//! (`finish_reason` `stop`), counts its tokens, and the streamed text is the
//! whole answer's text; the second ask starts from the prompt pages the
//! first one left in the prefix cache. Every page is back afterwards.
//!
//! Skips with the reason when the model is not fetched
//! (`scripts/fetch-models.sh`); the Python half
//! skips without the venv `scripts/openai-venv.sh` makes.

use crate::support::openai_client::{Server, post, sample};

use std::process::Command;
use std::time::Duration;

use serde_json::json;

const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1";
const QUESTION: &str = "What is the capital of France?";

/// The Python half: one streamed, greedy chat; prints the text.
const STREAM_PY: &str = r#"
import sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1], api_key="unused")
stream = client.chat.completions.create(
    model=sys.argv[2],
    messages=[{"role": "user", "content": sys.argv[3]}],
    max_tokens=16, temperature=0, stream=True)
parts, finish = [], None
for chunk in stream:
    for c in chunk.choices:
        if c.delta and c.delta.content:
            parts.append(c.delta.content)
        if c.finish_reason:
            finish = c.finish_reason
print("".join(parts))
print(finish)
"#;

#[test]
fn smollm2_answers_the_readme_question_over_http() {
    let path = crate::support::smollm2_path();
    if !path.is_file() {
        eprintln!(
            "SKIP: {} is absent (run scripts/fetch-models.sh, or set HANDOFF_SMOLLM2)",
            path.display()
        );
        return;
    }
    let Some(server) = Server::start(&["--model", path.to_str().unwrap(), "--threads", "2"]) else {
        return;
    };
    let body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 16,
        "temperature": 0,
    });
    let a = post(&server, "/v1/chat/completions", &body, None);
    assert_eq!(a.status, 200, "{}\n{}", a.body, server.log());
    let v = a.json();
    let content = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(content.contains("Paris"), "{content:?}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    let completion = v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
    assert!((1..=16).contains(&completion), "{v}");
    assert!(
        v["usage"]["prompt_tokens"].as_u64().unwrap_or(0) > 20,
        "{v}"
    );

    let python = crate::support::openai_python();
    if python.is_file() {
        let out = Command::new(&python)
            .args(["-c", STREAM_PY, &server.url("/v1"), MODEL, QUESTION])
            .output()
            .expect("python runs");
        assert!(
            out.status.success(),
            "{}\n{}",
            String::from_utf8_lossy(&out.stderr),
            server.log()
        );
        let printed = String::from_utf8(out.stdout).unwrap();
        let mut lines = printed.lines();
        assert_eq!(lines.next(), Some(content.as_str()), "streamed = whole");
        assert_eq!(lines.next(), Some("stop"));
        let m = server.metrics();
        assert!(
            sample(&m, "handoff_reused_prompt_tokens_total", &[]) > 0.0,
            "the second ask reused the first one's prompt pages:\n{m}"
        );
    } else {
        eprintln!(
            "skipped the Python half: no {} (scripts/openai-venv.sh)",
            python.display()
        );
    }
    let m = server.wait_pools_idle(Duration::from_secs(20));
    assert_eq!(
        sample(&m, "handoff_pool_pages", &["state=\"in_use\""]),
        0.0,
        "{m}"
    );
    assert_eq!(sample(&m, "handoff_isolation_violations", &[]), 0.0);
}
