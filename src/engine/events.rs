//! One request's event stream: the tokens the engine streams, in order,
//! then exactly one [`Event::Done`]. The engine appends under a short lock
//! (no allocation per token once the queue has grown, no message slots);
//! the client reads on its own thread, and blocks only when it asks to.
//!
//! A channel per request cost the host about a third of each decode step
//! (benches/host_step.rs): an 80-byte slot per token and a new block every
//! 31 of them. Here a token is four bytes in a queue the client drains.
//! A request that asked for log-probabilities gets each token's right after
//! it ([`Event::Logprobs`]), from a second queue that stays empty (and
//! costs nothing) for every other request.
//!
//! An async host reads with [`Events::recv_async`] (or [`Events::poll_recv`]
//! inside its own future): the reader's waker waits in the queue, under the
//! same lock, and the engine wakes it with the next event or the stream's
//! end. No runtime is assumed, nothing polls, and no thread waits per
//! stream.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

pub use crossbeam_channel::{RecvError, RecvTimeoutError, TryRecvError};
use parking_lot::{Condvar, Mutex};

use crate::engine::Outcome;
use crate::sampling::TokenLogprobs;

/// One message of a request's stream.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Token(u32),
    /// The log-probabilities of the token just before it, for a request
    /// that asked ([`crate::SamplingParams::logprobs`]).
    Logprobs(TokenLogprobs),
    Done(Outcome),
}

/// What both ends share. The cancel flag sits beside the queue's lock: the
/// engine reads the flag of every live request each step and streams to the
/// queue right after, so both are one cache line.
#[derive(Debug, Default)]
#[repr(C)]
struct Shared {
    /// Set by the client's [`crate::Canceller`] (or its dropped handle).
    cancelled: AtomicBool,
    queue: Mutex<Queue>,
    /// Signalled when a token or the outcome arrives, or the engine's end
    /// goes away.
    arrived: Condvar,
}

#[derive(Debug, Default)]
struct Queue {
    tokens: VecDeque<u32>,
    /// One per token still queued, plus the one owed for the token just
    /// read when `logprobs_next`; empty for a request that did not ask.
    logprobs: VecDeque<TokenLogprobs>,
    /// The last event read was a token whose log-probabilities come next.
    logprobs_next: bool,
    /// The outcome, once sent; read after every token.
    done: Option<Outcome>,
    /// The engine's end was dropped (after the outcome, or without one).
    closed: bool,
    /// The client's end was dropped: nobody reads any more.
    abandoned: bool,
    /// An async reader waiting for the next event (the latest to poll):
    /// taken and woken by whatever makes the stream readable.
    waker: Option<Waker>,
}

impl Queue {
    /// The next event, if one is there.
    fn pop(&mut self) -> Option<Event> {
        if self.logprobs_next {
            self.logprobs_next = false;
            if let Some(lp) = self.logprobs.pop_front() {
                return Some(Event::Logprobs(lp));
            }
        }
        match self.tokens.pop_front() {
            Some(t) => {
                self.logprobs_next = !self.logprobs.is_empty();
                Some(Event::Token(t))
            }
            None => self.done.take().map(Event::Done),
        }
    }
    /// Live with nothing to read (a wait that timed out as an event
    /// arrived reads the event instead).
    fn waiting(&self) -> bool {
        self.tokens.is_empty() && !self.logprobs_next && self.done.is_none() && !self.closed
    }
}

/// Wakes the async reader a send made ready, after the lock is released (a
/// waker may run code of its own).
pub(crate) fn wake(waker: Option<Waker>) {
    if let Some(w) = waker {
        w.wake();
    }
}

/// Leaves `cx`'s waker in `slot` for the next wake, unless the one there
/// already wakes the same task.
pub(crate) fn register(slot: &mut Option<Waker>, cx: &Context<'_>) {
    match slot {
        Some(w) if w.will_wake(cx.waker()) => {}
        slot => *slot = Some(cx.waker().clone()),
    }
}

/// A new stream: the engine's end and the client's.
pub(crate) fn stream() -> (EventSender, Events) {
    let shared = Arc::new(Shared::default());
    (
        EventSender {
            shared: shared.clone(),
        },
        Events { shared },
    )
}

