//! Admission and queueing. The scheduler does no IO and knows no backend: it
//! decides, the engine carries out.

mod admission;
mod batch;
mod chunk;
mod rejection;

pub use admission::{AdmissionLimits, sampler_for};
pub use batch::{BatchLimits, RunningSeq, StartCost, StepPlan};
pub use chunk::{Chunk, ChunkBudget, PartialPrefill, plan_chunks};
pub use rejection::Rejection;

use std::collections::{BTreeMap, HashSet, VecDeque};

use crate::ids::RequestId;
use crate::request::{Priority, Request};

/// Proof that a request passed admission and is queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a ticket identifies the queued request; keep it to cancel or track it"]
pub struct Ticket {
    id: RequestId,
}

impl Ticket {
    pub fn id(&self) -> RequestId {
        self.id
    }
}

/// Admission control plus a priority queue (FIFO within a priority).
///
/// [`Scheduler::submit`] answers at once with a [`Ticket`] or a typed
/// [`Rejection`]; nothing is allocated either way. A request that fits the
/// configuration but not the pages free right now waits; it is never
/// rejected for that, and never truncated.
#[derive(Debug)]
pub struct Scheduler {
    limits: AdmissionLimits,
    waiting: BTreeMap<std::cmp::Reverse<Priority>, VecDeque<Request>>,
    /// Ids queued or running (until [`Scheduler::finish`]).
    live: HashSet<RequestId>,
    /// Ids waiting in `waiting` (their count is the queue's length).
    queued_ids: HashSet<RequestId>,
    closed: bool,
}

impl Scheduler {
    /// A scheduler admitting against `limits`.
    pub fn new(limits: AdmissionLimits) -> Self {
        Scheduler {
            limits,
            waiting: BTreeMap::new(),
            live: HashSet::new(),
            queued_ids: HashSet::new(),
            closed: false,
        }
    }

    /// The admission limits.
    pub fn limits(&self) -> &AdmissionLimits {
        &self.limits
    }

    /// Admits or rejects `req` at once.
    pub fn submit(&mut self, req: Request) -> Result<Ticket, Rejection> {
        let id = req.id;
        if self.closed {
            return Err(Rejection::ShuttingDown { id });
        }
        self.limits.check(&req)?;
        if self.live.contains(&id) {
            return Err(Rejection::DuplicateId { id });
        }
        if self.queued_ids.len() >= self.limits.queue_limit() {
            return Err(Rejection::QueueFull {
                id,
                limit: self.limits.queue_limit(),
            });
        }
        self.live.insert(id);
        self.queued_ids.insert(id);
        self.waiting
            .entry(std::cmp::Reverse(req.priority))
            .or_default()
            .push_back(req);
        Ok(Ticket { id })
    }

    /// The next waiting request in priority-then-FIFO order, without
    /// removing it.
    pub fn peek(&self) -> Option<&Request> {
        self.waiting.values().find_map(|q| q.front())
    }

    /// Removes and returns the head of the queue if `fits(head)` says it can
    /// start now. Strict order: a head that does not fit blocks those behind
    /// it, so a large request is not starved by a stream of small ones.
    pub fn pop_if(&mut self, fits: impl FnOnce(&Request) -> bool) -> Option<Request> {
        let (&key, q) = self.waiting.iter_mut().find(|(_, q)| !q.is_empty())?;
        if !fits(q.front()?) {
            return None;
        }
        let req = q.pop_front()?;
        if q.is_empty() {
            self.waiting.remove(&key);
        }
        self.queued_ids.remove(&req.id);
        Some(req)
    }

    /// Puts a request this scheduler handed out (by [`Scheduler::pop_if`]
    /// or [`Scheduler::plan_step`]) back at the front of its priority, once
    /// the host has preempted it and released its pages; it is recomputed
    /// from its prompt when it starts again.
    ///
    /// Nothing enters the queue past admission: a request that was not
    /// handed out (unknown, finished, or still waiting) is refused with
    /// [`Rejection::NotHandedOut`], and admission's checks run again (the
    /// host owns the request and may have changed it). On a refusal the
    /// request stays live: end it with [`Scheduler::finish`].
    pub fn requeue_preempted(&mut self, req: Request) -> Result<(), Rejection> {
        let id = req.id;
        if !self.live.contains(&id) || self.queued_ids.contains(&id) {
            return Err(Rejection::NotHandedOut { id });
        }
        self.limits.check(&req)?;
        self.requeue_front(req);
        Ok(())
    }

    /// [`Scheduler::requeue_preempted`] without its checks, for the engine,
    /// which requeues only requests it took from this scheduler unchanged.
    pub(crate) fn requeue_front(&mut self, req: Request) {
        self.queued_ids.insert(req.id);
        self.waiting
            .entry(std::cmp::Reverse(req.priority))
            .or_default()
            .push_front(req);
    }

    /// Removes a waiting request (cancel before it started). Returns it if
    /// it was waiting. The id stays live until [`Scheduler::finish`].
    pub fn remove_waiting(&mut self, id: RequestId) -> Option<Request> {
        let mut found = None;
        for q in self.waiting.values_mut() {
            if let Some(i) = q.iter().position(|r| r.id == id) {
                found = q.remove(i);
                break;
            }
        }
        if found.is_some() {
            self.queued_ids.remove(&id);
            self.waiting.retain(|_, q| !q.is_empty());
        }
        found
    }

    /// Forgets a request that has ended, so its id may be reused; true if
    /// it was live. A request still waiting cannot be finished this way
    /// (take it out with [`Scheduler::remove_waiting`] first): that would
    /// let a second request under its id be queued beside it.
    pub fn finish(&mut self, id: RequestId) -> bool {
        !self.queued_ids.contains(&id) && self.live.remove(&id)
    }

