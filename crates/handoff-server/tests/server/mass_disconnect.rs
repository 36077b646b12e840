//! Story: 120 clients stream long answers at once, then all drop their
//! connections together. Each request is cancelled as its connection
//! closes, the engine releases the pages at its next step, and the pools
//! are idle again within seconds (this took 10-40 s before): the metrics
//! count 120 disconnects and 120 confirmed cancels, and the next client is
//! served in full.

use crate::support::openai_client::{Server, post, sample, series};

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::json;

const CLIENTS: usize = 120;

/// Pages in use or held, over every pool.
fn busy_pages(m: &str) -> f64 {
    series(m, "handoff_pool_pages")
        .iter()
        .filter(|(l, _)| l.contains("state=\"in_use\"") || l.contains("state=\"held\""))
        .map(|(_, v)| v)
        .sum()
}

/// Opens a streaming completion and reads until its first token's chunk.
fn stream(addr: &str, c: usize) -> TcpStream {
    let body = json!({"prompt": format!("client {c} tells a long story:"), "max_tokens": 200,
        "temperature": 0, "stream": true})
    .to_string();
    let mut s = TcpStream::connect(addr).expect("loopback connect");
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("data: {") {
        let n = s.read(&mut buf).expect("the stream starts");
        assert!(
            n > 0,
            "closed before the first chunk: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    assert!(
        seen.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&seen)
    );
    s
}

#[test]
fn a_hundred_and_twenty_clients_dropping_at_once_return_their_pages_quickly() {
    let Some(server) = Server::start(&["--max-context", "256", "--pool-tokens", "65536"]) else {
        return;
    };
    let addr = server.base.trim_start_matches("http://").to_string();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let addr = addr.clone();
            std::thread::spawn(move || stream(&addr, c))
        })
        .collect();
    let streams: Vec<TcpStream> = clients.into_iter().map(|c| c.join().unwrap()).collect();
    let m = server.metrics();
    assert!(busy_pages(&m) > 0.0, "{m}");

    let dropped = Instant::now();
    drop(streams);
    let back = loop {
        let m = server.metrics();
        if busy_pages(&m) == 0.0
            && sample(&m, "handoff_cancels_confirmed_total", &[]) >= CLIENTS as f64
        {
            break dropped.elapsed();
        }
        assert!(
            dropped.elapsed() < Duration::from_secs(60),
            "pages still out a minute after the disconnects:\n{m}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    eprintln!("{CLIENTS} clients dropped: every page back in {back:?}");
    assert!(back < Duration::from_secs(5), "pages back after {back:?}");

    let m = server.metrics();
    assert_eq!(
        sample(&m, "handoff_client_disconnects_total", &[]),
        CLIENTS as f64,
        "{m}"
    );
    assert_eq!(
        sample(&m, "handoff_cancels_confirmed_total", &[]),
        CLIENTS as f64,
        "{m}"
    );
    assert_eq!(sample(&m, "handoff_isolation_violations", &[]), 0.0);

    let next = post(
        &server,
        "/v1/completions",
        &json!({"prompt": "again", "max_tokens": 5}),
        None,
    );
    assert_eq!(next.status, 200, "{}", next.body);
    assert_eq!(next.json()["usage"]["completion_tokens"], 5);
}
