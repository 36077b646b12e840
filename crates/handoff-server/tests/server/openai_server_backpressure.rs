//! Story: a small deployment (a pool of two windows, a queue of one) gets a
//! burst of long requests. The ones that fit are served in full; the rest
//! are told at once, with a 429, `Retry-After` and OpenAI's
//! `rate_limit_exceeded`, to come back later. Nothing is truncated, and
//! every page is back afterwards.

use crate::support::openai_client;

use std::time::Duration;

use openai_client::{Server, post, sample};
use serde_json::json;

#[test]
fn a_burst_beyond_the_queue_gets_429_with_retry_after() {
    let Some(server) = Server::start(&[
        "--max-context",
        "1024",
        "--pool-tokens",
        "2048",
        "--max-queue",
        "1",
    ]) else {
        return;
    };
    let server = std::sync::Arc::new(server);
    let clients: Vec<_> = (0..16)
        .map(|c| {
            let server = server.clone();
            std::thread::spawn(move || {
                let prompt: Vec<u32> = (0..8).map(|i| (i * 17 + c) % 256).collect();
                post(
                    &server,
                    "/v1/completions",
                    &json!({"prompt": prompt, "max_tokens": 1016, "temperature": 0}),
                    None,
                )
            })
        })
        .collect();
    let answers: Vec<_> = clients.into_iter().map(|t| t.join().unwrap()).collect();

    let served: Vec<_> = answers.iter().filter(|a| a.status == 200).collect();
    let refused: Vec<_> = answers.iter().filter(|a| a.status == 429).collect();
    assert_eq!(
        served.len() + refused.len(),
        16,
        "only 200s and 429s: {:?}",
        answers.iter().map(|a| a.status).collect::<Vec<_>>()
    );
    assert!(!served.is_empty() && !refused.is_empty());
    for a in served {
        assert_eq!(
            a.json()["usage"]["completion_tokens"],
            1016,
            "never truncated"
        );
    }
    for a in &refused {
        assert_eq!(a.header("retry-after"), Some("1"));
        assert_eq!(a.json()["error"]["code"], "rate_limit_exceeded");
        assert_eq!(a.json()["error"]["type"], "rate_limit_error");
    }
    let m = server.wait_pools_idle(Duration::from_secs(20));
    assert_eq!(
        sample(&m, "handoff_rejections_total", &["reason=\"queue_full\""]),
        refused.len() as f64
    );
    assert_eq!(
        sample(&m, "handoff_pool_pages", &["state=\"in_use\""]),
        0.0,
        "{m}"
    );
}
