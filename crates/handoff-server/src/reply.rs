//! OpenAI response bodies and stream chunks, and the text that goes in them.

use handoff::text::StopMatcher;
use serde_json::{Value, json};

use crate::codec::{StreamText, TextCodec};
use crate::errors::ApiError;

/// Which API a request came through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    Completions,
    Chat,
}

impl Api {
    pub fn label(self) -> &'static str {
        match self {
            Api::Completions => "completions",
            Api::Chat => "chat",
        }
    }
    /// The request field that holds the prompt.
    pub fn prompt_param(self) -> &'static str {
        match self {
            Api::Completions => "prompt",
            Api::Chat => "messages",
        }
    }
}

/// Builds the bodies of one answer.
#[derive(Clone, Debug)]
pub struct Reply {
    pub api: Api,
    id: String,
    created: u64,
    model: String,
    /// Add `token_ids` to every choice (requested, or no tokenizer).
    with_ids: bool,
}

pub fn usage(prompt: usize, completion: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    })
}

impl Reply {
    pub fn new(api: Api, request: u64, created: u64, model: &str, with_ids: bool) -> Self {
        let prefix = match api {
            Api::Completions => "cmpl",
            Api::Chat => "chatcmpl",
        };
        Reply {
            api,
            id: format!("{prefix}-{request}"),
            created,
            model: model.to_string(),
            with_ids,
        }
    }

    pub fn with_ids(&self) -> bool {
        self.with_ids
    }

    fn envelope(&self, object: &str, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }

    /// The whole answer of a non-streaming request.
    /// `logprobs`: the choice's (null unless asked).
    pub fn full(
        &self,
        text: &str,
        ids: &[u32],
        finish: &str,
        usage: Value,
        logprobs: Value,
    ) -> Value {
        let mut choice = match self.api {
            Api::Completions => json!({
                "index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish,
            }),
            Api::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish,
            }),
        };
        if self.with_ids {
            choice["token_ids"] = json!(ids);
        }
        let object = match self.api {
            Api::Completions => "text_completion",
            Api::Chat => "chat.completion",
        };
        let mut body = self.envelope(object, json!([choice]));
        body["usage"] = usage;
        body
    }

    fn chunk_object(&self) -> &'static str {
        match self.api {
            Api::Completions => "text_completion",
            Api::Chat => "chat.completion.chunk",
        }
    }

    /// Chat streams open with the assistant's role.
    pub fn role_chunk(&self) -> Option<Value> {
        (self.api == Api::Chat).then(|| {
            self.envelope(
                self.chunk_object(),
                json!([{
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": null,
                    "finish_reason": null,
                }]),
            )
        })
    }

    /// A piece of text (and the ids that made it, and their `logprobs` when
    /// asked: null otherwise), or the last chunk with its `finish_reason`.
    pub fn chunk(&self, text: &str, ids: &[u32], finish: Option<&str>, logprobs: Value) -> Value {
        let mut choice = match self.api {
            Api::Completions => json!({
                "index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish,
            }),
            Api::Chat => {
                let delta = if text.is_empty() && finish.is_some() {
                    json!({})
                } else {
                    json!({"content": text})
                };
                json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            }
        };
        if self.with_ids {
            choice["token_ids"] = json!(ids);
        }
        self.envelope(self.chunk_object(), json!([choice]))
    }

    /// The usage chunk (`stream_options.include_usage`): no choices.
    pub fn usage_chunk(&self, usage: Value) -> Value {
        let mut body = self.envelope(self.chunk_object(), json!([]));
        body["usage"] = usage;
        body
    }
}

/// Generated ids to text: streaming detokenization, end-of-turn ids kept
/// out of the text, and user stop strings (the library's [`StopMatcher`]).
pub struct Detok {
    decoder: Box<dyn StreamText>,
    /// `None` once finished.
    stops: Option<StopMatcher>,
    stop_ids: Vec<u32>,
    ids: Vec<u32>,
}

impl Detok {
    /// `stops` are checked already (non-empty strings): a refusal here is
    /// the request's 400.
    pub fn new(codec: &dyn TextCodec, stops: Vec<String>) -> Result<Self, ApiError> {
        let stops =
            StopMatcher::new(stops).map_err(|e| ApiError::bad_param("stop", e.to_string()))?;
        Ok(Detok {
            decoder: codec.decoder(),
            stops: Some(stops),
            stop_ids: codec.stop_ids(),
            ids: Vec::new(),
        })
    }

    /// Every id generated so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// The text `id` lets out, and whether a stop string matched.
    pub fn token(&mut self, id: u32) -> (String, bool) {
        self.ids.push(id);
        if self.stop_ids.contains(&id) {
            return (String::new(), false);
        }
        let piece = self.decoder.push(id);
        match self.stops.as_mut() {
            Some(stops) => {
                let step = stops.push(&piece);
                (step.text, step.stopped.is_some())
            }
            None => (String::new(), false),
        }
    }

    /// What is held back once generation ended, and whether a stop string
    /// matched in it.
    pub fn finish(&mut self) -> (String, bool) {
        let tail = self.decoder.finish();
        let Some(mut stops) = self.stops.take() else {
            return (String::new(), false);
        };
        let step = stops.push(&tail);
        if step.stopped.is_some() {
            return (step.text, true);
        }
        let mut text = step.text;
        text.push_str(&stops.finish());
        (text, false)
    }
}
