//! Story: an operator gives the server a key file. A client without a key,
//! or with a key the file does not list, gets a 401 in OpenAI's shape and
//! nothing is generated; a client with a key is served. The metrics stay
//! open to the scraper. A key file with a mistake, or an open server asked
//! to listen beyond loopback, refuses to start and says why.

use crate::support::openai_client;

use std::process::Command;

use openai_client::{Server, post, sample};
use serde_json::json;

fn key_file(text: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!(
        "handoff-openai-keys-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    ));
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn keys_map_clients_to_tenants_and_strangers_get_401() {
    let keys = key_file("# key tenant\nsk-alice 1\n\nsk-bob 2\n");
    let Some(server) = Server::start(&["--api-keys", keys.to_str().unwrap()]) else {
        return;
    };
    let ask = json!({"model": "handoff-random", "prompt": "hi", "max_tokens": 3});

    let none = post(&server, "/v1/completions", &ask, None);
    assert_eq!(none.status, 401, "{}", none.body);
    assert_eq!(none.json()["error"]["code"], "invalid_api_key");
    let wrong = post(&server, "/v1/completions", &ask, Some("sk-mallory"));
    assert_eq!(wrong.status, 401);
    assert_eq!(wrong.json()["error"]["type"], "authentication_error");
    let models = openai_client::curl(&[&server.url("/v1/models")]);
    assert_eq!(models.status, 401, "the model list needs a key too");

    for key in ["sk-alice", "sk-bob"] {
        let ok = post(&server, "/v1/completions", &ask, Some(key));
        assert_eq!(ok.status, 200, "{}", ok.body);
        assert_eq!(ok.json()["usage"]["completion_tokens"], 3);
    }
    // The tenant comes from the key, never from the body.
    let mut claims = ask.clone();
    claims["tenant"] = json!(2);
    claims["user"] = json!("bob");
    assert_eq!(
        post(&server, "/v1/completions", &claims, Some("sk-mallory")).status,
        401
    );
    assert!(
        server.log().contains("tenant=1") && server.log().contains("tenant=2"),
        "each key's requests are logged under its tenant:\n{}",
        server.log()
    );

    let m = server.metrics();
    assert_eq!(
        sample(
            &m,
            "handoff_http_requests_total",
            &["outcome=\"unauthorized\"", "status=\"401\""]
        ),
        4.0,
        "{m}"
    );
    assert_eq!(sample(&m, "handoff_prompt_tokens_total", &[]), 4.0);
    let _ = std::fs::remove_file(keys);
}

#[test]
fn a_bad_key_file_or_an_open_public_address_refuses_to_start() {
    let bin = crate::support::server_bin();
    let bad = key_file("sk-alice 1\nsk-bob two\n");
    let out = Command::new(&bin)
        .args(["--port", "0", "--api-keys", bad.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(":2: tenant id \"two\""), "{err}");
    assert!(out.stdout.is_empty(), "nothing listened");
    let _ = std::fs::remove_file(bad);

    let out = Command::new(&bin)
        .args(["--port", "0", "--host", "0.0.0.0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a loopback address"), "{err}");
}
