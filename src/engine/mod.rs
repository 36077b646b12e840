//! The colocated engine: one model, one KV pool, one scheduler, stepped by
//! its owner.
//!
//! Each [`Engine::step`]:
//! 1. applies cancellations (pages released at once: nothing is in flight
//!    between steps);
//! 2. asks the scheduler for a plan ([`Scheduler::plan_step`]): preempt the
//!    newest sequences if the running ones cannot all grow, else admit
//!    waiting requests whose pages fit;
//! 3. prefills the admitted requests in one batched pass (a preempted
//!    request recomputes its prompt plus what it had generated) and samples
//!    their first token;
//! 4. decodes one token for every other running sequence in one batched
//!    pass.
//!
//! Tokens stream to each request's [`RequestHandle`], ending in one
//! [`Outcome`]. A failure inside a batched pass fails the request at fault;
//! the others in that pass are preempted and recomputed, never served from
//! KV the failed pass half-wrote.

mod error;
pub(crate) mod setup;
mod stream;
#[cfg(test)]
mod tests;

use std::collections::HashMap;

use crossbeam_channel::Sender;

pub use error::EngineError;
pub use stream::{Canceller, Event, FinishReason, Outcome, RequestHandle};

use crate::backend::{Backend, CpuBackend};
use crate::config::{EngineConfig, Role};
use crate::ids::RequestId;
use crate::kv::{Filling, KvPool, KvSeq, PoolStats, Ready, ScrubPolicy};
use crate::model::{ForwardError, Model, Scratch};
use crate::request::Request;
use crate::sampling::Sampler;
use crate::sched::{AdmissionLimits, BatchLimits, Rejection, RunningSeq, Scheduler, StartCost};

/// Engine settings beyond the [`EngineConfig`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineOptions {
    pub limits: BatchLimits,
    pub scrub: ScrubPolicy,
}

/// What one step did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepReport {
    /// Requests prefilled this step.
    pub prefilled: usize,
    /// Prompt (and recomputed) tokens prefilled.
    pub prefill_tokens: usize,
    /// Sequences that decoded one token.
    pub decoded: usize,
    pub preempted: usize,
    pub finished: usize,
    pub cancelled: usize,
    pub failed: usize,
}

impl StepReport {
    /// True when the step computed or changed anything.
    pub fn progressed(&self) -> bool {
        *self != StepReport::default()
    }
}

/// A request known to the engine (waiting or running).
struct Live {
    generated: Vec<u32>,
    max_new: usize,
    sampler: Sampler,
    tx: Sender<Event>,
    cancel: Canceller,
}

/// A request with KV pages.
struct Running {
    req: Request,
    seq: KvSeq<Ready>,
    /// The token to feed at the next decode step.
    next: u32,
}

/// A colocated inference engine. See the module documentation.
pub struct Engine<B: Backend = CpuBackend> {
    model: Model<B>,
    pool: KvPool,
    sched: Scheduler,
    limits: BatchLimits,
    scratch: Scratch<B>,
    live: HashMap<RequestId, Live>,
    /// In admission order, oldest first.
    running: Vec<Running>,
    tokens: Vec<u32>,
}

impl<B: Backend> std::fmt::Debug for Engine<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("model", &self.model)
            .field("pool", &self.pool)
            .field("waiting", &self.sched.waiting())
            .field("running", &self.running.len())
            .finish()
    }
}

impl<B: Backend> Engine<B> {
    /// An engine with default options.
    pub fn new(model: Model<B>, cfg: EngineConfig) -> Result<Self, EngineError> {
        Self::with_options(model, cfg, EngineOptions::default())
    }

    /// An engine serving `model` under `cfg`, which must be a `Colocated`
    /// configuration whose KV geometry is the model's.
    pub fn with_options(
        model: Model<B>,
        cfg: EngineConfig,
        opts: EngineOptions,
    ) -> Result<Self, EngineError> {
        setup::check(&model, &cfg, Role::Colocated)?;
        let mc = model.config();
        if opts.limits.max_running == 0 || opts.limits.max_prefill_tokens == 0 {
            return Err(EngineError::Limits);
        }
        let pool = KvPool::new(cfg.pool_config().scrub(opts.scrub))?;
        let sched = Scheduler::new(AdmissionLimits::from_config(&cfg).vocab(mc.vocab_size));
        Ok(Engine {
            scratch: model.scratch(),
            model,
            pool,
            sched,
            limits: opts.limits,
            live: HashMap::new(),
            running: Vec::new(),
            tokens: Vec::new(),
        })
    }

    pub fn model(&self) -> &Model<B> {
        &self.model
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
        self.running.len()
    }
    /// True when no request is waiting or running.
    pub fn is_idle(&self) -> bool {
        self.live.is_empty()
    }

