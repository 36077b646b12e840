//! Continuous batching: what one engine step runs. Pure planning — the
//! engine owns the pages and carries the plan out.
//!
//! Running sequences come first: each must be able to grow by the token it
//! decodes next. When the free pages cannot cover that growth, the most
//! recently admitted sequences are preempted (their pages released, their
//! requests put back at the head of the queue for recompute) until it can;
//! nobody is ever given pages another sequence holds. Only then are waiting
//! requests admitted, in queue order, while their pages fit what is left and
//! the step's prefill budget allows.

use crate::ids::RequestId;
use crate::request::Request;
use crate::sched::Scheduler;

/// Per-step limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchLimits {
    /// Sequences decoding at once (running plus newly admitted).
    pub max_running: usize,
    /// Prompt tokens prefilled in one step. A single request larger than
    /// this is still admitted, alone.
    pub max_prefill_tokens: usize,
}

impl Default for BatchLimits {
    fn default() -> Self {
        BatchLimits {
            max_running: 256,
            max_prefill_tokens: 4096,
        }
    }
}

/// A running sequence as the planner sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunningSeq {
    pub id: RequestId,
    /// Private pages it holds now (preempting it frees them; pages it
    /// shares from a prefix cache are not counted).
    pub pages_held: usize,
    /// Private pages it needs to run its next decode step.
    pub pages_next: usize,
}

/// What a waiting request needs to start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StartCost {
    /// Tokens its prefill computes.
    pub prefill_tokens: usize,
    /// Pages to reserve for it.
    pub pages: usize,
}

/// The plan of one step.
#[derive(Debug, Default)]
pub struct StepPlan {
    /// Sequences to preempt (release pages, requeue), newest first.
    pub preempt: Vec<RequestId>,
    /// Requests to start (prefill) this step, in queue order.
    pub admit: Vec<Request>,
    /// Pages the running sequences that stay must add this step.
    pub growth_pages: usize,
}

impl Scheduler {
    /// Plans one step. `running` is in admission order (oldest first);
    /// `cost` says what a waiting request needs to start.
    ///
    /// Admitted requests leave the queue; preempted ones are *not* requeued
    /// here: the host requeues each with [`Scheduler::requeue_preempted`] once
    /// it has released its pages. A step that preempts admits nobody, so a
    /// preempted request is not restarted into the same shortage.
    pub fn plan_step(
        &mut self,
        running: &[RunningSeq],
        free_pages: usize,
        limits: BatchLimits,
        mut cost: impl FnMut(&Request) -> StartCost,
    ) -> StepPlan {
        let mut plan = StepPlan::default();
        let extra = |r: &RunningSeq| r.pages_next.saturating_sub(r.pages_held);
        let mut growth: usize = running.iter().map(extra).sum();
        let mut free = free_pages;
        let mut kept = running.len();
        while growth > free && kept > 0 {
            kept -= 1;
            let victim = &running[kept];
            growth -= extra(victim);
            free += victim.pages_held;
            plan.preempt.push(victim.id);
        }
        plan.growth_pages = growth;
        if !plan.preempt.is_empty() || growth > free {
            return plan;
        }
        let mut budget = free - growth;
        let mut tokens = 0usize;
        let mut n = kept;
        while n < limits.max_running {
            let next = self.pop_if(|r| {
                let c = cost(r);
                c.pages <= budget
                    && (tokens == 0 || tokens + c.prefill_tokens <= limits.max_prefill_tokens)
            });
            let Some(req) = next else { break };
            let c = cost(&req);
            budget -= c.pages;
            tokens += c.prefill_tokens;
            n += 1;
            plan.admit.push(req);
        }
        plan
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::TenantId;
    use crate::sched::AdmissionLimits;

    fn sched(reqs: &[(u64, usize)]) -> Scheduler {
        let mut s = Scheduler::new(AdmissionLimits::new(1024, 1024, 1));
        for &(id, len) in reqs {
            let _ = s
                .submit(Request::new(RequestId(id), TenantId(0), vec![1; len], 4))
                .unwrap();
        }
        s
    }

    fn cost(r: &Request) -> StartCost {
        StartCost {
            prefill_tokens: r.prompt.len(),
            pages: r.prompt.len() + 1,
        }
    }

    fn run(id: u64, held: usize, next: usize) -> RunningSeq {
        RunningSeq {
            id: RequestId(id),
            pages_held: held,
            pages_next: next,
        }
    }

    #[test]
    fn growth_first_then_admission_in_queue_order() {
        let mut s = sched(&[(10, 3), (11, 3), (12, 3)]);
        // 10 free; running needs 1 more page; 9 left: two requests of 4 fit.
        let p = s.plan_step(&[run(1, 5, 6)], 10, BatchLimits::default(), cost);
        assert!(p.preempt.is_empty());
        assert_eq!(p.growth_pages, 1);
        let ids: Vec<u64> = p.admit.iter().map(|r| r.id.0).collect();
        assert_eq!(ids, vec![10, 11]);
        assert_eq!(s.waiting(), 1);
    }

    #[test]
    fn shortage_preempts_newest_first_and_admits_nobody() {
        let mut s = sched(&[(10, 1)]);
        let running = [run(1, 4, 5), run(2, 4, 5), run(3, 4, 5)];
        let p = s.plan_step(&running, 1, BatchLimits::default(), cost);
        // Needs 3, has 1: preempting 3 frees 4 and drops its need.
        assert_eq!(p.preempt, vec![RequestId(3)]);
        assert!(p.admit.is_empty());
        assert_eq!(s.waiting(), 1);
    }

    #[test]
    fn prefill_budget_and_batch_size_cap_admission() {
        let mut s = sched(&[(10, 50), (11, 50), (12, 50)]);
        let limits = BatchLimits {
            max_running: 8,
            max_prefill_tokens: 120,
        };
        let p = s.plan_step(&[], 1000, limits, cost);
        assert_eq!(p.admit.len(), 2);
        let mut s = sched(&[(10, 500)]);
        let p = s.plan_step(&[], 1000, limits, cost);
        assert_eq!(p.admit.len(), 1, "an oversized prompt still runs, alone");
        let mut s = sched(&[(10, 1), (11, 1)]);
        let full = BatchLimits {
            max_running: 1,
            max_prefill_tokens: 100,
        };
        assert!(
            s.plan_step(&[run(1, 1, 1)], 100, full, cost)
                .admit
                .is_empty()
        );
    }
}
