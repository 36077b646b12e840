//! Story: a newcomer starts `handoff-server` with the embedded
//! random-weights model and points `curl` at it. They list the model, ask
//! for completions and chats with and without streaming (the streamed
//! tokens are the tokens of the whole answer), cut an answer short with a
//! stop string, and make the mistakes everyone makes: a bad parameter, an
//! unknown model, broken JSON, a prompt longer than the context window.
//! Each mistake gets an OpenAI-style error body with the crate's status,
//! the metrics count what happened, and every page is back in the pool.

use crate::support::openai_client;

use std::time::Duration;

use openai_client::{Server, post, sample};
use serde_json::{Value, json};

const WINDOW: usize = 128;

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap_or_else(|| panic!("no token ids in {v}"))
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

/// The token ids of a stream's chunks, its finish reason and whether it
/// ended with `[DONE]`.
fn streamed(events: &[String]) -> (Vec<u64>, Option<String>, bool) {
    let mut tokens = Vec::new();
    let mut finish = None;
    for e in events.iter().filter(|e| *e != "[DONE]") {
        let v: Value = serde_json::from_str(e).unwrap();
        for c in v["choices"].as_array().unwrap() {
            // The chat's opening chunk (the role) carries no token.
            if !c["token_ids"].is_null() {
                tokens.extend(ids(&c["token_ids"]));
            }
            if let Some(f) = c["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
        }
    }
    (
        tokens,
        finish,
        events.last().map(String::as_str) == Some("[DONE]"),
    )
}

#[test]
fn curl_against_the_random_model() {
    let window = WINDOW.to_string();
    let Some(server) = Server::start(&["--max-context", &window]) else {
        return;
    };

    // The model list names what the requests must ask for.
    let models = openai_client::curl(&[&server.url("/v1/models")]);
    assert_eq!(models.status, 200, "{}", models.body);
    assert_eq!(models.json()["data"][0]["id"], "handoff-random");

    // A greedy completion, twice: the same tokens, as many as asked.
    let ask = json!({"model": "handoff-random", "prompt": "Hello", "max_tokens": 8,
        "temperature": 0, "return_token_ids": true});
    let a = post(&server, "/v1/completions", &ask, None);
    assert_eq!(a.status, 200, "{}", a.body);
    let body = a.json();
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13})
    );
    let greedy = ids(&body["choices"][0]["token_ids"]);
    assert_eq!(greedy.len(), 8);
    let again = post(&server, "/v1/completions", &ask, None).json();
    assert_eq!(ids(&again["choices"][0]["token_ids"]), greedy);

    // Streamed, the same tokens arrive chunk by chunk, then [DONE].
    let mut ask_stream = ask.clone();
    ask_stream["stream"] = json!(true);
    let s = post(&server, "/v1/completions", &ask_stream, None);
    assert_eq!(s.status, 200, "{}", s.body);
    assert!(
        s.header("content-type")
            .is_some_and(|c| c.starts_with("text/event-stream")),
        "{:?}",
        s.headers
    );
    let (tokens, finish, done) = streamed(&s.events());
    assert_eq!(tokens, greedy);
    assert_eq!(finish.as_deref(), Some("length"));
    assert!(done, "the stream ends with [DONE]: {:?}", s.events());

    // A chat, whole and streamed, agrees with itself; the stream opens with
    // the assistant's role and can end with a usage chunk.
    let chat = json!({"model": "handoff-random", "max_tokens": 6, "temperature": 0,
        "return_token_ids": true,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]});
    let whole = post(&server, "/v1/chat/completions", &chat, None);
    assert_eq!(whole.status, 200, "{}", whole.body);
    let whole = whole.json();
    assert_eq!(whole["object"], "chat.completion");
    assert_eq!(whole["choices"][0]["message"]["role"], "assistant");
    let chat_tokens = ids(&whole["choices"][0]["token_ids"]);
    assert_eq!(chat_tokens.len(), 6);
    let mut chat_stream = chat.clone();
    chat_stream["stream"] = json!(true);
    chat_stream["stream_options"] = json!({"include_usage": true});
    let s = post(&server, "/v1/chat/completions", &chat_stream, None);
    let events = s.events();
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let (tokens, finish, done) = streamed(&events);
    assert_eq!(tokens, chat_tokens);
    assert_eq!(finish.as_deref(), Some("length"));
    assert!(done);
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 6);
    assert_eq!(
        usage["usage"]["prompt_tokens"],
        whole["usage"]["prompt_tokens"]
    );

    // A stop string cuts the answer just before its first occurrence.
    let mut long = ask.clone();
    long["max_tokens"] = json!(24);
    let full = post(&server, "/v1/completions", &long, None).json();
    let text = full["choices"][0]["text"].as_str().unwrap().to_string();
    let stop: String = text.chars().nth(text.chars().count() / 2).unwrap().into();
    let before = &text[..text.find(&stop).unwrap()];
    for stream in [false, true] {
        let mut cut = long.clone();
        cut["stop"] = json!([stop]);
        cut["stream"] = json!(stream);
        let a = post(&server, "/v1/completions", &cut, None);
        assert_eq!(a.status, 200, "{}", a.body);
        let (got, finish) = if stream {
            let mut t = String::new();
            let mut finish = None;
            for e in a.events().iter().filter(|e| *e != "[DONE]") {
                let v: Value = serde_json::from_str(e).unwrap();
                t.push_str(v["choices"][0]["text"].as_str().unwrap());
                finish = v["choices"][0]["finish_reason"].as_str().map(String::from);
            }
            (t, finish)
        } else {
            let v = a.json();
            (
                v["choices"][0]["text"].as_str().unwrap().to_string(),
                v["choices"][0]["finish_reason"].as_str().map(String::from),
            )
        };
        assert_eq!(got, before, "stop {stop:?} in {text:?} (stream: {stream})");
        assert_eq!(finish.as_deref(), Some("stop"));
    }

    // Mistakes: each a JSON error body with the right status and field.
    let err = |a: &openai_client::Answer| a.json()["error"].clone();
    let n2 = post(
        &server,
        "/v1/completions",
        &json!({"prompt": "x", "n": 2}),
        None,
    );
    assert_eq!(n2.status, 400);
    assert_eq!(err(&n2)["param"], "n");
    assert_eq!(err(&n2)["type"], "invalid_request_error");
    let hot = post(
        &server,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "x"}], "temperature": 3}),
        None,
    );
    assert_eq!(hot.status, 400);
    assert_eq!(err(&hot)["param"], "temperature");
    let other = post(
        &server,
        "/v1/completions",
        &json!({"model": "gpt-4", "prompt": "x"}),
        None,
    );
    assert_eq!(other.status, 404);
    assert_eq!(err(&other)["code"], "model_not_found");
    let broken = openai_client::curl(&[
        &server.url("/v1/completions"),
        "-H",
        "content-type: application/json",
        "--data-binary",
        "{\"prompt\": ",
    ]);
    assert_eq!(broken.status, 400);
    assert!(
        err(&broken)["message"]
            .as_str()
            .unwrap()
            .contains("not valid")
    );
    let token = post(
        &server,
        "/v1/completions",
        &json!({"prompt": [1, 999]}),
        None,
    );
    assert_eq!(token.status, 400, "a token outside the vocabulary");

    // Over the window: the prompt alone (413), or with max_tokens (400);
    // both say context_length_exceeded, before anything is allocated.
    let over: Vec<u32> = vec![7; WINDOW + 1];
    let too_long = post(&server, "/v1/completions", &json!({"prompt": over}), None);
    assert_eq!(too_long.status, 413, "{}", too_long.body);
    assert_eq!(err(&too_long)["code"], "context_length_exceeded");
    let tight: Vec<u32> = vec![7; WINDOW - 4];
    let with_max = post(
        &server,
        "/v1/completions",
        &json!({"prompt": tight, "max_tokens": 10}),
        None,
    );
    assert_eq!(with_max.status, 400, "{}", with_max.body);
    assert_eq!(err(&with_max)["code"], "context_length_exceeded");
    assert_eq!(err(&with_max)["param"], "max_tokens");

    // The metrics saw all of it, and every page is back.
    let m = server.wait_pools_idle(Duration::from_secs(10));
    let finished = sample(
        &m,
        "handoff_http_requests_total",
        &["outcome=\"finished\"", "status=\"200\""],
    );
    assert_eq!(finished, 1.0 + 8.0, "the model list and 8 answers:\n{m}");
    assert_eq!(
        sample(
            &m,
            "handoff_rejections_total",
            &["reason=\"prompt_too_long\""]
        ),
        1.0
    );
    assert_eq!(
        sample(
            &m,
            "handoff_rejections_total",
            &["reason=\"exceeds_window\""]
        ),
        1.0
    );
    assert_eq!(
        sample(
            &m,
            "handoff_http_requests_total",
            &["outcome=\"invalid\"", "status=\"400\""]
        ),
        3.0,
        "n=2, temperature=3, broken JSON:\n{m}"
    );
    assert!(sample(&m, "handoff_generated_tokens_total", &[]) >= 8.0 * 3.0);
    assert!(m.contains("handoff_time_to_first_token_seconds_bucket"));
    assert_eq!(sample(&m, "handoff_isolation_violations", &[]), 0.0);
    assert_eq!(sample(&m, "handoff_audit_enabled", &[]), 1.0);
    assert_eq!(
        sample(
            &m,
            "handoff_pool_pages",
            &["pool=\"colocated\"", "state=\"in_use\""]
        ),
        0.0,
        "{m}"
    );
    // The engine's own counters, as its service thread reported them.
    assert_eq!(sample(&m, "handoff_queue_length", &[]), 0.0, "{m}");
    assert!(sample(&m, "handoff_prefill_tokens_total", &[]) > 0.0, "{m}");
    assert!(m.contains("handoff_preemptions_total"), "{m}");
    assert!(
        m.contains("handoff_prefix_cache_pages_total") && m.contains("state=\"cached\""),
        "{m}"
    );
}
