//! One admitted request, seen from the async side: its engine events
//! awaited in the handler's own task, its latencies in the metrics, and
//! cancellation when the client goes away.
//!
//! No thread waits for a request. Admission is
//! [`Submitter::submit_async`](handoff::service::Submitter::submit_async),
//! which queues the request and is awaited; the engine's events are
//! awaited with [`handoff::Events::recv_async`], whose waker the engine
//! wakes as it streams. When the handler is dropped before it answered
//! (hyper drops it when the client disconnects), [`Generation`]'s `Drop`
//! asks the engine to cancel through the request's [`handoff::Canceller`]:
//! the engine (or decode worker) releases the pages at its next step, once
//! no write can land; a transfer in flight is fenced by the decode worker,
//! never aborted mid-write. A small task then awaits the engine's
//! confirmation and counts it.

use std::sync::Arc;
use std::time::Instant;

use handoff::transfer::TransferError;
use handoff::{EngineError, Event, Outcome, Request, RequestHandle, TenantId};
use tracing::{Instrument, Span, info, info_span};

use crate::access::Answered;
use crate::errors::ApiError;
use crate::routes::AppState;

/// A request the engine admitted. See the module documentation.
pub struct Generation {
    state: Arc<AppState>,
    /// `None` only once `Drop` has handed it to the confirming task.
    handle: Option<RequestHandle>,
    tenant: TenantId,
    endpoint: &'static str,
    span: Span,
    /// Waiting for the first token: queue and prefill (and, disaggregated,
    /// the KV transfer and its verification).
    first_span: Span,
    decode_span: Span,
    submitted: Instant,
    last_token: Option<Instant>,
    prompt_tokens: usize,
    /// Tokens received so far.
    pub tokens: usize,
    /// The engine's stream has ended.
    ended: bool,
    /// The client has been answered (metrics recorded).
    answered: bool,
}

/// Submits `req` (queued at once; the admission is awaited, never blocked
/// on) and returns the generation to read.
pub async fn start(
    state: &Arc<AppState>,
    req: Request,
    endpoint: &'static str,
    prompt_param: &'static str,
) -> Result<Generation, ApiError> {
    let prompt_tokens = req.prompt.len();
    let tenant = req.tenant;
    let submitted = Instant::now();
    let handle = state
        .submitter
        .submit_async(req)
        .instrument(info_span!("admission"))
        .await;
    let handle = match handle {
        Ok(h) => h,
        Err(r) => {
            state.metrics.rejected(&r);
            info!(reason = %r, "rejected at admission");
            return Err(ApiError::from_rejection(&r, prompt_param));
        }
    };
    state.metrics.admitted(prompt_tokens);
    Ok(Generation {
        state: state.clone(),
        handle: Some(handle),
        tenant,
        endpoint,
        span: Span::current(),
        first_span: if state.disaggregated {
            info_span!("prefill_transfer")
        } else {
            info_span!("prefill")
        },
        decode_span: info_span!("decode"),
        submitted,
        last_token: None,
        prompt_tokens,
        tokens: 0,
        ended: false,
        answered: false,
    })
}

/// The next event of `handle`'s stream, `Done` when it ended without one
/// (the engine went away: shut down).
async fn next_event(handle: &RequestHandle) -> Event {
    handle
        .events()
        .recv_async()
        .await
        .unwrap_or(Event::Done(Outcome::Failed(EngineError::Shutdown)))
}

/// After a disconnect: reads the cancelled request's stream to its end and
/// counts the engine's confirmation.
async fn confirm_cancel(handle: RequestHandle, state: Arc<AppState>) {
    loop {
        match next_event(&handle).await {
            Event::Done(Outcome::Cancelled) => return state.metrics.cancel_confirmed(),
            Event::Done(_) => return,
            Event::Token(_) | Event::Logprobs(_) => {}
        }
    }
}

impl Generation {
    /// The next engine event; the stream always ends with `Done`.
    pub async fn next(&mut self) -> Event {
        let phase = if self.last_token.is_none() {
            self.first_span.clone()
        } else {
            self.decode_span.clone()
        };
        let ev = match &self.handle {
            Some(h) => next_event(h).instrument(phase).await,
            None => Event::Done(Outcome::Failed(EngineError::Shutdown)),
        };
        let now = Instant::now();
        let m = &self.state.metrics;
        match &ev {
            Event::Token(_) => {
                match self.last_token {
                    None => {
                        let ttft = now - self.submitted;
                        m.first_token(ttft, self.prompt_tokens, self.state.disaggregated);
                        self.span
                            .in_scope(|| info!(ttft_ms = ttft.as_secs_f64() * 1e3, "first token"));
                    }
                    Some(t) => m.next_token(now - t),
                }
                self.last_token = Some(now);
                self.tokens += 1;
            }
            Event::Logprobs(_) => {}
            Event::Done(o) => {
                if !self.ended {
                    self.ended = true;
                    m.ended(self.last_token.is_some());
                }
                if matches!(
                    o,
                    Outcome::Failed(EngineError::Transfer(TransferError::Integrity(_)))
                ) {
                    m.integrity_failure();
                }
            }
        }
        ev
    }

    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    /// Records the answer. A generation the server ends itself (a stop
    /// string matched) is cancelled in the engine here.
    pub fn answer(&mut self, outcome: &'static str, status: u16) {
        if self.answered {
            return;
        }
        self.answered = true;
        if !self.ended {
            if let Some(h) = &self.handle {
                h.cancel();
            }
            self.ended = true;
            self.state.metrics.ended(self.last_token.is_some());
        }
        self.record(outcome, status);
    }

    /// The request's access-log line and its answer in the metrics.
    fn record(&self, outcome: &'static str, status: u16) {
        let answered = Answered {
            tenant: Some(self.tenant),
            endpoint: self.endpoint,
            outcome,
            status,
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.tokens,
            elapsed: self.submitted.elapsed(),
        };
        self.span.in_scope(|| answered.record(&self.state.metrics));
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        // The client went away before its answer was complete.
        if let Some(h) = self.handle.take() {
            h.cancel();
            // The engine's confirmation comes within a step: a task (not a
            // thread) awaits it. Outside a runtime the handle is dropped,
            // which cancels as well, uncounted.
            if !self.ended
                && let Ok(rt) = tokio::runtime::Handle::try_current()
            {
                rt.spawn(confirm_cancel(h, self.state.clone()));
            }
        }
        let m = &self.state.metrics;
        m.disconnected();
        if !self.ended {
            self.ended = true;
            m.ended(self.last_token.is_some());
        }
        self.record("cancelled", 499);
    }
}
