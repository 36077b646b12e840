//! Story: an attacker opens many connections and sends each an unfinished
//! request head, never the rest. The server used to keep every one open
//! until descriptors ran out and then served no one. Now hyper's
//! header-read timeout closes each after `--header-timeout-secs`, and the
//! connection cap keeps the open ones under `--max-connections` (the rest
//! wait in the kernel's backlog): the process's descriptors stay bounded,
//! every flood connection is closed by the server, and `/health` and a
//! completion still answer. A keep-alive connection left idle after its
//! answer is closed by the same clock, and a body that stalls midway gets
//! a 400 after `--body-idle-timeout-secs` (tower-http's body timeout).
//! Loopback only, 200 connections, seconds long.

use crate::support::openai_client::{Server, curl, post};

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::json;

const FLOOD: usize = 200;
const CAP: usize = 64;

fn open_fds(pid: u32) -> Option<usize> {
    Some(std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count())
}

#[test]
fn a_flood_of_unfinished_heads_is_bounded_and_health_still_answers() {
    let cap = CAP.to_string();
    let Some(server) = Server::start(&[
        "--max-connections",
        &cap,
        "--header-timeout-secs",
        "1",
        "--body-idle-timeout-secs",
        "1",
    ]) else {
        return;
    };
    let addr = server.base.trim_start_matches("http://").to_string();

    // A body that stops halfway: a 400 saying so, then the connection closes.
    let mut slow = TcpStream::connect(&addr).unwrap();
    slow.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: slow\r\ncontent-type: application/json\r\n\
          content-length: 100\r\n\r\n{\"prompt\": ",
    )
    .unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let t = Instant::now();
    let mut answer = Vec::new();
    let _ = slow.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.starts_with("HTTP/1.1 400"),
        "{answer:?} after {:?}\n{}",
        t.elapsed(),
        server.log()
    );
    assert!(answer.contains("timeout"), "{answer}");
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());

    let before = open_fds(server.pid());

    let started = Instant::now();
    let mut flood: Vec<TcpStream> = (0..FLOOD)
        .map(|_| {
            let mut s = TcpStream::connect(&addr).expect("loopback connect");
            s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: flood\r\ncontent-type: app")
                .unwrap();
            s
        })
        .collect();
    // Descriptors while the flood is on: at most the cap above the idle count.
    let mut most = 0;
    for _ in 0..10 {
        if let (Some(b), Some(now)) = (before, open_fds(server.pid())) {
            most = most.max(now.saturating_sub(b));
        }
        std::thread::sleep(Duration::from_millis(30));
    }

    // /health answers once the timeouts have freed slots ahead of it.
    let t = Instant::now();
    let health = curl(&["--max-time", "30", &server.url("/health")]);
    let health_took = t.elapsed();
    assert_eq!(health.status, 200, "{}", health.body);
    assert!(
        health_took < Duration::from_secs(15),
        "/health took {health_took:?} under the flood"
    );

    // The server closes every flood connection (none is answered).
    for s in &mut flood {
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut buf = [0u8; 512];
        let closed = loop {
            match s.read(&mut buf) {
                Ok(0) => break true,
                Ok(_) => continue,
                Err(e)
                    if e.kind() == std::io::ErrorKind::WouldBlock
                        || e.kind() == std::io::ErrorKind::TimedOut =>
                {
                    break false;
                }
                Err(_) => break true,
            }
        };
        assert!(
            closed,
            "a flood connection is still open after {:?}",
            started.elapsed()
        );
    }
    let all_closed = started.elapsed();
    eprintln!(
        "flood of {FLOOD} (cap {CAP}, header timeout 1 s): at most {most} more descriptors; \
         /health in {health_took:?}; every flood connection closed by {all_closed:?}"
    );
    if before.is_some() {
        assert!(
            most <= CAP + 8,
            "{most} descriptors over the idle count, cap {CAP}"
        );
    }
    assert!(all_closed < Duration::from_secs(30), "{all_closed:?}");

    // An idle keep-alive connection is closed by the same timeout.
    let mut idle = TcpStream::connect(&addr).unwrap();
    idle.write_all(b"GET /health HTTP/1.1\r\nHost: idle\r\n\r\n")
        .unwrap();
    idle.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut buf = [0u8; 512];
    let n = idle.read(&mut buf).unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &buf[..n]);
    let t = Instant::now();
    let mut rest = Vec::new();
    let _ = idle.read_to_end(&mut rest);
    let idle_closed = t.elapsed();
    assert!(
        idle_closed < Duration::from_secs(10),
        "an idle keep-alive connection stayed open {idle_closed:?}"
    );

    // And the server serves as before.
    let a = post(
        &server,
        "/v1/completions",
        &json!({"prompt": "still here", "max_tokens": 3}),
        None,
    );
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(a.json()["usage"]["completion_tokens"], 3);
}
