//! Story: 2,000 clients open streaming completions at once on the embedded
//! model (and, first, 100). No thread waits per stream: the server admits
//! each request with an awaited submission and forwards its tokens from
//! the engine's waker-backed `recv_async`, so it holds every stream with
//! the runtime's few threads. Every client gets a 200 and a stream that
//! ends with `data: [DONE]`, `/health` keeps answering while they run,
//! the metrics count one finished answer per client, and the pool is full
//! again afterwards. The server raises its descriptor limit at start; this
//! test process raises its own the same way.

use crate::support::openai_client::{Server, sample};

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Barrier;

const MAX_TOKENS: usize = 6;

/// Raises this process's soft descriptor limit to its hard one (each
/// stream is a socket here too); the limit in force.
fn raise_nofile() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit through a valid, exclusive pointer.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    lim.rlim_cur = lim.rlim_max;
    // SAFETY: setrlimit reads one rlimit through a valid pointer.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
    lim.rlim_cur
}

/// What one client read: the raw answer, or the I/O error.
async fn one(addr: String, c: usize, all_sent: Arc<Barrier>) -> Result<String, String> {
    let body = serde_json::json!({
        "prompt": [1 + (c % 200) as u32, 2, 3, 4],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": true,
        "return_token_ids": true,
    })
    .to_string();
    let mut s = TcpStream::connect(&addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(format!("{head}{body}").as_bytes())
        .await
        .map_err(|e| format!("write: {e}"))?;
    // Every client has its request in before any reads: all streams are
    // open at once.
    all_sent.wait().await;
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(300), s.read_to_end(&mut answer))
        .await
        .map_err(|_| "no end within 300 s".to_string())?
        .map_err(|e| format!("read: {e}"))?;
    Ok(String::from_utf8_lossy(&answer).into_owned())
}

/// What is wrong with one answer, if anything.
fn fault(answer: &Result<String, String>) -> Option<String> {
    let a = match answer {
        Ok(a) => a,
        Err(e) => return Some(e.clone()),
    };
    if !a.starts_with("HTTP/1.1 200") {
        return Some(a.chars().take(300).collect());
    }
    if !a.contains("data: [DONE]") {
        return Some(format!(
            "no [DONE]: {}",
            a.chars().take(300).collect::<String>()
        ));
    }
    if a.contains("\"error\"") {
        return Some(format!("an error event: {a}"));
    }
    None
}

/// One `/health` over a fresh connection: its status line and latency.
async fn health(addr: &str) -> (String, Duration) {
    let t = Instant::now();
    let mut s = TcpStream::connect(addr).await.expect("health connect");
    s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .expect("health write");
    let mut a = Vec::new();
    s.read_to_end(&mut a).await.expect("health read");
    let a = String::from_utf8_lossy(&a).into_owned();
    (a.lines().next().unwrap_or("").to_string(), t.elapsed())
}

fn streams(n: usize) {
    let limit = raise_nofile();
    assert!(
        limit as usize > n + 64,
        "this test needs {n} sockets and more; the hard descriptor limit is {limit}"
    );
    let pool = (n * 32).to_string();
    let conns = (n + 64).to_string();
    let Some(server) = Server::start(&[
        "--max-context",
        "64",
        "--pool-tokens",
        &pool,
        "--max-connections",
        &conns,
    ]) else {
        return;
    };
    assert!(
        server.log().contains("descriptors: soft limit raised"),
        "{}",
        server.log()
    );
    let addr = server.base.trim_start_matches("http://").to_string();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let started = Instant::now();
    let (answers, health_checks) = rt.block_on(async {
        let all_sent = Arc::new(Barrier::new(n + 1));
        let tasks: Vec<_> = (0..n)
            .map(|c| tokio::spawn(one(addr.clone(), c, all_sent.clone())))
            .collect();
        all_sent.wait().await;
        // The server answers others while every stream is live.
        let mut checks = Vec::new();
        for _ in 0..3 {
            checks.push(health(&addr).await);
        }
        let mut answers = Vec::with_capacity(n);
        for t in tasks {
            answers.push(t.await.unwrap_or_else(|e| Err(format!("task: {e}"))));
        }
        (answers, checks)
    });
    let took = started.elapsed();
    let faults: Vec<String> = answers.iter().filter_map(fault).collect();
    assert!(
        faults.is_empty(),
        "{} of {n} streams failed; the first: {:?}\nlog tail: {}",
        faults.len(),
        &faults[..faults.len().min(3)],
        server
            .log()
            .lines()
            .rev()
            .take(20)
            .collect::<Vec<_>>()
            .join("\n")
    );
    // Every generated token is its own chunk (return_token_ids); the
    // finishing chunk carries none.
    let per_stream: Vec<usize> = answers
        .iter()
        .flatten()
        .map(|a| a.matches("\"token_ids\":[").count() - a.matches("\"token_ids\":[]").count())
        .collect();
    assert!(
        per_stream.iter().all(|&k| (1..=MAX_TOKENS).contains(&k)),
        "token chunks per stream: {per_stream:?}"
    );
    for (status, latency) in &health_checks {
        assert!(status.starts_with("HTTP/1.1 200"), "{status}");
        eprintln!("/health during {n} streams: {latency:?}");
    }
    eprintln!("{n} streams, every one ended with [DONE], in {took:?}");

    let m = server.wait_pools_idle(Duration::from_secs(60));
    let finished = sample(
        &m,
        "handoff_http_requests_total",
        &[r#"endpoint="completions""#, r#"status="200""#],
    );
    assert_eq!(finished, n as f64, "{m}");
    let busy: f64 = ["in_use", "held"]
        .iter()
        .map(|s| sample(&m, "handoff_pool_pages", &[&format!("state=\"{s}\"")]))
        .sum();
    assert_eq!(busy, 0.0, "the pool is not full again:\n{m}");
    assert_eq!(sample(&m, "handoff_client_disconnects_total", &[]), 0.0);
    assert_eq!(sample(&m, "handoff_isolation_violations", &[]), 0.0);
}

#[test]
fn a_hundred_concurrent_streams_all_end_with_done() {
    streams(100);
}

#[test]
fn two_thousand_concurrent_streams_all_end_with_done_and_the_pool_refills() {
    streams(2_000);
}
