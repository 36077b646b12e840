//! What a client holds for a submitted request: a stream of tokens ending
//! in exactly one final [`Outcome`], and a way to cancel.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crossbeam_channel::{Receiver, TryRecvError};

use crate::engine::EngineError;
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

/// One message of a request's stream.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Token(u32),
    Done(Outcome),
}

/// Cancels one request from any thread. The engine releases the request's
/// pages at its next step, when no write to them can be in flight.
#[derive(Clone, Debug, Default)]
pub struct Canceller(pub(crate) Arc<AtomicBool>);

impl Canceller {
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Release);
    }
    pub(crate) fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// A submitted request: its id, its event stream and its canceller.
/// Dropping the handle cancels the request (nobody is listening).
#[must_use = "the handle receives the request's tokens; dropping it cancels the request"]
#[derive(Debug)]
pub struct RequestHandle {
    pub(crate) id: RequestId,
    pub(crate) events: Receiver<Event>,
    pub(crate) cancel: Canceller,
}

impl RequestHandle {
    pub fn id(&self) -> RequestId {
        self.id
    }
    /// The raw event stream.
    pub fn events(&self) -> &Receiver<Event> {
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

    /// Drains what has arrived: tokens so far and the outcome if it came.
    pub fn try_collect(&self) -> (Vec<u32>, Option<Outcome>) {
        let mut tokens = Vec::new();
        loop {
            match self.events.try_recv() {
                Ok(Event::Token(t)) => tokens.push(t),
                Ok(Event::Done(o)) => return (tokens, Some(o)),
                Err(TryRecvError::Empty) => return (tokens, None),
                Err(TryRecvError::Disconnected) => {
                    return (tokens, Some(Outcome::Failed(EngineError::Shutdown)));
                }
            }
        }
    }

    /// Blocks until the outcome arrives (the engine must be stepping on
    /// another thread) and returns every token and the outcome.
    pub fn wait(self) -> (Vec<u32>, Outcome) {
        let mut tokens = Vec::new();
        for ev in self.events.iter() {
            match ev {
                Event::Token(t) => tokens.push(t),
                Event::Done(o) => return (tokens, o),
            }
        }
        (tokens, Outcome::Failed(EngineError::Shutdown))
    }
}

impl Drop for RequestHandle {
    fn drop(&mut self) {
        // Nobody will read the stream: stop spending pages on it. Harmless
        // once the request has finished.
        self.cancel.cancel();
    }
}
