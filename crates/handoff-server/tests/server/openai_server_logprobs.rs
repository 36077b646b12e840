//! Story: a client scores what the server generates, the way OpenAI's API
//! lets it: `logprobs: true` with `top_logprobs` on a chat, `logprobs: n`
//! on a completion, whole and streamed. Each generated token comes with its
//! log-probability and its most likely alternatives, in OpenAI's shapes; a
//! greedy token is its own most likely alternative; the streamed values are
//! the whole answer's; asking for too many alternatives, or for
//! `top_logprobs` without `logprobs`, is a 400; and a request that does not
//! ask gets `"logprobs": null`.

use crate::support::openai_client;

use openai_client::{Server, post};
use serde_json::{Value, json};

fn chat_entries(v: &Value) -> Vec<Value> {
    v.as_array()
        .unwrap_or_else(|| panic!("no logprobs content in {v}"))
        .clone()
}

#[test]
fn clients_get_each_tokens_log_probabilities() {
    let Some(server) = Server::start(&["--max-context", "128"]) else {
        return;
    };

    // A greedy chat asking for 3 alternatives per token.
    let chat = json!({"model": "handoff-random", "max_tokens": 6, "temperature": 0,
        "return_token_ids": true, "logprobs": true, "top_logprobs": 3,
        "messages": [{"role": "user", "content": "Hi"}]});
    let whole = post(&server, "/v1/chat/completions", &chat, None);
    assert_eq!(whole.status, 200, "{}", whole.body);
    let whole = whole.json();
    let choice = &whole["choices"][0];
    let ids: Vec<u64> = choice["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    let entries = chat_entries(&choice["logprobs"]["content"]);
    assert_eq!(entries.len(), ids.len(), "one entry per token: {choice}");
    for (e, &id) in entries.iter().zip(&ids) {
        let lp = e["logprob"].as_f64().unwrap();
        assert!(lp <= 0.0, "{e}");
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3, "{e}");
        // Greedy: the token is the most likely, and the list is ordered.
        assert_eq!(top[0]["logprob"].as_f64().unwrap(), lp, "{e}");
        assert_eq!(top[0]["token"], e["token"]);
        let values: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(values.windows(2).all(|w| w[0] >= w[1]), "{e}");
        // The embedded model's codec: ids below 256 are single bytes.
        if id < 256 {
            assert_eq!(e["bytes"], json!([id]), "{e}");
        }
    }

    // Streamed: the same values, one token per chunk.
    let mut stream = chat.clone();
    stream["stream"] = json!(true);
    let s = post(&server, "/v1/chat/completions", &stream, None);
    assert_eq!(s.status, 200, "{}", s.body);
    let mut streamed = Vec::new();
    for e in s.events().iter().filter(|e| *e != "[DONE]") {
        let v: Value = serde_json::from_str(e).unwrap();
        let lp = &v["choices"][0]["logprobs"];
        if !lp.is_null() {
            streamed.extend(chat_entries(&lp["content"]));
        }
    }
    assert_eq!(streamed, entries);

    // A completion with `logprobs: 2`, OpenAI's legacy shape.
    let ask = json!({"model": "handoff-random", "prompt": "Hello", "max_tokens": 5,
        "temperature": 0.8, "seed": 11, "logprobs": 2});
    let a = post(&server, "/v1/completions", &ask, None);
    assert_eq!(a.status, 200, "{}", a.body);
    let body = a.json();
    let lp = &body["choices"][0]["logprobs"];
    let n = |k: &str| {
        lp[k]
            .as_array()
            .unwrap_or_else(|| panic!("{k} in {lp}"))
            .len()
    };
    assert_eq!(n("tokens"), 5);
    assert_eq!(n("token_logprobs"), 5);
    assert_eq!(n("top_logprobs"), 5);
    assert_eq!(n("text_offset"), 5);
    assert_eq!(lp["text_offset"][0], 0);
    let tokens: String = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(tokens, body["choices"][0]["text"].as_str().unwrap());
    assert!(
        lp["top_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .all(|t| !t.as_object().unwrap().is_empty() && t.as_object().unwrap().len() <= 2)
    );

    // Not asked: null. Too many, or top_logprobs alone: a 400 naming it.
    let plain = json!({"model": "handoff-random", "prompt": "Hello", "max_tokens": 2});
    let p = post(&server, "/v1/completions", &plain, None).json();
    assert!(p["choices"][0]["logprobs"].is_null(), "{p}");
    for (path, body, param) in [
        (
            "/v1/completions",
            json!({"prompt": "Hi", "logprobs": 21}),
            "logprobs",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi"}], "logprobs": true,
                "top_logprobs": 21}),
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2}),
            "top_logprobs",
        ),
    ] {
        let r = post(&server, path, &body, None);
        assert_eq!(r.status, 400, "{}", r.body);
        assert_eq!(r.json()["error"]["param"], param, "{}", r.body);
    }
    let m = server.wait_pools_idle(std::time::Duration::from_secs(10));
    for state in ["in_use", "held"] {
        let pages =
            openai_client::sample(&m, "handoff_pool_pages", &[&format!("state=\"{state}\"")]);
        assert_eq!(pages, 0.0, "{state} pages after every answer");
    }
}
