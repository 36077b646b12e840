//! What a client holds for a submitted request: a stream of tokens ending
//! in exactly one final [`Outcome`], and a way to cancel.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::engine::EngineError;
use crate::engine::events::{CancelFlag, Event, Events, RecvTimeoutError};
use crate::ids::RequestId;
use crate::sched::Rejection;

/// Why generation stopped normally.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_new_tokens` were generated.
    Length,
    /// This stop id was generated (and streamed).
    Stop(u32),
}

/// The final status of a request; sent exactly once, last.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    Finished(FinishReason),
    /// Turned away without generating (e.g. the engine shut down first).
    Rejected(Rejection),
    Cancelled,
    /// The request failed; nothing more was generated for it.
    Failed(EngineError),
}

impl crate::http::HttpStatus for Outcome {
    /// The status a server answers the request with: 200 when it finished,
    /// 499 (client closed request, nginx's convention) when the client
    /// cancelled it, and the rejection's or failure's own status otherwise.
    fn http_status(&self) -> u16 {
        match self {
            Outcome::Finished(_) => 200,
            Outcome::Cancelled => 499,
            Outcome::Rejected(r) => r.http_status(),
            Outcome::Failed(e) => e.http_status(),
        }
    }
}

/// Cancels one request from any thread. The engine releases the request's
/// pages at its next step, when no write to them can be in flight.
#[derive(Clone, Debug)]
pub struct Canceller(pub(crate) CancelFlag);

impl Canceller {
    pub fn cancel(&self) {
        self.0.set();
    }
}

/// A submitted request: its id, its event stream and its canceller.
/// Dropping the handle cancels the request (nobody is listening).
#[must_use = "the handle receives the request's tokens; dropping it cancels the request"]
#[derive(Debug)]
pub struct RequestHandle {
    pub(crate) id: RequestId,
    pub(crate) events: Events,
    pub(crate) cancel: Canceller,
    /// The final outcome once [`RequestHandle::try_collect`] has read it:
    /// answered again on every later call, never replaced by a guess from
    /// the closed stream behind it.
    outcome: OnceLock<Outcome>,
}

impl RequestHandle {
    pub(crate) fn new(id: RequestId, events: Events, cancel: Canceller) -> Self {
        RequestHandle {
            id,
            events,
            cancel,
            outcome: OnceLock::new(),
        }
    }

    pub fn id(&self) -> RequestId {
        self.id
    }
    /// The raw event stream. Reading the final [`Event::Done`] here
    /// consumes it: [`RequestHandle::try_collect`] and
    /// [`RequestHandle::wait`] report only what they read themselves, and
    /// once the stream is closed they can no longer tell how it ended.
    pub fn events(&self) -> &Events {
        &self.events
    }
    /// A canceller to hand to another thread.
    pub fn canceller(&self) -> Canceller {
        self.cancel.clone()
    }
    /// Asks the engine to cancel this request.
    pub fn cancel(&self) {
        self.cancel.cancel()
    }

    /// Drains what has arrived: the tokens not returned before, and the
    /// outcome if it came. Once the outcome has come, every later call
    /// returns it again (with no tokens): polling a finished request never
    /// turns it into a failure.
    pub fn try_collect(&self) -> (Vec<u32>, Option<Outcome>) {
        let mut tokens = Vec::new();
        if let Some(o) = self.outcome.get() {
            return (tokens, Some(o.clone()));
        }
        let outcome = match self.events.drain_into(&mut tokens) {
            Some(Ok(o)) => Some(self.settle(o)),
            Some(Err(_)) => Some(self.settle(Outcome::Failed(EngineError::Shutdown))),
            None => None,
        };
        (tokens, outcome)
    }

    /// Blocks until the outcome arrives (the engine must be stepping on
    /// another thread) and returns the tokens not returned before and the
    /// outcome (the one [`RequestHandle::try_collect`] already saw, if it
    /// did). It has no timeout: called on the thread that steps the engine
    /// before the request has ended, it never returns; see
    /// [`RequestHandle::wait_timeout`].
    pub fn wait(self) -> (Vec<u32>, Outcome) {
        // Without a deadline the wait ends only with an outcome.
        let (tokens, outcome) = self.wait_timeout(Duration::MAX);
        (
            tokens,
            outcome.unwrap_or(Outcome::Failed(EngineError::Shutdown)),
        )
    }

    /// Like [`RequestHandle::wait`], but gives up after `timeout`: the
    /// tokens that arrived, and the outcome if it came in time (`None`: the
    /// request is still live; call again, or cancel it). A host serving
    /// clients should prefer this to [`RequestHandle::wait`], which blocks
    /// for as long as the engine is not stepped.
    pub fn wait_timeout(&self, timeout: Duration) -> (Vec<u32>, Option<Outcome>) {
        let mut tokens = Vec::new();
        if let Some(o) = self.outcome.get() {
            return (tokens, Some(o.clone()));
        }
        // A timeout too large for the clock waits without a deadline.
        let deadline = Instant::now().checked_add(timeout);
        loop {
            let ev = match deadline {
                Some(d) => self.events.recv_deadline(d),
                None => self
                    .events
                    .recv()
                    .map_err(|_| RecvTimeoutError::Disconnected),
            };
            match ev {
                Ok(Event::Token(t)) => tokens.push(t),
                // Read from the events by a client that wants them.
                Ok(Event::Logprobs(_)) => {}
                Ok(Event::Done(o)) => return (tokens, Some(self.settle(o))),
                Err(RecvTimeoutError::Timeout) => return (tokens, None),
                Err(RecvTimeoutError::Disconnected) => {
                    let o = self.settle(Outcome::Failed(EngineError::Shutdown));
                    return (tokens, Some(o));
                }
            }
        }
    }

    /// Records the outcome this handle read; the first one stands.
    fn settle(&self, o: Outcome) -> Outcome {
        self.outcome.get_or_init(|| o).clone()
    }
}

impl Drop for RequestHandle {
    fn drop(&mut self) {
        // Nobody will read the stream: stop spending pages on it. Harmless
        // once the request has finished.
        self.cancel.cancel();
    }
}
