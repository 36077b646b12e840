//! What a service thread drives: the colocated [`Engine`] or a
//! [`DecodeWorker`], the two places requests are submitted.

use std::time::Duration;

use crate::backend::Backend;
use crate::engine::{DecodeWorker, Engine, RequestHandle, Tally};
use crate::kv::KvPool;
use crate::request::Request;
use crate::sched::Rejection;
use crate::transfer::DecodeLink;

mod sealed {
    pub trait Sealed {}
}

/// A server a [`Service`](super::Service) thread can own and step: the
/// colocated [`Engine`] and the disaggregated [`DecodeWorker`]. Sealed: the
/// service's guarantees rest on these two's admission and shutdown rules.
pub trait Serve: sealed::Sealed + Send + 'static {
    /// Admits `req` or rejects it at once, allocating nothing.
    fn submit(&mut self, req: Request) -> Result<RequestHandle, Rejection>;
    /// True when no request is live.
    fn is_idle(&self) -> bool;
    /// One step, blocking at most about `wait` when nothing can be
    /// computed. False when it could not progress (nothing to do yet).
    fn step(&mut self, wait: Duration) -> bool;
    /// Ends every live request and refuses later submissions.
    fn shutdown(&mut self);
    /// The KV pool (a shared handle, for stats).
    fn pool(&self) -> &KvPool;
    /// How requests have ended so far, and what every step did.
    fn tally(&self) -> Tally;
    /// Requests admitted and waiting for pages (or for their transfer to
    /// start).
    fn waiting(&self) -> usize;
    /// Whether an idle server still has messages to take now and then
    /// (a decode worker's link: late receipts are read and counted rather
    /// than left to fill its buffers).
    fn polls_when_idle(&self) -> bool;
}

impl<B: Backend + Send + 'static> sealed::Sealed for Engine<B> {}

impl<B: Backend + Send + 'static> Serve for Engine<B> {
    fn submit(&mut self, req: Request) -> Result<RequestHandle, Rejection> {
        Engine::submit(self, req)
    }
    fn is_idle(&self) -> bool {
        Engine::is_idle(self)
    }
    fn step(&mut self, _wait: Duration) -> bool {
        // Nothing in an engine step waits on a peer.
        Engine::step(self).progressed()
    }
    fn shutdown(&mut self) {
        Engine::shutdown(self)
    }
    fn pool(&self) -> &KvPool {
        Engine::pool(self)
    }
    fn tally(&self) -> Tally {
        Engine::tally(self)
    }
    fn waiting(&self) -> usize {
        Engine::waiting(self)
    }
    fn polls_when_idle(&self) -> bool {
        false
    }
}

impl<L, B> sealed::Sealed for DecodeWorker<L, B>
where
    L: DecodeLink + Send + 'static,
    B: Backend + Send + 'static,
{
}

impl<L, B> Serve for DecodeWorker<L, B>
where
    L: DecodeLink + Send + 'static,
    B: Backend + Send + 'static,
{
    fn submit(&mut self, req: Request) -> Result<RequestHandle, Rejection> {
        DecodeWorker::submit(self, req)
    }
    fn is_idle(&self) -> bool {
        DecodeWorker::is_idle(self)
    }
    fn step(&mut self, wait: Duration) -> bool {
        // A decode step waits on the link up to `wait` when nothing is
        // generating: it never spins.
        DecodeWorker::step_within(self, wait);
        true
    }
    fn shutdown(&mut self) {
        DecodeWorker::shutdown(self)
    }
    fn pool(&self) -> &KvPool {
        DecodeWorker::pool(self)
    }
    fn tally(&self) -> Tally {
        DecodeWorker::tally(self)
    }
    fn waiting(&self) -> usize {
        DecodeWorker::side(self).waiting()
    }
    fn polls_when_idle(&self) -> bool {
        true
    }
}
