//! `stream: true`: server-sent events in OpenAI's chunk format, ending with
//! `data: [DONE]`.
//!
//! The status is decided before the first byte: the stream waits for the
//! engine's first event, so a request that fails before generating (an
//! integrity failure in the transfer, a shutdown) gets its own status and
//! error body, never a 200. A failure after tokens were sent ends the
//! stream with one `data: {"error": {...}}` event and no `[DONE]`: the
//! client sees an error, not a short answer. A client that goes away drops
//! the stream, and with it the [`Generation`], which cancels the request.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use handoff::{Event, FinishReason, Outcome};
use serde_json::Value;

use crate::errors::ApiError;
use crate::generation::Generation;
use crate::logprobs::LogprobJson;
use crate::reply::{Detok, Reply, usage};

struct Streaming {
    g: Generation,
    reply: Reply,
    detok: Detok,
    include_usage: bool,
    queue: VecDeque<SseEvent>,
    over: bool,
    /// Set when the request asked for log-probabilities: each token's chunk
    /// then waits in `pending` for them (they follow it).
    lp: Option<LogprobJson>,
    /// A token's text, id and whether a stop string matched in it.
    pending: Option<(String, u32, bool)>,
}

fn data(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

impl Streaming {
    fn on_event(&mut self, ev: Event) {
        match ev {
            Event::Token(t) => {
                let (text, stopped) = self.detok.token(t);
                if self.lp.is_some() {
                    self.flush();
                    self.pending = Some((text, t, stopped));
                    return;
                }
                self.emit(text, t, stopped, Value::Null);
            }
            Event::Logprobs(e) => {
                let Some((text, t, stopped)) = self.pending.take() else {
                    return;
                };
                let value = match self.lp.as_mut() {
                    Some(lp) if lp.shown(e.token) => lp.value(std::slice::from_ref(&e)),
                    Some(lp) => lp.value(&[]),
                    None => Value::Null,
                };
                self.emit(text, t, stopped, value);
            }
            Event::Done(Outcome::Finished(reason)) => {
                self.flush();
                let (text, stopped) = self.detok.finish();
                if !text.is_empty() {
                    self.queue
                        .push_back(data(&self.reply.chunk(&text, &[], None, Value::Null)));
                }
                let why = match reason {
                    _ if stopped => "stop",
                    FinishReason::Stop(_) => "stop",
                    _ => "length",
                };
                self.finish(why);
            }
            Event::Done(o) => {
                self.flush();
                let e = ApiError::from_outcome(&o, self.reply.api.prompt_param());
                self.queue.push_back(data(&e.body()));
                self.g.answer(e.outcome, e.status);
                self.over = true;
            }
        }
    }

    /// A token's chunk (when it carries text, ids or log-probabilities);
    /// the last one when a stop string matched in it.
    fn emit(&mut self, text: String, t: u32, stopped: bool, logprobs: Value) {
        if !text.is_empty() || self.reply.with_ids() || !logprobs.is_null() {
            let chunk = self.reply.chunk(&text, &[t], None, logprobs);
            self.queue.push_back(data(&chunk));
        }
        if stopped {
            self.finish("stop");
        }
    }

    /// A token still waiting for log-probabilities that did not come goes
    /// out without them.
    fn flush(&mut self) {
        if let Some((text, t, stopped)) = self.pending.take() {
            self.emit(text, t, stopped, Value::Null);
        }
    }

    fn finish(&mut self, why: &str) {
        self.queue
            .push_back(data(&self.reply.chunk("", &[], Some(why), Value::Null)));
        if self.include_usage {
            let u = usage(self.g.prompt_tokens(), self.g.tokens);
            self.queue.push_back(data(&self.reply.usage_chunk(u)));
        }
        self.queue.push_back(SseEvent::default().data("[DONE]"));
        self.g.answer("finished", 200);
        self.over = true;
    }
}

/// Answers a streaming request.
pub async fn respond(
    mut g: Generation,
    reply: Reply,
    detok: Detok,
    include_usage: bool,
    lp: Option<LogprobJson>,
) -> Response {
    // Nothing is sent before the first event: a request that fails before
    // generating gets its own status.
    let first = g.next().await;
    if let Event::Done(o) = &first
        && !matches!(o, Outcome::Finished(_))
    {
        let e = ApiError::from_outcome(o, reply.api.prompt_param());
        g.answer(e.outcome, e.status);
        return e.into_response();
    }
    let mut s = Streaming {
        g,
        detok,
        include_usage,
        queue: VecDeque::new(),
        over: false,
        reply,
        lp,
        pending: None,
    };
    if let Some(role) = s.reply.role_chunk() {
        s.queue.push_back(data(&role));
    }
    s.on_event(first);
    let stream = futures_util::stream::unfold(s, |mut s| async move {
        loop {
            if let Some(ev) = s.queue.pop_front() {
                return Some((Ok::<_, Infallible>(ev), s));
            }
            if s.over {
                return None;
            }
            let ev = s.g.next().await;
            s.on_event(ev);
        }
    });
    Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(10)))
        .into_response()
}