/// The engine's end of a stream.
#[derive(Debug)]
pub(crate) struct EventSender {
    shared: Arc<Shared>,
}

/// The client is gone: nothing sent will be read.
#[derive(Debug)]
pub(crate) struct Abandoned;

/// A request's cancel flag, kept in its stream's shared allocation (see
/// [`crate::Canceller`], which wraps it for clients).
#[derive(Clone, Debug)]
pub(crate) struct CancelFlag(Arc<Shared>);

impl CancelFlag {
    pub(crate) fn set(&self) {
        self.0.cancelled.store(true, Ordering::Release);
    }
}

impl EventSender {
    /// The stream's cancel flag, for the client's canceller.
    pub(crate) fn cancel_flag(&self) -> CancelFlag {
        CancelFlag(self.shared.clone())
    }
    /// True once the client has cancelled (or dropped its handle).
    pub(crate) fn is_cancelled(&self) -> bool {
        self.shared.cancelled.load(Ordering::Acquire)
    }
    /// Appends a token, and its log-probabilities when the request asked
    /// (under the same lock, so a reader sees both or neither); `Err` when
    /// the client has dropped its end.
    pub(crate) fn token(&self, t: u32, logprobs: Option<TokenLogprobs>) -> Result<(), Abandoned> {
        let mut q = self.shared.queue.lock();
        if q.abandoned {
            return Err(Abandoned);
        }
        q.tokens.push_back(t);
        if let Some(lp) = logprobs {
            q.logprobs.push_back(lp);
        }
        let waker = q.waker.take();
        drop(q);
        // Cheap without a waiter (one atomic load).
        self.shared.arrived.notify_one();
        wake(waker);
        Ok(())
    }
    /// Sends the final outcome (the engine sends it once, last).
    pub(crate) fn done(&self, outcome: Outcome) {
        let mut q = self.shared.queue.lock();
        if q.abandoned {
            return;
        }
        q.done = Some(outcome);
        let waker = q.waker.take();
        drop(q);
        self.shared.arrived.notify_one();
        wake(waker);
    }
}

impl Drop for EventSender {
    fn drop(&mut self) {
        let mut q = self.shared.queue.lock();
        q.closed = true;
        let waker = q.waker.take();
        drop(q);
        self.shared.arrived.notify_all();
        wake(waker);
    }
}

/// The client's end of a request's stream (see [`crate::RequestHandle::events`]).
/// Its methods are named as a channel receiver's: `try_recv`, `recv`,
/// `recv_timeout`, `recv_deadline`, `try_iter`, with the same errors.
#[derive(Debug)]
pub struct Events {
    shared: Arc<Shared>,
}

impl Events {
    /// The next event if one has arrived: `Empty` while the request is live
    /// and nothing is waiting, `Disconnected` once the stream has ended and
    /// everything in it was read (or the engine went away without an
    /// outcome).
    pub fn try_recv(&self) -> Result<Event, TryRecvError> {
        let mut q = self.shared.queue.lock();
        match q.pop() {
            Some(ev) => Ok(ev),
            None if q.closed => Err(TryRecvError::Disconnected),
            None => Err(TryRecvError::Empty),
        }
    }

    /// Blocks for the next event; `Err` once the stream has ended and
    /// everything in it was read.
    pub fn recv(&self) -> Result<Event, RecvError> {
        self.recv_until(None).map_err(|_| RecvError)
    }

    /// Like [`Events::recv`], for at most `timeout`.
    pub fn recv_timeout(&self, timeout: Duration) -> Result<Event, RecvTimeoutError> {
        // A timeout too large for the clock waits without a deadline.
        self.recv_until(Instant::now().checked_add(timeout))
    }

    /// Like [`Events::recv`], until `deadline`.
    pub fn recv_deadline(&self, deadline: Instant) -> Result<Event, RecvTimeoutError> {
        self.recv_until(Some(deadline))
    }

    fn recv_until(&self, deadline: Option<Instant>) -> Result<Event, RecvTimeoutError> {
        let mut q = self.shared.queue.lock();
        loop {
            if let Some(ev) = q.pop() {
                return Ok(ev);
            }
            if q.closed {
                return Err(RecvTimeoutError::Disconnected);
            }
            match deadline {
                None => self.shared.arrived.wait(&mut q),
                Some(d) => {
                    if self.shared.arrived.wait_until(&mut q, d).timed_out() && q.waiting() {
                        return Err(RecvTimeoutError::Timeout);
                    }
                }
            }
        }
    }