    /// Admits `req` or rejects it at once (typed, before any allocation).
    pub fn submit(&mut self, req: Request) -> Result<RequestHandle, Rejection> {
        let id = req.id;
        let max_new = req.max_new_tokens;
        let sampler = Sampler::for_request(&req)?;
        let _ticket = self.sched.submit(req)?;
        let (tx, rx) = crossbeam_channel::unbounded();
        let cancel = Canceller::default();
        self.live.insert(
            id,
            Live {
                generated: Vec::new(),
                max_new,
                sampler,
                tx,
                cancel: cancel.clone(),
            },
        );
        Ok(RequestHandle::new(id, rx, cancel))
    }

    /// Cancels `id` now. Returns false if it is not live.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        if !self.live.contains_key(&id) {
            return false;
        }
        if let Some(i) = self.running.iter().position(|r| r.req.id == id) {
            let r = self.running.remove(i);
            r.seq.release();
        } else {
            let _ = self.sched.remove_waiting(id);
        }
        self.end(id, Outcome::Cancelled);
        true
    }

    /// Steps until no request is live, or until a step makes no progress
    /// (which admission makes impossible; the guard keeps a bug from
    /// becoming a hang). Returns the number of steps.
    pub fn run_until_idle(&mut self) -> usize {
        let mut steps = 0;
        while !self.is_idle() {
            steps += 1;
            if !self.step().progressed() {
                break;
            }
        }
        steps
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
        let running: Vec<RequestId> = self.running.iter().map(|r| r.req.id).collect();
        for r in std::mem::take(&mut self.running) {
            r.seq.release();
        }
        while self.sched.pop_if(|_| true).is_some() {}
        for (id, l) in self.live.drain() {
            // A request that has streamed tokens (running, or preempted and
            // waiting for recompute) failed mid-way; only one that never
            // generated is turned away (a client may retry that elsewhere).
            let outcome = if running.contains(&id) || !l.generated.is_empty() {
                Outcome::Failed(EngineError::Shutdown)
            } else {
                Outcome::Rejected(Rejection::ShuttingDown { id })
            };
            self.sched.finish(id);
            let _ = l.tx.send(Event::Done(outcome));
        }
    }

    /// Runs one step. See the module documentation.
    pub fn step(&mut self) -> StepReport {
        let mut report = StepReport::default();
        self.apply_cancellations(&mut report);

        let page_size = self.pool.page_size();
        let pages_for = |t: usize| t.div_ceil(page_size);
        let running: Vec<RunningSeq> = self
            .running
            .iter()
            .map(|r| RunningSeq {
                id: r.req.id,
                pages_held: r.seq.pages().len(),
                pages_next: pages_for(r.seq.complete_len().unwrap_or(0) + 1),
            })
            .collect();
        let live = &self.live;
        let plan = self.sched.plan_step(
            &running,
            self.pool.stats().free,
            self.limits,
            |r: &Request| {
                let len = r.prompt.len() + live.get(&r.id).map_or(0, |l| l.generated.len());
                StartCost {
                    prefill_tokens: len,
                    pages: pages_for(len + 1),
                }
            },
        );
        for id in plan.preempt {
            self.preempt(id);
            report.preempted += 1;
        }
        let mut i = 0;
        while i < self.running.len() {
            let need = self.running[i].seq.complete_len().unwrap_or(0) + 1;
            if self.running[i].seq.ensure_capacity(need).is_err() {
                // The plan covered this growth; if the pool disagrees,
                // recompute rather than touch anyone else's pages.
                let id = self.running[i].req.id;
                self.preempt(id);
                report.preempted += 1;
            } else {
                i += 1;
            }
        }
        let newly = self.prefill(plan.admit, &mut report);
        self.decode(&mut report);
        self.running.extend(newly);
        report
    }

    fn apply_cancellations(&mut self, report: &mut StepReport) {
        let ids: Vec<RequestId> = self
            .live
            .iter()
            .filter(|(_, l)| l.cancel.is_cancelled())
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            if self.cancel(id) {
                report.cancelled += 1;
            }
        }
    }

    /// Releases a running sequence's pages and requeues its request at the
    /// head of the queue; it will recompute prompt + generated tokens.
    fn preempt(&mut self, id: RequestId) {
        if let Some(i) = self.running.iter().position(|r| r.req.id == id) {
            let r = self.running.remove(i);
            r.seq.release();
            self.sched.requeue_front(r.req);
        }
    }

    /// Sends the final outcome and forgets the request.
    fn end(&mut self, id: RequestId, outcome: Outcome) {
        if let Some(l) = self.live.remove(&id) {
            let _ = l.tx.send(Event::Done(outcome));
        }
        self.sched.finish(id);
    }

    /// Prefills `admit` in one pass; returns the sequences that go on.
    fn prefill(&mut self, admit: Vec<Request>, report: &mut StepReport) -> Vec<Running> {
        if admit.is_empty() {
            return Vec::new();
        }
        let mut reqs = Vec::with_capacity(admit.len());
        let mut inputs: Vec<Vec<u32>> = Vec::with_capacity(admit.len());
        let mut seqs: Vec<KvSeq<Filling>> = Vec::with_capacity(admit.len());
        let mut admitted = admit.into_iter();
        while let Some(req) = admitted.next() {
            let mut input = req.prompt.clone();
            if let Some(l) = self.live.get(&req.id) {
                input.extend_from_slice(&l.generated);
            }
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
        let result = {
            let mut refs: Vec<&mut KvSeq<Filling>> = seqs.iter_mut().collect();
            let prompts: Vec<&[u32]> = inputs.iter().map(Vec::as_slice).collect();
            self.model.prefill(&mut self.scratch, &mut refs, &prompts)
        };
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                drop(seqs);
                self.pass_failed(e, reqs, report);
                return Vec::new();
            }
        };
        report.prefilled += reqs.len();
        report.prefill_tokens += inputs.iter().map(Vec::len).sum::<usize>();
        let mut out = Vec::with_capacity(reqs.len());
        let mut ended = Vec::new();
        for (i, ((req, seq), input)) in reqs.into_iter().zip(seqs).zip(&inputs).enumerate() {
            let id = req.id;
            let Some(live) = self.live.get_mut(&id) else {
                continue;
            };
            match deliver(live, logits.row(i)) {
                Delivery::Continue(next) => match seq.seal(input.len()) {
                    Ok(seq) => out.push(Running { req, seq, next }),
                    Err(e) => ended.push((id, Outcome::Failed(EngineError::Kv(e.error)))),
                },
                Delivery::End(outcome) => ended.push((id, outcome)),
            }
        }
        for (id, outcome) in ended {
            count(report, &outcome);
            self.end(id, outcome);
        }
        out
    }

    /// Decodes one token for every running sequence in one pass.
    fn decode(&mut self, report: &mut StepReport) {
        if self.running.is_empty() {
            return;
        }
        self.tokens.clear();
        self.tokens.extend(self.running.iter().map(|r| r.next));
        let result = {
            let mut refs: Vec<&mut KvSeq<Ready>> =
                self.running.iter_mut().map(|r| &mut r.seq).collect();
            self.model
                .decode(&mut self.scratch, &mut refs, &self.tokens)
        };
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                let failed: Vec<Request> = self
                    .running
                    .drain(..)
                    .map(|r| {
                        r.seq.release();
                        r.req
                    })
                    .collect();
                self.pass_failed(e, failed, report);
                return;
            }
        };
        report.decoded += self.running.len();
        let mut ended = Vec::new();
        for (i, r) in self.running.iter_mut().enumerate() {
            let Some(live) = self.live.get_mut(&r.req.id) else {
                continue;
            };
            match deliver(live, logits.row(i)) {
                Delivery::Continue(next) => r.next = next,
                Delivery::End(outcome) => ended.push((r.req.id, outcome)),
            }
        }
        for (id, outcome) in ended {
            if let Some(i) = self.running.iter().position(|r| r.req.id == id) {
                let r = self.running.remove(i);
                r.seq.release();
            }
            count(report, &outcome);
            self.end(id, outcome);
        }
    }

    /// A batched pass failed; its sequences' pages are already released.
    /// The request at fault fails; the others are recomputed. When no
    /// request is at fault, all of them fail.
    fn pass_failed(&mut self, e: ForwardError, reqs: Vec<Request>, report: &mut StepReport) {
        match e.culprit() {
            Some(c) if c < reqs.len() => {
                for (i, req) in reqs.into_iter().enumerate().rev() {
                    if i == c {
                        report.failed += 1;
                        self.end(req.id, Outcome::Failed(EngineError::Forward(e.clone())));
                    } else {
                        report.preempted += 1;
                        self.sched.requeue_front(req);
                    }
                }
            }
            _ => {
                for req in reqs {
                    report.failed += 1;
                    self.end(req.id, Outcome::Failed(EngineError::Forward(e.clone())));
                }
            }
        }
    }
}

