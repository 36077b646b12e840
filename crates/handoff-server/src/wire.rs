//! The request bodies of `/v1/completions` and `/v1/chat/completions`, and
//! their checks. Unknown fields are ignored (as OpenAI's API does); a known
//! field asking for something this server does not do (`n > 1`, echo,
//! penalties, tools) is a 400 naming it, never silently dropped.

use handoff::SamplingParams;
use serde::Deserialize;
use serde_json::Value;

use handoff::text::Message;

use crate::codec::TextCodec;
use crate::errors::ApiError;

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// Fields both endpoints share.
#[derive(Debug, Default, Deserialize)]
pub struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<Value>,
    pub n: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub logit_bias: Option<Value>,
    /// Extension (as vLLM's): answer with the generated token ids too.
    pub return_token_ids: Option<bool>,
}

#[derive(Debug, Deserialize)]
pub struct CompletionBody {
    #[serde(flatten)]
    pub common: Common,
    pub prompt: Option<Value>,
    pub echo: Option<bool>,
    pub logprobs: Option<Value>,
    pub best_of: Option<i64>,
    pub suffix: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct ChatBody {
    #[serde(flatten)]
    pub common: Common,
    pub messages: Option<Vec<Value>>,
    pub max_completion_tokens: Option<i64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub tools: Option<Vec<Value>>,
    pub response_format: Option<Value>,
}

/// What a request asks for, checked.
#[derive(Debug)]
pub struct Gen {
    /// `None`: as much as the window leaves (chat) or 16 (completions).
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stops: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub return_token_ids: bool,
}

/// The most alternatives a request may ask for (the engine's limit).
const MAX_TOP: i64 = handoff::sampling::MAX_TOP_LOGPROBS as i64;

fn top_count(param: &'static str, n: i64) -> Result<u8, ApiError> {
    if (0..=MAX_TOP).contains(&n) {
        Ok(n as u8)
    } else {
        Err(ApiError::bad_param(
            param,
            format!("{param}={n}: it must be between 0 and {MAX_TOP}"),
        ))
    }
}

/// `/v1/completions`' `logprobs` (an integer: the alternatives per token),
/// into `g`.
pub fn completion_logprobs(b: &CompletionBody, g: &mut Gen) -> Result<(), ApiError> {
    g.sampling.logprobs = match &b.logprobs {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_i64() {
            Some(n) => Some(top_count("logprobs", n)?),
            None => {
                return Err(ApiError::bad_param(
                    "logprobs",
                    "logprobs must be an integer (the alternatives listed per token)",
                ));
            }
        },
    };
    Ok(())
}

/// The chat's `logprobs` (bool) and `top_logprobs` (0 to 20), into `g`.
pub fn chat_logprobs(b: &ChatBody, g: &mut Gen) -> Result<(), ApiError> {
    g.sampling.logprobs = match (b.logprobs, b.top_logprobs) {
        (Some(true), top) => Some(top_count("top_logprobs", top.unwrap_or(0))?),
        (_, Some(_)) => {
            return Err(ApiError::bad_param(
                "top_logprobs",
                "top_logprobs needs logprobs: true",
            ));
        }
        _ => None,
    };
    Ok(())
}

/// Parses a JSON body into `T`, or a 400 saying what is wrong.
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::new(400, format!("the request body is not valid here: {e}")))
}

fn unsupported(param: &'static str, what: &str) -> ApiError {
    ApiError::bad_param(param, format!("{what} is not supported by this server"))
        .with_code("unsupported_parameter")
}

/// Checks the shared fields. `served`: the model name this server answers to.
pub fn check_common(c: &Common, served: &str, seed_default: u64) -> Result<Gen, ApiError> {
    match c.model.as_deref() {
        Some(m) if m != served => {
            return Err(ApiError::new(
                404,
                format!("the model {m:?} does not exist here; this server serves {served:?}"),
            )
            .with_code("model_not_found"));
        }
        _ => {}
    }
    if let Some(n) = c.n
        && n != 1
    {
        return Err(ApiError::bad_param(
            "n",
            format!("n={n}: only n=1 is supported"),
        ));
    }
    let max_tokens = match c.max_tokens {
        None => None,
        Some(v) if v >= 1 => Some(usize::try_from(v).unwrap_or(usize::MAX)),
        Some(v) => {
            return Err(ApiError::bad_param(
                "max_tokens",
                format!("max_tokens={v}: ask for at least 1 token"),
            ));
        }
    };
    let temperature = c.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::bad_param(
            "temperature",
            format!("temperature={temperature}: it must be between 0 and 2"),
        ));
    }
    let top_p = c.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::bad_param(
            "top_p",
            format!("top_p={top_p}: it must be in (0, 1]"),
        ));
    }
    for (name, v) in [
        ("presence_penalty", c.presence_penalty),
        ("frequency_penalty", c.frequency_penalty),
    ] {
        if v.is_some_and(|v| v != 0.0) {
            return Err(unsupported(name, name));
        }
    }
    if c.logit_bias
        .as_ref()
        .is_some_and(|v| v.as_object().is_none_or(|o| !o.is_empty()))
    {
        return Err(unsupported("logit_bias", "logit_bias"));
    }
    let stops = stops(c.stop.as_ref())?;
    let sampling = SamplingParams {
        temperature: temperature as f32,
        top_k: None,
        top_p: (top_p < 1.0).then_some(top_p as f32),
        // A client's seed reproduces its draws; without one, each request
        // draws its own.
        seed: c.seed.map_or(seed_default, |s| s as u64),
        stop_ids: Vec::new(),
        logprobs: None,
    };
    let stream = c.stream.unwrap_or(false);
    Ok(Gen {
        max_tokens,
        sampling,
        stops,
        stream,
        include_usage: stream
            && c.stream_options
                .as_ref()
                .and_then(|o| o.include_usage)
                .unwrap_or(false),
        return_token_ids: c.return_token_ids.unwrap_or(false),
    })
}

