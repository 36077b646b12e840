//! The service thread's answer to one submission: a one-shot slot that a
//! thread can block on ([`Answer::wait`]) and a task can await
//! ([`Answer`] is a future), so an async host submits without a blocking
//! thread. The thread's end ([`Replier`]) fills it once; dropped unfilled
//! (the thread stopped first), it closes it, and the waiting side turns
//! that into [`Rejection::ShuttingDown`].

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use parking_lot::{Condvar, Mutex};

use crate::engine::RequestHandle;
use crate::engine::events::{register, wake};
use crate::ids::RequestId;
use crate::sched::Rejection;

type Admission = Result<RequestHandle, Rejection>;

#[derive(Debug, Default)]
struct Slot {
    answer: Option<Admission>,
    /// The replier is gone (after filling the slot, or without).
    closed: bool,
    /// The task awaiting the answer, woken when it comes.
    waker: Option<Waker>,
}

#[derive(Debug, Default)]
struct Shared {
    slot: Mutex<Slot>,
    filled: Condvar,
}

/// A new slot: the service thread's end and the submitter's.
pub(super) fn answer(id: RequestId) -> (Replier, Answer) {
    let shared = Arc::new(Shared::default());
    (
        Replier {
            shared: shared.clone(),
        },
        Answer { shared, id },
    )
}

/// The service thread's end.
#[derive(Debug)]
pub(super) struct Replier {
    shared: Arc<Shared>,
}

impl Replier {
    /// Answers the submission. A submitter that stopped waiting drops the
    /// slot, and with it the handle, which cancels the request.
    pub(super) fn send(self, answer: Admission) {
        self.shared.slot.lock().answer = Some(answer);
        // Drop closes the slot and wakes the waiter.
    }
}

impl Drop for Replier {
    fn drop(&mut self) {
        let mut s = self.shared.slot.lock();
        s.closed = true;
        let waker = s.waker.take();
        drop(s);
        self.shared.filled.notify_all();
        wake(waker);
    }
}

/// The submitter's end: block with [`Answer::wait`], or await it.
#[must_use = "the answer holds the request's handle; dropping it cancels the request"]
#[derive(Debug)]
pub struct Answer {
    shared: Arc<Shared>,
    id: RequestId,
}

impl Answer {
    /// Blocks until the service thread answers (within one step).
    pub fn wait(self) -> Admission {
        let mut s = self.shared.slot.lock();
        while !s.closed {
            self.shared.filled.wait(&mut s);
        }
        s.answer
            .take()
            .unwrap_or(Err(Rejection::ShuttingDown { id: self.id }))
    }
}

impl Future for Answer {
    type Output = Admission;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Admission> {
        let mut s = self.shared.slot.lock();
        if s.closed {
            let answer = s.answer.take();
            return Poll::Ready(answer.unwrap_or(Err(Rejection::ShuttingDown { id: self.id })));
        }
        register(&mut s.waker, cx);
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;

    #[derive(Default)]
    struct Counter(AtomicUsize);

    impl Wake for Counter {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn is_rejected(a: &Admission, want: fn(&Rejection) -> bool) -> bool {
        matches!(a, Err(r) if want(r))
    }

    #[test]
    fn an_awaited_answer_is_woken_when_the_thread_answers() {
        let (reply, mut answer) = answer(RequestId(4));
        let counter = Arc::new(Counter::default());
        let waker = Waker::from(counter.clone());
        let mut cx = Context::from_waker(&waker);
        assert!(Pin::new(&mut answer).poll(&mut cx).is_pending());
        assert_eq!(counter.0.load(Ordering::SeqCst), 0);
        reply.send(Err(Rejection::DuplicateId { id: RequestId(4) }));
        assert_eq!(counter.0.load(Ordering::SeqCst), 1);
        match Pin::new(&mut answer).poll(&mut cx) {
            Poll::Ready(a) => assert!(is_rejected(&a, |r| matches!(
                r,
                Rejection::DuplicateId { .. }
            ))),
            Poll::Pending => panic!("answered but pending"),
        }
    }

    #[test]
    fn a_submission_the_thread_never_answers_is_shutting_down() {
        let (reply, answer) = answer(RequestId(5));
        std::thread::spawn(move || drop(reply)).join().unwrap();
        assert!(is_rejected(&answer.wait(), |r| matches!(
            r,
            Rejection::ShuttingDown { id: RequestId(5) }
        )));
    }

    #[test]
    fn a_blocked_wait_ends_with_the_answer_from_another_thread() {
        let (reply, answer) = answer(RequestId(6));
        let t = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(20));
            reply.send(Err(Rejection::DuplicateId { id: RequestId(6) }));
        });
        assert!(is_rejected(&answer.wait(), |r| matches!(
            r,
            Rejection::DuplicateId { .. }
        )));
        t.join().unwrap();
    }
}
