//! Story: a model file's chat template behaves on the loader's probe
//! conversations and loops 10^10 times on a real one (a message longer
//! than 100 characters). The server used to freeze: every endpoint, even
//! `/health`, and SIGTERM too. Now the render runs on a blocking thread
//! under its fuel and deadline: the long chat fails alone with a 500 that
//! names the limit, `/health` and short chats answer meanwhile, and
//! SIGTERM still drains and exits 0 with every page back.

use crate::hostile_templates::SLEEPER;
use crate::support::openai_client::{Server, curl, post, sample};

use std::time::{Duration, Instant};

use serde_json::json;

#[test]
fn a_template_that_loops_on_real_conversations_fails_only_those_requests() {
    let folder = crate::support::served_folder(Some(SLEEPER));
    let Some(mut server) = Server::start(&[
        "--model",
        folder.path().to_str().unwrap(),
        "--template-deadline-ms",
        "3000",
        "--grace-secs",
        "1",
    ]) else {
        return;
    };
    let server_url = server.base.clone();
    let long = "tell me a long story about the sea ".repeat(4);
    let hostile = std::thread::spawn(move || {
        let started = Instant::now();
        let body = json!({"messages": [{"role": "user", "content": long}], "max_tokens": 4});
        let a = curl(&[
            &format!("{server_url}/v1/chat/completions"),
            "-H",
            "content-type: application/json",
            "--data-binary",
            &body.to_string(),
        ]);
        (a, started.elapsed())
    });
    // While the template burns its fuel, everything else answers.
    std::thread::sleep(Duration::from_millis(100));
    let mut health_ms = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        assert_eq!(curl(&[&server.url("/health")]).status, 200);
        health_ms.push(t.elapsed().as_millis());
    }
    let short = post(
        &server,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        None,
    );
    assert_eq!(short.status, 200, "{}", short.body);

    let (a, took) = hostile.join().unwrap();
    assert_eq!(a.status, 500, "{}", a.body);
    let message = a.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(
        message.contains("chat template exceeded its")
            && message.contains("rendering this conversation"),
        "{message}"
    );
    assert!(
        took < Duration::from_secs(10),
        "the request failed after {took:?}"
    );
    eprintln!("hostile chat failed after {took:?}; /health meanwhile in {health_ms:?} ms");
    assert!(
        health_ms.iter().all(|&ms| ms < 1000),
        "/health answered in {health_ms:?} ms"
    );

    // Again, to show the server is not left stuck, then a clean drain.
    let m = server.wait_pools_idle(Duration::from_secs(10));
    assert_eq!(
        sample(
            &m,
            "handoff_http_requests_total",
            &["outcome=\"failed\"", "status=\"500\""]
        ),
        1.0,
        "{m}"
    );
    server.sigterm();
    let (status, stdout) = server.wait_exit(Duration::from_secs(30));
    assert!(status.success(), "{status:?}\n{stdout}\n{}", server.log());
    assert!(stdout.contains("full=true"), "{stdout}");
}