fn stops(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let bad = |why: &str| ApiError::bad_param("stop", why.to_string());
    let list = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| s.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| bad("stop must be a string or an array of strings"))?,
        Some(_) => return Err(bad("stop must be a string or an array of strings")),
    };
    if list.len() > 4 {
        return Err(bad("at most 4 stop strings"));
    }
    if list.iter().any(String::is_empty) {
        return Err(bad("a stop string is empty"));
    }
    Ok(list)
}

/// The prompt of `/v1/completions`: a string, token ids, or a batch of one.
pub fn completion_prompt(b: &CompletionBody, codec: &dyn TextCodec) -> Result<Vec<u32>, ApiError> {
    if b.echo == Some(true) {
        return Err(unsupported("echo", "echo"));
    }
    if b.best_of.is_some_and(|n| n != 1) {
        return Err(unsupported("best_of", "best_of other than 1"));
    }
    if b.suffix.is_some() {
        return Err(unsupported("suffix", "suffix"));
    }
    let bad = |why: String| ApiError::bad_param("prompt", why);
    let ids = |a: &[Value]| -> Result<Vec<u32>, ApiError> {
        a.iter()
            .map(|v| {
                v.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(|| bad(format!("{v} is not a token id")))
            })
            .collect()
    };
    match &b.prompt {
        None => Err(bad("prompt is required".into())),
        Some(Value::String(s)) => codec.encode(s),
        Some(Value::Array(a)) if a.is_empty() || a[0].is_number() => ids(a),
        Some(Value::Array(a)) if a.len() == 1 => match &a[0] {
            Value::String(s) => codec.encode(s),
            Value::Array(inner) => ids(inner),
            _ => Err(bad("prompt must be a string or token ids".into())),
        },
        Some(Value::Array(_)) => Err(bad(
            "one prompt per request: batches of prompts are not supported".into(),
        )),
        Some(_) => Err(bad("prompt must be a string or token ids".into())),
    }
}

/// The messages of `/v1/chat/completions`.
pub fn chat_messages(b: &ChatBody) -> Result<Vec<Message>, ApiError> {
    if b.tools.as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(unsupported("tools", "tool calling"));
    }
    if let Some(rf) = &b.response_format
        && rf.get("type").and_then(Value::as_str) != Some("text")
    {
        return Err(unsupported(
            "response_format",
            "a response_format other than text",
        ));
    }
    let bad = |why: String| ApiError::bad_param("messages", why);
    let msgs = b
        .messages
        .as_ref()
        .ok_or_else(|| bad("messages is required".into()))?;
    if msgs.is_empty() {
        return Err(bad("messages is empty".into()));
    }
    msgs.iter()
        .enumerate()
        .map(|(i, m)| {
            let role = m
                .get("role")
                .and_then(Value::as_str)
                .ok_or_else(|| bad(format!("messages[{i}] has no role")))?;
            let content = match m.get("content") {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => {
                    let mut s = String::new();
                    for p in parts {
                        match (p.get("type").and_then(Value::as_str), p.get("text")) {
                            (Some("text"), Some(Value::String(t))) => s.push_str(t),
                            _ => {
                                return Err(bad(format!(
                                    "messages[{i}]: only text content parts are supported"
                                )));
                            }
                        }
                    }
                    s
                }
                Some(_) => return Err(bad(format!("messages[{i}].content is not text"))),
            };
            Ok(Message::new(role, content))
        })
        .collect()
}

/// `max_completion_tokens` is the newer name of `max_tokens`.
pub fn chat_max_tokens(b: &ChatBody, g: &mut Gen) -> Result<(), ApiError> {
    if let Some(v) = b.max_completion_tokens {
        if v < 1 {
            return Err(ApiError::bad_param(
                "max_completion_tokens",
                format!("max_completion_tokens={v}: ask for at least 1 token"),
            ));
        }
        g.max_tokens = Some(usize::try_from(v).unwrap_or(usize::MAX));
    }
    Ok(())
}