    /// The next event, as a future: ready with it, or with `Err` once the
    /// stream has ended and everything in it was read. Pending, it leaves
    /// its task's waker with the stream, and the engine wakes it when the
    /// next event (or the end) arrives: no runtime, no polling, no thread.
    /// An event is taken only when the future completes, so dropping a
    /// pending one (a `select!` that went the other way, a cancelled task)
    /// loses nothing. One reader at a time: of two futures pending at once,
    /// only the latest polled is woken.
    pub fn recv_async(&self) -> Recv<'_> {
        Recv { events: self }
    }

    /// The poll behind [`Events::recv_async`], for a host's own futures or
    /// streams: `Ready(Ok(event))`, `Ready(Err(_))` once the stream has
    /// ended and was read to the end, or `Pending` with `cx`'s waker
    /// registered for the next event.
    pub fn poll_recv(&self, cx: &mut Context<'_>) -> Poll<Result<Event, RecvError>> {
        let mut q = self.shared.queue.lock();
        if let Some(ev) = q.pop() {
            return Poll::Ready(Ok(ev));
        }
        if q.closed {
            return Poll::Ready(Err(RecvError));
        }
        register(&mut q.waker, cx);
        Poll::Pending
    }

    /// The events that have arrived, read one at a time as the iterator
    /// advances (as a channel's `try_iter`: an event that arrives while it
    /// is being iterated, the outcome of a cancel made in the loop body
    /// included, is read too); it stops when none is waiting.
    pub fn try_iter(&self) -> impl Iterator<Item = Event> + '_ {
        std::iter::from_fn(|| self.try_recv().ok())
    }

    /// True when no event is waiting to be read.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Events waiting to be read.
    pub fn len(&self) -> usize {
        let q = self.shared.queue.lock();
        q.tokens.len() + q.logprobs.len() + usize::from(q.done.is_some())
    }

    /// Appends what has arrived to `tokens` under one lock (log-probabilities
    /// are read from the events, not here: they are dropped), and says how
    /// the stream stands: `Some(Ok(outcome))` when it ended with one,
    /// `Some(Err(Disconnected))` when it ended without, `None` while live.
    pub(crate) fn drain_into(&self, tokens: &mut Vec<u32>) -> Option<Result<Outcome, RecvError>> {
        let mut q = self.shared.queue.lock();
        tokens.extend(q.tokens.drain(..));
        q.logprobs.clear();
        q.logprobs_next = false;
        match q.done.take() {
            Some(o) => Some(Ok(o)),
            None if q.closed => Some(Err(RecvError)),
            None => None,
        }
    }
}

/// The future of [`Events::recv_async`].
#[must_use = "a future does nothing unless polled"]
#[derive(Debug)]
pub struct Recv<'a> {
    events: &'a Events,
}

impl Future for Recv<'_> {
    type Output = Result<Event, RecvError>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.events.poll_recv(cx)
    }
}

impl Drop for Recv<'_> {
    fn drop(&mut self) {
        // A pending future given up: its task is not to be woken for it.
        // (A later `recv_async` registers again when polled.)
        self.events.shared.queue.lock().waker = None;
    }
}

