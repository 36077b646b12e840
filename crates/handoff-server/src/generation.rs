//! One admitted request, seen from the async side: its engine events as an
//! async stream, its latencies in the metrics, and cancellation when the
//! client goes away.
//!
//! The engine's [`RequestHandle`] is read on a blocking thread (its stream
//! is a crossbeam channel) and forwarded to the handler. When the handler
//! is dropped before it answered (hyper drops it when the client
//! disconnects), [`Generation`]'s `Drop` asks the engine to cancel through
//! the handle's [`Canceller`]: the engine (or decode worker) releases the
//! pages at its next step, once no write can land; a transfer in flight is
//! fenced by the decode worker, never aborted mid-write. The forwarding
//! thread then reads the engine's confirmation and counts it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff::transfer::TransferError;
use handoff::{Canceller, EngineError, Event, Outcome, Request, RequestHandle};
use tokio::sync::mpsc;
use tracing::{Instrument, Span, info, info_span};

use crate::errors::ApiError;
use crate::routes::AppState;

/// How often the forwarding thread checks that the client is still there
/// while the engine is quiet.
const POLL: Duration = Duration::from_millis(50);

/// A request the engine admitted. See the module documentation.
pub struct Generation {
    state: Arc<AppState>,
    rx: mpsc::UnboundedReceiver<Event>,
    canceller: Canceller,
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

/// Submits `req` (admission runs on a blocking thread: it waits for the
/// engine's next turn) and starts forwarding its events.
pub async fn start(
    state: &Arc<AppState>,
    req: Request,
    endpoint: &'static str,
    prompt_param: &'static str,
) -> Result<Generation, ApiError> {
    let prompt_tokens = req.prompt.len();
    let submitter = state.submitter.clone();
    let submitted = Instant::now();
    let handle = tokio::task::spawn_blocking(move || submitter.submit(req))
        .instrument(info_span!("admission"))
        .await
        .map_err(|e| ApiError::new(500, format!("the admission task failed: {e}")))?;
    let handle = match handle {
        Ok(h) => h,
        Err(r) => {
            state.metrics.rejected(&r);
            info!(reason = %r, "rejected at admission");
            return Err(ApiError::from_rejection(&r, prompt_param));
        }
    };
    state.metrics.admitted(prompt_tokens);
    let canceller = handle.canceller();
    let (tx, rx) = mpsc::unbounded_channel();
    let st = state.clone();
    tokio::task::spawn_blocking(move || forward(handle, tx, &st));
    Ok(Generation {
        state: state.clone(),
        rx,
        canceller,
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

/// The forwarding thread: the engine's events to the async side until the
/// final one. A client that stopped listening gets its request cancelled.
fn forward(handle: RequestHandle, tx: mpsc::UnboundedSender<Event>, state: &AppState) {
    let mut gone = false;
    loop {
        match handle.events().recv_timeout(POLL) {
            Ok(ev) => {
                let done = matches!(ev, Event::Done(_));
                if matches!(ev, Event::Done(Outcome::Cancelled)) {
                    state.metrics.cancel_confirmed();
                }
                if tx.send(ev).is_err() && !gone {
                    gone = true;
                    handle.cancel();
                }
                if done {
                    return;
                }
            }
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                if !gone && tx.is_closed() {
                    gone = true;
                    handle.cancel();
                }
            }
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                // The engine dropped the request without an outcome: only
                // when it is gone (shut down).
                let _ = tx.send(Event::Done(Outcome::Failed(EngineError::Shutdown)));
                return;
            }
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
        let ev = self
            .rx
            .recv()
            .instrument(phase)
            .await
            .unwrap_or(Event::Done(Outcome::Failed(EngineError::Shutdown)));
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
            self.canceller.cancel();
            self.ended = true;
            self.state.metrics.ended(self.last_token.is_some());
        }
        self.state.metrics.answered(self.endpoint, outcome, status);
        self.span.in_scope(|| {
            info!(
                outcome,
                status,
                prompt_tokens = self.prompt_tokens,
                completion_tokens = self.tokens,
                elapsed_ms = self.submitted.elapsed().as_secs_f64() * 1e3,
                "answered"
            )
        });
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        // The client went away before its answer was complete.
        self.canceller.cancel();
        let m = &self.state.metrics;
        m.disconnected();
        if !self.ended {
            self.ended = true;
            m.ended(self.last_token.is_some());
        }
        m.answered(self.endpoint, "cancelled", 499);
        self.span.in_scope(|| {
            info!(
                completion_tokens = self.tokens,
                "client disconnected: request cancelled"
            )
        });
    }
}
