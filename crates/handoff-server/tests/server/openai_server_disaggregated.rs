//! Story: the same server with `--disaggregated`: a prefill worker computes
//! each prompt's KV and a decode worker verifies its receipt before
//! generating. One receipt is corrupted on purpose (a test aid): that
//! request gets a 500 `kv_integrity_failure` before any byte of its stream,
//! never a 200 with made-up text, and nobody else notices. The others get
//! the tokens colocated serving gives. SIGTERM leaves both pools full. The
//! same holds with the workers joined in-process and over an authenticated
//! loopback TCP link (`--transport tcp`).

use crate::support::openai_client;

use std::time::Duration;

use openai_client::{Server, post, sample};
use serde_json::{Value, json};

fn ask(prompt: &[u32], stream: bool) -> Value {
    json!({"prompt": prompt, "max_tokens": 10, "temperature": 0, "stream": stream,
        "return_token_ids": true})
}

fn answer_ids(a: &openai_client::Answer) -> Vec<u64> {
    assert_eq!(a.status, 200, "{}", a.body);
    let chunks: Vec<Value> = if a.body.starts_with('{') {
        vec![a.json()]
    } else {
        a.events()
            .iter()
            .filter(|e| *e != "[DONE]")
            .map(|e| serde_json::from_str(e).unwrap())
            .collect()
    };
    chunks
        .iter()
        .flat_map(|c| c["choices"][0]["token_ids"].as_array().unwrap().clone())
        .map(|t| t.as_u64().unwrap())
        .collect()
}

#[test]
fn disaggregated_serving_verifies_every_transfer() {
    verifies_every_transfer("inproc");
}

#[test]
fn disaggregated_serving_over_authenticated_tcp_verifies_every_transfer() {
    verifies_every_transfer("tcp");
}

fn verifies_every_transfer(transport: &str) {
    // Request 1's receipt is corrupted by the prefill worker.
    let Some(mut server) = Server::start(&[
        "--disaggregated",
        "--transport",
        transport,
        "--corrupt-receipt-of-request",
        "1",
    ]) else {
        return;
    };
    let prompt: Vec<u32> = (0..30).map(|i| (i * 7 + 3) % 256).collect();

    let corrupted = post(&server, "/v1/completions", &ask(&prompt, true), None);
    assert_eq!(corrupted.status, 500, "{}", corrupted.body);
    assert_eq!(corrupted.json()["error"]["code"], "kv_integrity_failure");
    assert!(corrupted.events().is_empty(), "no stream was started");

    let whole = post(&server, "/v1/completions", &ask(&prompt, false), None);
    let streamed = post(&server, "/v1/completions", &ask(&prompt, true), None);
    let tokens = answer_ids(&whole);
    assert_eq!(tokens.len(), 10);
    assert_eq!(answer_ids(&streamed), tokens);

    let Some(colocated) = Server::start(&[]) else {
        return;
    };
    let reference = post(&colocated, "/v1/completions", &ask(&prompt, false), None);
    assert_eq!(
        answer_ids(&reference),
        tokens,
        "disaggregated equals colocated"
    );

    let m = server.wait_pools_idle(Duration::from_secs(20));
    assert_eq!(
        sample(&m, "handoff_transfer_integrity_failures_total", &[]),
        1.0
    );
    assert_eq!(
        sample(&m, "handoff_transfer_kv_bytes_total", &[]),
        2.0 * 30.0 * 3.0 * 2.0 * 2.0 * 16.0 * 2.0,
        "two verified transfers of 30 tokens (3 layers, K and V, 2 heads of 16 f16, the default)"
    );
    assert_eq!(
        sample(
            &m,
            "handoff_http_requests_total",
            &["outcome=\"failed\"", "status=\"500\""]
        ),
        1.0
    );
    assert_eq!(sample(&m, "handoff_isolation_violations", &[]), 0.0);

    server.sigterm();
    let (status, stdout) = server.wait_exit(Duration::from_secs(30));
    assert!(status.success(), "{status:?}\n{stdout}\n{}", server.log());
    for pool in ["decode", "prefill"] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("pool {pool}:")))
            .unwrap_or_else(|| panic!("no {pool} pool line in {stdout}"));
        assert!(line.ends_with("full=true"), "{line}");
        assert!(line.contains("isolation_violations=0"), "{line}");
    }
}

/// `--kv-dtype bf16`: the pools keep KV in bf16, so a verified transfer
/// moves half the bytes of f32 KV; the pages still come back whole. A
/// dtype the crate has no pages for refuses to start.
#[test]
fn bf16_kv_moves_half_the_bytes_and_an_unknown_dtype_refuses_to_start() {
    let Some(mut server) = Server::start(&["--disaggregated", "--kv-dtype", "bf16"]) else {
        return;
    };
    let prompt: Vec<u32> = (0..30).map(|i| (i * 5 + 1) % 256).collect();
    assert_eq!(
        answer_ids(&post(
            &server,
            "/v1/completions",
            &ask(&prompt, false),
            None
        ))
        .len(),
        10
    );
    let m = server.wait_pools_idle(Duration::from_secs(20));
    assert_eq!(
        sample(&m, "handoff_transfer_kv_bytes_total", &[]),
        30.0 * 3.0 * 2.0 * 2.0 * 16.0 * 2.0,
        "one transfer of 30 tokens (3 layers, K and V, 2 heads of 16 bf16)"
    );
    server.sigterm();
    let (status, stdout) = server.wait_exit(Duration::from_secs(30));
    assert!(status.success(), "{status:?}\n{stdout}\n{}", server.log());
    assert_eq!(stdout.matches("full=true").count(), 2, "{stdout}");

    let bin = crate::support::server_bin();
    let out = std::process::Command::new(&bin)
        .args(["--port", "0", "--kv-dtype", "f64"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--kv-dtype \"f64\""), "{err}");
}
