//! Story: the server is streaming answers to several clients when it gets
//! SIGTERM. It stops accepting connections, lets the live answers run for
//! its grace period, ends the ones still running with a 503 error event
//! (never a silent cut, never a `[DONE]` for an unfinished answer), and
//! exits 0 with every page back in its pool.

use crate::support::openai_client;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use openai_client::Server;
use serde_json::{Value, json};

#[test]
fn sigterm_under_load_drains_and_exits_clean() {
    let Some(mut server) = Server::start(&["--grace-secs", "1"]) else {
        return;
    };
    let url = server.url("/v1/completions");
    // Each client streams a long answer; the main thread waits until every
    // one has its first chunk.
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let clients: Vec<_> = (0..6)
        .map(|c| {
            let url = url.clone();
            let started = started_tx.clone();
            std::thread::spawn(move || {
                let body = json!({"prompt": format!("client {c}"), "max_tokens": 1000,
                    "temperature": 0, "stream": true})
                .to_string();
                let mut curl = Command::new("curl")
                    .args(["-sS", "-N", &url, "-H", "content-type: application/json"])
                    .args(["--data-binary", &body])
                    .stdout(Stdio::piped())
                    .spawn()
                    .expect("curl runs");
                let mut events = Vec::new();
                for line in BufReader::new(curl.stdout.take().unwrap()).lines() {
                    let Ok(line) = line else { break };
                    if let Some(data) = line.strip_prefix("data: ") {
                        if events.is_empty() {
                            let _ = started.send(());
                        }
                        events.push(data.to_string());
                    }
                }
                let _ = curl.wait();
                events
            })
        })
        .collect();
    for _ in 0..6 {
        started_rx
            .recv_timeout(Duration::from_secs(60))
            .expect("every client streams");
    }

    server.sigterm();
    let (status, stdout) = server.wait_exit(Duration::from_secs(30));

    let mut finished = 0;
    let mut ended_503 = 0;
    for c in clients {
        let events = c.join().unwrap();
        let last = events.last().expect("events");
        if last == "[DONE]" {
            finished += 1;
            continue;
        }
        // Not finished: the last event says why, with the shutdown's status.
        let v: Value = serde_json::from_str(last).unwrap();
        assert_eq!(
            v["error"]["code"], "service_unavailable",
            "an unfinished stream ends with a 503 error event, not a silent cut: {last}"
        );
        assert!(!events.iter().any(|e| e == "[DONE]"));
        ended_503 += 1;
    }
    assert_eq!(finished + ended_503, 6);
    eprintln!(
        "at SIGTERM: {finished} streams finished in the grace period, {ended_503} ended with 503"
    );

    assert!(
        status.success(),
        "exit 0 after a clean drain: {status:?}\n{stdout}\n{}",
        server.log()
    );
    assert!(
        stdout.contains("pool colocated:") && stdout.contains("full=true"),
        "{stdout}"
    );
    assert!(stdout.contains("isolation_violations=0"), "{stdout}");
    assert!(server.log().contains("shutting down"));

    // Nothing listens any more.
    let after = Command::new("curl")
        .args(["-sS", "--max-time", "5", &url, "--data-binary", "{}"])
        .output()
        .unwrap();
    assert!(!after.status.success(), "the listener is closed");
}

/// A SIGTERM that comes as soon as the server says it listens is handled
/// (not the default kill): the signal handlers are in place before the
/// `listening` line.
#[test]
fn sigterm_right_after_startup_exits_clean() {
    let Some(mut server) = Server::start(&[]) else {
        return;
    };
    server.sigterm();
    let (status, stdout) = server.wait_exit(Duration::from_secs(30));
    assert!(status.success(), "{status:?}\n{stdout}\n{}", server.log());
    assert!(stdout.contains("full=true"), "{stdout}");
}
