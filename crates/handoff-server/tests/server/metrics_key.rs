//! Story: an operator starts the server with `--metrics-key KEY`. A scraper
//! without the key, or with another, gets a 401 in OpenAI's error shape and
//! no series; with `Authorization: Bearer KEY` it gets the Prometheus text.
//! `/health` and `/ready` stay open to probes, and the API is unaffected.

use crate::support::openai_client::{Server, curl, post};

use serde_json::json;

#[test]
fn metrics_need_the_metrics_key_and_probes_stay_open() {
    let Some(server) = Server::start(&["--metrics-key", "scrape-me"]) else {
        return;
    };
    let url = server.url("/metrics");
    let none = curl(&[&url]);
    assert_eq!(none.status, 401, "{}", none.body);
    assert_eq!(none.json()["error"]["code"], "invalid_api_key");
    assert!(!none.body.contains("handoff_"), "{}", none.body);
    let wrong = curl(&[&url, "-H", "Authorization: Bearer scrape-you"]);
    assert_eq!(wrong.status, 401, "{}", wrong.body);
    let longer = curl(&[&url, "-H", "Authorization: Bearer scrape-me-too"]);
    assert_eq!(longer.status, 401, "{}", longer.body);

    let done = post(
        &server,
        "/v1/completions",
        &json!({"prompt": "count", "max_tokens": 2}),
        None,
    );
    assert_eq!(done.status, 200, "{}", done.body);
    let right = curl(&[&url, "-H", "Authorization: Bearer scrape-me"]);
    assert_eq!(right.status, 200, "{}", right.body);
    assert!(
        right
            .body
            .contains(r#"handoff_http_requests_total{endpoint="completions",outcome="finished",status="200"} 1"#),
        "{}",
        right.body
    );
    assert_eq!(curl(&[&server.url("/health")]).status, 200);
    assert_eq!(curl(&[&server.url("/ready")]).status, 200);
}