    /// Requests waiting for pages.
    pub fn waiting(&self) -> usize {
        self.queued_ids.len()
    }

    /// Requests admitted and not yet finished (waiting or running).
    pub fn live(&self) -> usize {
        self.live.len()
    }

    /// Refuses every later submission with [`Rejection::ShuttingDown`].
    pub fn close(&mut self) {
        self.closed = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::TenantId;

    fn req(id: u64, len: usize, new: usize) -> Request {
        Request::new(RequestId(id), TenantId(1), vec![1; len], new)
    }

    #[test]
    fn fifo_within_priority_higher_first() {
        let mut s = Scheduler::new(AdmissionLimits::new(64, 16, 16));
        for i in 0..3 {
            let _ = s.submit(req(i, 4, 4)).unwrap();
        }
        let _ = s.submit(req(9, 4, 4).with_priority(Priority(5))).unwrap();
        let order: Vec<u64> = std::iter::from_fn(|| s.pop_if(|_| true).map(|r| r.id.0)).collect();
        assert_eq!(order, vec![9, 0, 1, 2]);
        assert_eq!(s.waiting(), 0);
    }

    #[test]
    fn head_that_does_not_fit_waits_and_is_not_rejected() {
        let mut s = Scheduler::new(AdmissionLimits::new(64, 16, 16));
        let _ = s.submit(req(1, 60, 4)).unwrap();
        assert!(s.pop_if(|r| r.prompt.len() < 10).is_none());
        assert_eq!(s.waiting(), 1);
        assert_eq!(s.pop_if(|_| true).map(|r| r.prompt.len()), Some(60));
    }

    #[test]
    fn a_window_filled_by_the_prompt_advises_a_shorter_prompt() {
        let mut s = Scheduler::new(AdmissionLimits::new(64, 16, 16));
        let full = s.submit(req(1, 64, 1)).unwrap_err();
        assert!(matches!(full, Rejection::ExceedsWindow { .. }));
        let msg = full.to_string();
        assert!(
            msg.contains("shorten the prompt to at most 63 tokens"),
            "{msg}"
        );
        let over = s.submit(req(2, 60, 10)).unwrap_err();
        assert!(
            over.to_string().contains("max_new_tokens to at most 4"),
            "{over}"
        );
    }

    #[test]
    fn a_host_requeues_only_what_it_was_handed() {
        let mut s = Scheduler::new(AdmissionLimits::new(64, 16, 16));
        for i in 1..=3 {
            let _ = s.submit(req(i, 4, 4)).unwrap();
        }
        let first = s.pop_if(|_| true).unwrap();
        // Preempted: back at the head, ahead of those that waited.
        s.requeue_preempted(first.clone()).unwrap();
        assert_eq!(s.waiting(), 3);
        assert_eq!(s.peek().map(|r| r.id), Some(RequestId(1)));
        // Waiting again, so not handed out: a second requeue would queue it twice.
        assert_eq!(
            s.requeue_preempted(first),
            Err(Rejection::NotHandedOut { id: RequestId(1) })
        );
        // Never submitted, or finished: nothing enters past admission.
        assert_eq!(
            s.requeue_preempted(req(9, 4, 4)),
            Err(Rejection::NotHandedOut { id: RequestId(9) })
        );
        let second = s.pop_if(|_| true).unwrap();
        assert!(s.finish(second.id));
        assert!(matches!(
            s.requeue_preempted(second),
            Err(Rejection::NotHandedOut { .. })
        ));
        // Handed out, then changed by the host: admission's checks again.
        let mut third = s.pop_if(|_| true).unwrap();
        third.prompt = vec![1; 100];
        assert!(matches!(
            s.requeue_preempted(third),
            Err(Rejection::PromptTooLong { .. })
        ));
        assert_eq!(s.waiting(), 1, "only request 1 is waiting");
        assert_eq!(s.live(), 2, "1 waiting, 3 handed out and refused");
    }

    #[test]
    fn a_waiting_request_cannot_be_finished_into_a_duplicate() {
        let mut s = Scheduler::new(AdmissionLimits::new(64, 16, 16));
        let _ = s.submit(req(1, 4, 4)).unwrap();
        assert!(!s.finish(RequestId(1)), "still waiting");
        assert!(matches!(
            s.submit(req(1, 4, 4)),
            Err(Rejection::DuplicateId { .. })
        ));
        assert_eq!(s.waiting(), 1);
        let _ = s.remove_waiting(RequestId(1)).unwrap();
        assert!(s.finish(RequestId(1)));
        assert!(s.submit(req(1, 4, 4)).is_ok());
    }

    #[test]
    fn duplicate_ids_are_refused_until_finished() {
        let mut s = Scheduler::new(AdmissionLimits::new(64, 16, 16));
        let _ = s.submit(req(1, 4, 4)).unwrap();
        assert!(matches!(
            s.submit(req(1, 4, 4)),
            Err(Rejection::DuplicateId { .. })
        ));
        let _ = s.pop_if(|_| true);
        s.finish(RequestId(1));
        assert!(s.submit(req(1, 4, 4)).is_ok());
    }

    #[test]
    fn queue_limit_is_429() {
        use crate::HttpStatus;
        let mut s = Scheduler::new(AdmissionLimits::new(64, 16, 16).max_queue(1));
        let _ = s.submit(req(1, 4, 4)).unwrap();
        let r = s.submit(req(2, 4, 4)).unwrap_err();
        assert_eq!(r.http_status(), 429);
    }
}