impl Drop for Events {
    fn drop(&mut self) {
        let mut q = self.shared.queue.lock();
        q.abandoned = true;
        // Nothing will read these: free them now, not when the engine ends
        // the request.
        q.tokens = VecDeque::new();
        q.logprobs = VecDeque::new();
        q.done = None;
        q.waker = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::FinishReason;

    #[test]
    fn tokens_then_the_outcome_then_disconnected() {
        let (tx, rx) = stream();
        tx.token(1, None).unwrap();
        tx.token(2, None).unwrap();
        tx.done(Outcome::Finished(FinishReason::Length));
        drop(tx);
        assert_eq!(rx.len(), 3);
        assert_eq!(rx.try_recv(), Ok(Event::Token(1)));
        assert_eq!(rx.recv(), Ok(Event::Token(2)));
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(1)),
            Ok(Event::Done(Outcome::Finished(FinishReason::Length)))
        );
        assert_eq!(rx.try_recv(), Err(TryRecvError::Disconnected));
        assert_eq!(rx.recv(), Err(RecvError));
    }

    #[test]
    fn each_tokens_logprobs_follow_it_and_drain_drops_them() {
        let lp = |token| TokenLogprobs {
            token,
            logprob: -0.5,
            top: vec![(token, -0.5)],
        };
        let (tx, rx) = stream();
        tx.token(4, Some(lp(4))).unwrap();
        tx.token(5, Some(lp(5))).unwrap();
        assert_eq!(rx.len(), 4);
        assert_eq!(rx.try_recv(), Ok(Event::Token(4)));
        assert_eq!(rx.len(), 3);
        assert_eq!(rx.try_recv(), Ok(Event::Logprobs(lp(4))));
        assert_eq!(rx.try_recv(), Ok(Event::Token(5)));
        // The owed logprobs are waiting: a timed wait returns them.
        assert_eq!(
            rx.recv_timeout(Duration::from_millis(1)),
            Ok(Event::Logprobs(lp(5)))
        );
        assert_eq!(rx.try_recv(), Err(TryRecvError::Empty));
        tx.token(6, Some(lp(6))).unwrap();
        assert_eq!(rx.try_recv(), Ok(Event::Token(6)));
        tx.token(7, Some(lp(7))).unwrap();
        tx.done(Outcome::Finished(FinishReason::Length));
        let mut tokens = Vec::new();
        assert!(matches!(rx.drain_into(&mut tokens), Some(Ok(_))));
        assert_eq!(tokens, [7]);
        assert!(rx.is_empty());
    }

    #[test]
    fn a_cancel_from_any_clone_of_the_flag_reaches_the_engines_end() {
        let (tx, rx) = stream();
        let flag = tx.cancel_flag();
        assert!(!tx.is_cancelled());
        let other = flag.clone();
        std::thread::spawn(move || other.set()).join().unwrap();
        assert!(tx.is_cancelled());
        // Cancelling does not end the stream: the engine sends the outcome.
        assert_eq!(rx.try_recv(), Err(TryRecvError::Empty));
    }

    #[test]
    fn an_empty_live_stream_times_out_and_a_dropped_engine_disconnects() {
        let (tx, rx) = stream();
        assert_eq!(rx.try_recv(), Err(TryRecvError::Empty));
        assert_eq!(
            rx.recv_timeout(Duration::from_millis(5)),
            Err(RecvTimeoutError::Timeout)
        );
        drop(tx);
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(5)),
            Err(RecvTimeoutError::Disconnected)
        );
    }

    #[test]
    fn a_blocked_reader_wakes_for_a_token_from_another_thread() {
        let (tx, rx) = stream();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            tx.token(7, None).unwrap();
            tx
        });
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(10)),
            Ok(Event::Token(7))
        );
        drop(t.join().unwrap());
        assert_eq!(rx.recv(), Err(RecvError));
    }

    #[test]
    fn a_dropped_client_end_refuses_tokens() {
        let (tx, rx) = stream();
        tx.token(1, None).unwrap();
        drop(rx);
        assert!(tx.token(2, None).is_err());
    }

    /// A waker that counts its wakes.
    #[derive(Default)]
    struct Counter(std::sync::atomic::AtomicUsize);

    impl std::task::Wake for Counter {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    impl Counter {
        fn wakes(&self) -> usize {
            self.0.load(Ordering::SeqCst)
        }
    }

    /// Polls `fut` once with `waker`.
    fn poll_once<F: Future + Unpin>(fut: &mut F, waker: &Waker) -> Poll<F::Output> {
        Pin::new(fut).poll(&mut Context::from_waker(waker))
    }

    #[test]
    fn a_pending_async_receive_is_woken_by_the_next_token() {
        let (tx, rx) = stream();
        let counter = Arc::new(Counter::default());
        let waker = Waker::from(counter.clone());
        let mut fut = rx.recv_async();
        assert_eq!(poll_once(&mut fut, &waker), Poll::Pending);
        // Polled again with the same waker: still one registration.
        assert_eq!(poll_once(&mut fut, &waker), Poll::Pending);
        assert_eq!(counter.wakes(), 0);
        tx.token(3, None).unwrap();
        assert_eq!(counter.wakes(), 1);
        assert_eq!(
            poll_once(&mut fut, &waker),
            Poll::Ready(Ok(Event::Token(3)))
        );
        // A token nobody waits for wakes nobody.
        tx.token(4, None).unwrap();
        assert_eq!(counter.wakes(), 1);
        assert_eq!(
            poll_once(&mut rx.recv_async(), &waker),
            Poll::Ready(Ok(Event::Token(4)))
        );
    }

    #[test]
    fn a_pending_async_receive_is_woken_by_the_outcome_and_by_the_end() {
        let (tx, rx) = stream();
        let counter = Arc::new(Counter::default());
        let waker = Waker::from(counter.clone());
        let mut fut = rx.recv_async();
        assert!(poll_once(&mut fut, &waker).is_pending());
        tx.done(Outcome::Cancelled);
        assert_eq!(counter.wakes(), 1);
        assert_eq!(
            poll_once(&mut fut, &waker),
            Poll::Ready(Ok(Event::Done(Outcome::Cancelled)))
        );
        // The engine's end goes away: the next wait ends with an error.
        let mut fut = rx.recv_async();
        assert!(poll_once(&mut fut, &waker).is_pending());
        drop(tx);
        assert_eq!(counter.wakes(), 2);
        assert_eq!(poll_once(&mut fut, &waker), Poll::Ready(Err(RecvError)));
    }

    #[test]
    fn a_dropped_pending_receive_loses_no_event_and_is_not_woken() {
        let (tx, rx) = stream();
        let first = Arc::new(Counter::default());
        let mut fut = rx.recv_async();
        assert!(poll_once(&mut fut, &Waker::from(first.clone())).is_pending());
        drop(fut);
        tx.token(9, None).unwrap();
        tx.done(Outcome::Finished(FinishReason::Length));
        assert_eq!(first.wakes(), 0, "a given-up future's task is not woken");
        let second = Waker::from(Arc::new(Counter::default()));
        assert_eq!(
            poll_once(&mut rx.recv_async(), &second),
            Poll::Ready(Ok(Event::Token(9)))
        );
        assert_eq!(
            poll_once(&mut rx.recv_async(), &second),
            Poll::Ready(Ok(Event::Done(Outcome::Finished(FinishReason::Length))))
        );
    }

    /// Runs `fut` to completion on this thread, parking between polls.
    fn block_on<F: Future>(fut: F) -> F::Output {
        struct Unpark(std::thread::Thread);
        impl std::task::Wake for Unpark {
            fn wake(self: Arc<Self>) {
                self.0.unpark();
            }
        }
        let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
        let mut fut = std::pin::pin!(fut);
        loop {
            if let Poll::Ready(v) = fut.as_mut().poll(&mut Context::from_waker(&waker)) {
                return v;
            }
            std::thread::park();
        }
    }

    #[test]
    fn an_async_reader_gets_every_event_another_thread_sends_in_order() {
        let (tx, rx) = stream();
        let engine = std::thread::spawn(move || {
            for t in 0..2_000 {
                tx.token(t, None).unwrap();
                if t % 97 == 0 {
                    std::thread::yield_now();
                }
            }
            tx.done(Outcome::Finished(FinishReason::Length));
        });
        let read = block_on(async {
            let mut read = Vec::new();
            while let Ok(ev) = rx.recv_async().await {
                read.push(ev);
            }
            read
        });
        engine.join().unwrap();
        assert_eq!(read.len(), 2_001);
        for (i, ev) in read[..2_000].iter().enumerate() {
            assert_eq!(*ev, Event::Token(i as u32));
        }
        assert_eq!(
            read[2_000],
            Event::Done(Outcome::Finished(FinishReason::Length))
        );
    }

    #[test]
    fn try_iter_reads_what_arrives_while_it_iterates() {
        let (tx, rx) = stream();
        for t in 0..5 {
            tx.token(t, None).unwrap();
        }
        let mut evs = Vec::new();
        for ev in rx.try_iter() {
            if ev == Event::Token(4) {
                // As a host that cancels in the loop body sees its outcome.
                tx.done(Outcome::Cancelled);
            }
            evs.push(ev);
        }
        assert_eq!(evs.len(), 6);
        assert_eq!(evs[5], Event::Done(Outcome::Cancelled));
        assert!(rx.is_empty());
    }
}
