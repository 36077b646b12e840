//! `logprobs` in OpenAI's two shapes, from the engine's per-token
//! [`TokenLogprobs`] (the model's log-probabilities of each generated token
//! and of its most likely alternatives):
//!
//! - chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs":
//!   [{"token", "logprob", "bytes"}]}]}`;
//! - completions: `{"tokens", "token_logprobs", "top_logprobs": [{token:
//!   logprob}], "text_offset"}`.
//!
//! A token's text is its own decoding (`TextCodec::token_bytes`, lossy where
//! a token is part of a character; `bytes` holds the exact bytes). Ids that
//! end a turn are never shown as text and get no entry.

use std::sync::Arc;

use handoff::sampling::TokenLogprobs;
use serde_json::{Map, Value, json};

use crate::codec::TextCodec;
use crate::reply::Api;

/// Formats one answer's log-probabilities, chunk after chunk.
pub struct LogprobJson {
    api: Api,
    codec: Arc<dyn TextCodec>,
    /// Characters of completion text before the next entry (`text_offset`).
    offset: usize,
}

impl LogprobJson {
    pub fn new(api: Api, codec: Arc<dyn TextCodec>) -> Self {
        LogprobJson {
            api,
            codec,
            offset: 0,
        }
    }

    /// Whether `id` gets an entry (it is not an end-of-turn id).
    pub fn shown(&self, id: u32) -> bool {
        !self.codec.stop_ids().contains(&id)
    }

    fn spell(&self, id: u32) -> (String, Vec<u8>) {
        let bytes = self.codec.token_bytes(id);
        (String::from_utf8_lossy(&bytes).into_owned(), bytes)
    }

    /// The `logprobs` value of a choice whose text came from `entries`'
    /// tokens, in order.
    pub fn value(&mut self, entries: &[TokenLogprobs]) -> Value {
        match self.api {
            Api::Chat => {
                let content: Vec<Value> = entries
                    .iter()
                    .map(|e| {
                        let (token, bytes) = self.spell(e.token);
                        let top: Vec<Value> = e
                            .top
                            .iter()
                            .map(|&(id, lp)| {
                                let (token, bytes) = self.spell(id);
                                json!({"token": token, "logprob": lp, "bytes": bytes})
                            })
                            .collect();
                        json!({
                            "token": token,
                            "logprob": e.logprob,
                            "bytes": bytes,
                            "top_logprobs": top,
                        })
                    })
                    .collect();
                json!({ "content": content })
            }
            Api::Completions => {
                let (mut tokens, mut values, mut tops, mut offsets) =
                    (Vec::new(), Vec::new(), Vec::new(), Vec::new());
                for e in entries {
                    let (token, _) = self.spell(e.token);
                    offsets.push(self.offset);
                    self.offset += token.chars().count();
                    tokens.push(token);
                    values.push(e.logprob);
                    let mut top = Map::new();
                    for &(id, lp) in &e.top {
                        top.insert(self.spell(id).0, json!(lp));
                    }
                    tops.push(Value::Object(top));
                }
                json!({
                    "tokens": tokens,
                    "token_logprobs": values,
                    "top_logprobs": tops,
                    "text_offset": offsets,
                })
            }
        }
    }
}
