//! Story: an orchestrator probes a server that is still loading its model.
//! The port is bound before the load, so probes connect at once: `/health`
//! answers 200 (the process is up), `/ready` 503 (not serving yet), and a
//! completion 503 with `Retry-After`. Once the model is loaded (the
//! `listening on` line) `/ready` answers 200 and completions are served;
//! at SIGTERM `/ready` turns 503 again while the server drains.
//! (`--load-delay-ms` stretches the embedded model's load so the window can
//! be seen.)

use crate::support::openai_client::{Server, curl, post};

use std::time::Duration;

use serde_json::json;

#[test]
fn ready_is_503_while_the_model_loads_and_200_once_it_serves() {
    let Some(mut server) = Server::start_loading(&["--load-delay-ms", "4000"]) else {
        return;
    };
    let health = curl(&[&server.url("/health")]);
    assert_eq!(health.status, 200, "{}", health.body);
    let ready = curl(&[&server.url("/ready")]);
    assert_eq!(ready.status, 503, "{}", ready.body);
    assert_eq!(ready.json()["error"]["code"], "service_unavailable");
    let early = post(
        &server,
        "/v1/completions",
        &json!({"prompt": "too soon", "max_tokens": 2}),
        None,
    );
    assert_eq!(early.status, 503, "{}", early.body);
    assert_eq!(early.header("retry-after"), Some("1"));

    let base = server.wait_listening();
    assert_eq!(base, server.base, "the address bound before the load");
    let ready = curl(&[&server.url("/ready")]);
    assert_eq!(ready.status, 200, "{}", ready.body);
    let served = post(
        &server,
        "/v1/completions",
        &json!({"prompt": "now", "max_tokens": 2}),
        None,
    );
    assert_eq!(served.status, 200, "{}", served.body);
    assert_eq!(served.json()["usage"]["completion_tokens"], 2);

    // A long stream keeps the drain open while /ready is probed.
    let url = server.url("/v1/completions");
    let long = std::thread::spawn(move || {
        curl(&[
            &url,
            "-H",
            "content-type: application/json",
            "--data-binary",
            r#"{"prompt": "a long one", "max_tokens": 400}"#,
        ])
    });
    std::thread::sleep(Duration::from_millis(300));
    server.sigterm();
    std::thread::sleep(Duration::from_millis(300));
    let draining = std::process::Command::new("curl")
        .args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--max-time",
            "5",
        ])
        .arg(server.url("/ready"))
        .output()
        .expect("curl runs");
    let code = String::from_utf8_lossy(&draining.stdout).into_owned();
    // 503 while draining; 000 once the listener has closed.
    assert!(
        code == "503" || code == "000",
        "/ready while draining: {code}"
    );
    let _ = long.join();
    let (status, _) = server.wait_exit(Duration::from_secs(60));
    assert!(status.success(), "{status:?}\n{}", server.log());
}
