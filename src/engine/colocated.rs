//! The colocated engine: one model, one KV pool, one scheduler, stepped by
//! its owner, on the shared generation core.

use std::time::Duration;

use crate::backend::{Backend, CpuBackend};
use crate::config::{Colocated, EngineConfig};
use crate::engine::generate::{Delivery, Generator, PassFailed, Running, Steps};
use crate::engine::{EngineError, Outcome, RequestHandle, Tally, setup};
use crate::ids::RequestId;
use crate::kv::{Filling, KvPool, KvSeq, PoolStats, pages_for};
use crate::model::Model;
use crate::request::Request;
use crate::sched::{AdmissionLimits, BatchLimits, Rejection, RunningSeq, Scheduler, StartCost};

/// Engine settings beyond the [`EngineConfig`] (the scrub policy is the
/// config's: [`crate::EngineConfigBuilder::scrub`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineOptions {
    pub limits: BatchLimits,
}

/// A colocated inference engine. See the [module documentation](crate::engine).
pub struct Engine<B: Backend = CpuBackend> {
    core: Generator<B>,
    pool: KvPool,
    sched: Scheduler,
    limits: BatchLimits,
}

impl<B: Backend> std::fmt::Debug for Engine<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("model", &self.core.model)
            .field("pool", &self.pool)
            .field("waiting", &self.sched.waiting())
            .field("running", &self.core.running().len())
            .finish()
    }
}

impl<B: Backend> Engine<B> {
    /// An engine serving `model` under `cfg` (whose KV geometry must be the
    /// model's), with default options.
    pub fn new(model: Model<B>, cfg: EngineConfig<Colocated>) -> Result<Self, EngineError> {
        Self::with_options(model, cfg, EngineOptions::default())
    }

    /// [`Engine::new`] with batch limits.
    pub fn with_options(
        model: Model<B>,
        cfg: EngineConfig<Colocated>,
        opts: EngineOptions,
    ) -> Result<Self, EngineError> {
        setup::check(&model, &cfg)?;
        if opts.limits.max_running == 0 || opts.limits.max_prefill_tokens == 0 {
            return Err(EngineError::Limits);
        }
        let pool = KvPool::new(cfg.pool_config())?;
        let sched =
            Scheduler::new(AdmissionLimits::from_config(&cfg).vocab(model.config().vocab_size));
        Ok(Engine {
            core: Generator::new(model),
            pool,
            sched,
            limits: opts.limits,
        })
    }

    pub fn model(&self) -> &Model<B> {
        &self.core.model
    }
    /// The KV pool (for accounting and audits).
    pub fn pool(&self) -> &KvPool {
        &self.pool
    }
    pub fn pool_stats(&self) -> PoolStats {
        self.pool.stats()
    }
    /// Requests waiting for pages.
    pub fn waiting(&self) -> usize {
        self.sched.waiting()
    }
    /// Sequences holding pages.
    pub fn running(&self) -> usize {
        self.core.running().len()
    }
    /// True when no request is waiting or running.
    pub fn is_idle(&self) -> bool {
        self.core.is_idle()
    }
    /// How requests have ended so far, and what every step did.
    pub fn tally(&self) -> Tally {
        self.core.tally()
    }

    /// Admits `req` or rejects it at once (typed, before any allocation).
    pub fn submit(&mut self, req: Request) -> Result<RequestHandle, Rejection> {
        let sched = &mut self.sched;
        self.core
            .admit(req, |req| sched.submit(req).map(|_ticket| ()))
    }