fn count(report: &mut StepReport, outcome: &Outcome) {
    match outcome {
        Outcome::Finished(_) => report.finished += 1,
        Outcome::Cancelled => report.cancelled += 1,
        _ => report.failed += 1,
    }
}

enum Delivery {
    /// Streamed; this token is the next input.
    Continue(u32),
    /// The request ends with this outcome.
    End(Outcome),
}

/// Samples from `logits`, streams the token, and says whether it goes on.
fn deliver(live: &mut Live, logits: &[f32]) -> Delivery {
    let token = match live.sampler.sample(logits) {
        Ok(t) => t,
        Err(e) => return Delivery::End(Outcome::Failed(EngineError::Sampling(e))),
    };
    live.generated.push(token);
    if live.tx.send(Event::Token(token)).is_err() {
        // The client is gone: stop spending pages on it.
        return Delivery::End(Outcome::Cancelled);
    }
    if live.sampler.is_stop(token) {
        Delivery::End(Outcome::Finished(FinishReason::Stop(token)))
    } else if live.generated.len() >= live.max_new {
        Delivery::End(Outcome::Finished(FinishReason::Length))
    } else {
        Delivery::Continue(token)
    }
}

impl<B: Backend> Drop for Engine<B> {
    fn drop(&mut self) {
        self.shutdown();
    }
}
