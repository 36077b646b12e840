//! Story: a client asks for a long streamed answer, reads a few chunks and
//! goes away. The server cancels the request (the engine confirms it and
//! its pages return to the pool), the metrics show the disconnect and the
//! cancel, and the next client is served as if nothing happened.

use crate::support::openai_client;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use openai_client::{Server, post, sample};
use serde_json::json;

#[test]
fn a_client_that_disconnects_mid_stream_frees_its_pages() {
    let Some(server) = Server::start(&[]) else {
        return;
    };
    // Long enough that it cannot finish between the chunks read and the kill.
    let body = json!({"model": "handoff-random", "prompt": "A long story:", "max_tokens": 1000,
        "temperature": 0, "stream": true, "return_token_ids": true})
    .to_string();
    let mut curl = Command::new("curl")
        .args(["-sS", "-N", &server.url("/v1/completions")])
        .args([
            "-H",
            "content-type: application/json",
            "--data-binary",
            &body,
        ])
        .stdout(Stdio::piped())
        .spawn()
        .expect("curl runs");
    let mut lines = BufReader::new(curl.stdout.take().unwrap()).lines();
    let mut chunks = 0;
    while chunks < 3 {
        let line = lines.next().expect("the stream goes on").expect("readable");
        if line.starts_with("data: {") {
            chunks += 1;
        }
    }
    curl.kill().unwrap();
    let _ = curl.wait();
    drop(lines);

    // The server notices at its next write, cancels, and the engine
    // releases the pages at its next step.
    let until = Instant::now() + Duration::from_secs(20);
    let m = loop {
        let m = server.wait_pools_idle(Duration::from_secs(20));
        if sample(&m, "handoff_cancels_confirmed_total", &[]) >= 1.0 || Instant::now() > until {
            break m;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(
        sample(&m, "handoff_client_disconnects_total", &[]),
        1.0,
        "{m}\n{}",
        server.log()
    );
    assert_eq!(
        sample(&m, "handoff_cancels_confirmed_total", &[]),
        1.0,
        "{m}"
    );
    assert_eq!(
        sample(
            &m,
            "handoff_http_requests_total",
            &["outcome=\"cancelled\"", "status=\"499\""]
        ),
        1.0,
        "{m}"
    );
    let generated = sample(&m, "handoff_generated_tokens_total", &[]);
    assert!(
        (3.0..1000.0).contains(&generated),
        "stopped generating early: {generated}"
    );
    for state in ["in_use", "held"] {
        let s = format!("state=\"{state}\"");
        assert_eq!(sample(&m, "handoff_pool_pages", &[&s]), 0.0, "{m}");
    }
    assert_eq!(sample(&m, "handoff_requests_streaming", &[]), 0.0, "{m}");

    // The next client is served in full.
    let next = post(
        &server,
        "/v1/completions",
        &json!({"prompt": "again", "max_tokens": 5}),
        None,
    );
    assert_eq!(next.status, 200, "{}", next.body);
    assert_eq!(next.json()["usage"]["completion_tokens"], 5);
}