    /// Cancels `id` now. Returns false if it is not live.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        let cancelled = self.cancel_now(id);
        self.core.take_step();
        cancelled
    }

    /// Steps until no request is live, or until a step makes no progress
    /// (which admission makes impossible; the guard keeps a bug from
    /// becoming a hang). Returns the number of steps.
    pub fn run_until_idle(&mut self) -> usize {
        crate::engine::generate::run_until_idle(self, None).0
    }

    /// Steps until no request is live or `limit` has passed; true if idle.
    /// Requests still live stay live (cancel or shut down to end them).
    #[must_use = "false means requests are still live"]
    pub fn run_until_idle_within(&mut self, limit: Duration) -> bool {
        crate::engine::generate::run_until_idle(self, Some(limit)).1
    }

    /// Ends every live request and refuses later submissions
    /// ([`Rejection::ShuttingDown`], 503). A request that has streamed
    /// tokens (running, or preempted and waiting for recompute) fails
    /// ([`EngineError::Shutdown`], 503); one that never generated is turned
    /// away ([`Rejection::ShuttingDown`]: a client may retry it elsewhere).
    /// Every page is released: nothing is in flight between steps. Dropping
    /// the engine does the same.
    pub fn shutdown(&mut self) {
        self.sched.close();
        let running: Vec<RequestId> = self.core.stop_all_running().iter().map(|r| r.id).collect();
        while self.sched.pop_if(|_| true).is_some() {}
        let ended = self.core.end_all(|id, generated| {
            if running.contains(&id) || !generated.is_empty() {
                Outcome::Failed(EngineError::Shutdown)
            } else {
                Outcome::Rejected(Rejection::ShuttingDown { id })
            }
        });
        for id in ended {
            self.sched.finish(id);
        }
        self.core.take_step();
    }

    /// Runs one step:
    /// 1. applies cancellations (pages released at once: nothing is in flight
    ///    between steps);
    /// 2. asks the scheduler for a plan ([`Scheduler::plan_step`]): preempt
    ///    the newest sequences if the running ones cannot all grow, else
    ///    admit waiting requests whose pages fit;
    /// 3. prefills the admitted requests in one batched pass (a preempted
    ///    request recomputes its prompt plus what it had generated) and
    ///    samples their first token;
    /// 4. decodes one token for every other running sequence in one batched
    ///    pass.
    pub fn step(&mut self) -> Tally {
        for id in self.core.cancelled() {
            self.cancel_now(id);
        }
        let page_size = self.pool.page_size();
        let running: Vec<RunningSeq> = self
            .core
            .running()
            .iter()
            .map(|r| RunningSeq {
                id: r.req.id,
                pages_held: r.seq.pages().len(),
                pages_next: pages_for(r.seq.complete_len().unwrap_or(0) + 1, page_size),
            })
            .collect();
        let core = &self.core;
        let plan = self.sched.plan_step(
            &running,
            self.pool.stats().free,
            self.limits,
            |r: &Request| {
                let len = r.prompt.len() + core.generated(r.id).len();
                StartCost {
                    prefill_tokens: len,
                    pages: pages_for(len + 1, page_size),
                }
            },
        );
        for id in plan.preempt {
            self.preempt(id);
        }
        // The plan covered this growth; if the pool disagrees, recompute
        // rather than touch anyone else's pages.
        for id in self.core.grow_running() {
            self.preempt(id);
        }
        let newly = self.prefill(plan.admit);
        match self.core.decode() {
            Ok(ended) => {
                for id in ended {
                    self.sched.finish(id);
                }
            }
            Err(failed) => self.pass_failed(failed),
        }
        for r in newly {
            self.core.start(r);
        }
        self.core.take_step()
    }

    /// Cancels `id` within the current step's counts.
    fn cancel_now(&mut self, id: RequestId) -> bool {
        if !self.core.is_live(id) {
            return false;
        }
        if self.core.stop_running(id).is_none() {
            let _ = self.sched.remove_waiting(id);
        }
        self.end(id, Outcome::Cancelled);
        true
    }

    /// Releases a running sequence's pages and requeues its request at the
    /// head of the queue; it will recompute prompt + generated tokens.
    fn preempt(&mut self, id: RequestId) {
        if let Some(req) = self.core.stop_running(id) {
            self.core.step_mut().preempted += 1;
            self.sched.requeue_front(req);
        }
    }

    /// Sends the final outcome and forgets the request.
    fn end(&mut self, id: RequestId, outcome: Outcome) {
        self.core.end(id, outcome);
        self.sched.finish(id);
    }

    /// Prefills `admit` in one pass; returns the sequences that go on.
    fn prefill(&mut self, admit: Vec<Request>) -> Vec<Running> {
        if admit.is_empty() {
            return Vec::new();
        }
        let mut reqs = Vec::with_capacity(admit.len());
        let mut inputs: Vec<Vec<u32>> = Vec::with_capacity(admit.len());
        let mut seqs: Vec<KvSeq<Filling>> = Vec::with_capacity(admit.len());
        let mut admitted = admit.into_iter();
        while let Some(req) = admitted.next() {
            let mut input = req.prompt.clone();
            input.extend_from_slice(self.core.generated(req.id));
            match self.pool.reserve(req.id, input.len() + 1) {
                Ok(seq) => {
                    seqs.push(seq);
                    inputs.push(input);
                    reqs.push(req);
                }
                Err(_) => {
                    // The plan said it fits; the pool says not now: this
                    // request and every one admitted after it wait, back at
                    // the head of the queue in their queue order (requeue
                    // the last first, so this one ends up in front).
                    let unplaced: Vec<Request> =
                        std::iter::once(req).chain(admitted.by_ref()).collect();
                    for req in unplaced.into_iter().rev() {
                        self.sched.requeue_front(req);
                    }
                    break;
                }
            }
        }
        if reqs.is_empty() {
            return Vec::new();
        }
        let ids: Vec<RequestId> = reqs.iter().map(|r| r.id).collect();
        let delivered = match self.core.prefill(&mut seqs, &inputs, &ids) {
            Ok(d) => d,
            Err(error) => {
                drop(seqs);
                self.pass_failed(PassFailed { error, reqs });
                return Vec::new();
            }
        };
        let mut out = Vec::with_capacity(reqs.len());
        let mut ended = Vec::new();
        for (((req, seq), input), d) in reqs.into_iter().zip(seqs).zip(&inputs).zip(delivered) {
            let id = req.id;
            match d {
                None => {}
                Some(Delivery::Continue(next)) => match seq.seal(input.len()) {
                    Ok(seq) => out.push(Running { req, seq, next }),
                    Err(e) => ended.push((id, Outcome::Failed(EngineError::Kv(e.error)))),
                },
                Some(Delivery::End(outcome)) => ended.push((id, outcome)),
            }
        }
        for (id, outcome) in ended {
            self.end(id, outcome);
        }
        out
    }

    /// A batched pass failed; its sequences' pages are already released.
    /// The request at fault fails; the others are recomputed. When no
    /// request is at fault, all of them fail.
    fn pass_failed(&mut self, failed: PassFailed) {
        let PassFailed { error, reqs } = failed;
        let culprit = error.culprit().filter(|&c| c < reqs.len());
        for (i, req) in reqs.into_iter().enumerate().rev() {
            if culprit.is_none_or(|c| c == i) {
                self.end(req.id, Outcome::Failed(EngineError::Forward(error.clone())));
            } else {
                self.core.step_mut().preempted += 1;
                self.sched.requeue_front(req);
            }
        }
    }
}

impl<B: Backend> Steps for Engine<B> {
    fn idle(&self) -> bool {
        self.is_idle()
    }
    fn step_once(&mut self) -> Tally {
        self.step()
    }
    fn stalled(&self, step: &Tally) -> bool {
        // Nothing in an engine step waits on a peer.
        !step.progressed()
    }
}

impl<B: Backend> Drop for Engine<B> {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
#[path = "colocated_tests.rs"]
mod tests;
