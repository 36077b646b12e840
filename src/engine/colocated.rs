//! The colocated engine: one model, one KV pool, one scheduler, stepped by
//! its owner, on the shared generation core.

use std::time::Duration;

use crate::backend::{Backend, CpuBackend};
use crate::config::{Colocated, EngineConfig};
use crate::engine::filling::{self, MIN_CHUNK, Prefilling};
use crate::engine::generate::{Delivery, Generator, PassFailed, Started, Steps};
use crate::engine::{EngineError, Outcome, RequestHandle, Tally, setup};
use crate::ids::RequestId;
use crate::kv::{CacheSecret, KvPool, KvSeq, PoolStats, PrefixCache, pages_for, reserve_prompt};
use crate::model::Model;
use crate::request::{Request, SpecConfig};
use crate::sched::{
    AdmissionLimits, BatchLimits, ChunkBudget, Rejection, RunningSeq, Scheduler, StartCost,
};

/// Engine settings beyond the [`EngineConfig`] (the scrub policy is the
/// config's: [`crate::EngineConfigBuilder::scrub`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineOptions {
    pub limits: BatchLimits,
    /// Keep the full prompt pages each request computes in a tenant-scoped
    /// prefix cache, and start later requests of the same tenant from the
    /// pages of their prompt it holds (see [`crate::kv::PrefixCache`]).
    /// On by default; a request opts out with
    /// [`Request::with_prefix_cache`].
    pub prefix_cache: bool,
    /// Share each step's token budget (`limits.max_prefill_tokens`)
    /// between the running decodes (a token each) and chunks of the prompts
    /// being prefilled, oldest first, so a long prompt never stalls the
    /// decodes for its whole prefill. Off: each admitted prompt is computed
    /// whole in the step that admits it. On by default.
    pub chunked_prefill: bool,
    /// Speculative decoding for requests that do not choose
    /// ([`Request::speculative`] is `None`). Off by default.
    pub speculative: Option<SpecConfig>,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            limits: BatchLimits::default(),
            prefix_cache: true,
            chunked_prefill: true,
            speculative: None,
        }
    }
}

/// A colocated inference engine. See the [module documentation](crate::engine).
pub struct Engine<B: Backend = CpuBackend> {
    core: Generator<B>,
    pool: KvPool,
    sched: Scheduler,
    limits: BatchLimits,
    chunked: bool,
    cache: Option<PrefixCache>,
    /// Prompts being prefilled, oldest first.
    filling: Vec<Prefilling>,
}

impl<B: Backend> std::fmt::Debug for Engine<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("model", &self.core.model)
            .field("pool", &self.pool)
            .field("waiting", &self.sched.waiting())
            .field("prefilling", &self.filling.len())
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

    /// [`Engine::new`] with batch limits and prefill options. The prefix
    /// cache's server secret is drawn from the operating system.
    pub fn with_options(
        model: Model<B>,
        cfg: EngineConfig<Colocated>,
        opts: EngineOptions,
    ) -> Result<Self, EngineError> {
        let secret = if opts.prefix_cache {
            Some(CacheSecret::random()?)
        } else {
            None
        };
        Self::build(model, cfg, opts, secret)
    }

    /// [`Engine::with_options`] with the prefix cache's server secret given
    /// (from the host's secret store), so tenant salts are stable across
    /// restarts of the host. Ignored when `opts.prefix_cache` is off.
    pub fn with_cache_secret(
        model: Model<B>,
        cfg: EngineConfig<Colocated>,
        opts: EngineOptions,
        secret: CacheSecret,
    ) -> Result<Self, EngineError> {
        Self::build(model, cfg, opts, opts.prefix_cache.then_some(secret))
    }

    fn build(
        model: Model<B>,
        cfg: EngineConfig<Colocated>,
        opts: EngineOptions,
        secret: Option<CacheSecret>,
    ) -> Result<Self, EngineError> {
        setup::check(&model, &cfg)?;
        if opts.limits.max_running == 0 || opts.limits.max_prefill_tokens == 0 {
            return Err(EngineError::Limits);
        }
        if let Some(spec) = &opts.speculative {
            spec.validate().map_err(EngineError::Speculative)?;
        }
        let pool = model.backend().new_pool(cfg.pool_config())?;
        if !model.backend().accepts_kv(pool.residence()) {
            return Err(EngineError::PoolResidence {
                pool: pool.residence(),
            });
        }
        let sched =
            Scheduler::new(AdmissionLimits::from_config(&cfg).vocab(model.config().vocab_size));
        let cache = secret.map(|s| PrefixCache::new(&pool, model.fingerprint().to_u64(), s));
        let mut core = Generator::new(model);
        core.set_speculative(opts.speculative);
        Ok(Engine {
            core,
            pool,
            sched,
            limits: opts.limits,
            chunked: opts.chunked_prefill,
            cache,
            filling: Vec::new(),
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
    /// Sequences generating (their prompt computed).
    pub fn running(&self) -> usize {
        self.core.running().len()
    }
    /// Prompts being prefilled (pages reserved, part of the prompt still to
    /// compute).
    pub fn prefilling(&self) -> usize {
        self.filling.len()
    }
    /// The prefix cache, when on: its counters (hits, misses, evictions)
    /// and the pool's `cached` pages say what it holds.
    pub fn prefix_cache(&self) -> Option<&PrefixCache> {
        self.cache.as_ref()
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
    /// Every page is released (the prefix cache's too, scrubbed): nothing is
    /// in flight between steps. Dropping the engine does the same.
    pub fn shutdown(&mut self) {
        self.sched.close();
        let running: Vec<RequestId> = self.core.stop_all_running().iter().map(|r| r.id).collect();
        self.filling.clear();
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
        if let Some(cache) = &self.cache {
            cache.evict_idle();
        }
        self.core.take_step();
    }

    /// Runs one step:
    /// 1. applies cancellations (pages released at once: nothing is in flight
    ///    between steps);
    /// 2. asks the scheduler for a plan ([`Scheduler::plan_step`]): preempt
    ///    the newest sequences if the running ones cannot all grow, else
    ///    admit waiting requests whose pages fit (pages the prefix cache
    ///    holds idle count as free: they are evicted on demand);
    /// 3. reserves the admitted requests' pages, leasing the cached pages of
    ///    their prompt, and prefills a chunk of every prompt the step's
    ///    budget reaches in one batched pass (a preempted request recomputes
    ///    its prompt plus what it had generated); a prompt whose last chunk
    ///    ran samples its first token and starts generating;
    /// 4. decodes one token for every other running sequence in one batched
    ///    pass.
    pub fn step(&mut self) -> Tally {
        for (id, was_running) in self.core.stop_cancelled() {
            if !was_running {
                self.drop_queued(id);
            }
            self.end(id, Outcome::Cancelled);
        }
        let page_size = self.pool.page_size();
        let decodes = self.core.running().len();
        let mut running: Vec<RunningSeq> = self
            .core
            .running()
            .iter()
            .map(|r| RunningSeq {
                id: r.req.id,
                pages_held: r.seq.private_pages(),
                pages_next: pages_for(r.seq.complete_len().unwrap_or(0) + 1, page_size)
                    .saturating_sub(r.seq.shared_pages()),
            })
            .collect();
        // Prompts being prefilled reserved all their pages when admitted:
        // they never grow, and are the newest, so preempted first.
        running.extend(self.filling.iter().map(|f| RunningSeq {
            id: f.req.id,
            pages_held: f.seq.private_pages(),
            pages_next: f.seq.private_pages(),
        }));
        let mut limits = self.limits;
        let chunk_cap = limits.max_prefill_tokens;
        if self.chunked {
            // Admit only into what the budget has left after the decodes and
            // the prompts already being prefilled.
            let left = limits.max_prefill_tokens.saturating_sub(
                decodes
                    + self
                        .filling
                        .iter()
                        .map(Prefilling::remaining)
                        .sum::<usize>(),
            );
            if left == 0 && !self.filling.is_empty() {
                limits.max_running = 0;
            }
            limits.max_prefill_tokens = left;
        }
        let core = &self.core;
        let chunked = self.chunked;
        let plan = self.sched.plan_step(
            &running,
            self.pool.stats().available(),
            limits,
            |r: &Request| {
                let len = r.prompt.len() + core.generated(r.id).len();
                StartCost {
                    prefill_tokens: if chunked { len.min(chunk_cap) } else { len },
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
        self.start_filling(plan.admit);
        let newly = self.prefill();
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
            self.drop_queued(id);
        }
        self.end(id, Outcome::Cancelled);
        true
    }

    /// Drops a request that is not running from the prompts being prefilled
    /// (pages released) or the waiting queue.
    fn drop_queued(&mut self, id: RequestId) {
        match filling::position(&self.filling, id) {
            Some(i) => drop(self.filling.remove(i)),
            None => drop(self.sched.remove_waiting(id)),
        }
    }

    /// Releases a running sequence's pages and requeues its request at the
    /// head of the queue; it will recompute prompt + generated tokens.
    fn preempt(&mut self, id: RequestId) {
        let req = match filling::position(&self.filling, id) {
            Some(i) => Some(self.filling.remove(i).req),
            None => self.core.stop_running(id),
        };
        if let Some(req) = req {
            self.core.step_mut().preempted += 1;
            self.sched.requeue_front(req);
        }
    }

    /// Sends the final outcome and forgets the request.
    fn end(&mut self, id: RequestId, outcome: Outcome) {
        self.core.end(id, outcome);
        self.sched.finish(id);
    }

    /// Reserves pages for each admitted request (leasing its tenant's
    /// cached prefix where it has one) and queues its prompt for prefill.
    fn start_filling(&mut self, admit: Vec<Request>) {
        let mut admitted = admit.into_iter();
        while let Some(req) = admitted.next() {
            let mut input = req.prompt.clone();
            input.extend_from_slice(self.core.generated(req.id));
            let cache = self.cache.as_ref().filter(|_| req.prefix_cache);
            match reserve_prompt(
                &self.pool,
                cache,
                req.id,
                req.tenant,
                &input,
                input.len() + 1,
            ) {
                Ok((seq, keys)) => {
                    self.core.step_mut().reused_tokens += seq.reused_tokens() as u64;
                    self.filling.push(Prefilling {
                        req,
                        seq,
                        input,
                        keys,
                    });
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
    }

    /// Prefills this step's chunk of every prompt the budget reaches in one
    /// pass; returns the sequences whose prompt is now complete and whose
    /// first token streamed.
    fn prefill(&mut self) -> Vec<Started> {
        let budget = self.chunked.then_some(ChunkBudget {
            step_tokens: self.limits.max_prefill_tokens,
            min_chunk: MIN_CHUNK,
        });
        let lengths = filling::chunk_lengths(&self.filling, budget, self.core.running().len());
        let (mut go, wait): (Vec<_>, Vec<_>) = std::mem::take(&mut self.filling)
            .into_iter()
            .zip(lengths)
            .partition(|(_, len)| *len > 0);
        self.filling = wait.into_iter().map(|(f, _)| f).collect();
        if go.is_empty() {
            return Vec::new();
        }
        let finals: Vec<Option<RequestId>> = go
            .iter()
            .map(|(f, len)| (*len >= f.remaining()).then_some(f.req.id))
            .collect();
        let result = {
            let (mut seqs, chunks): (Vec<&mut KvSeq<_>>, Vec<&[u32]>) = go
                .iter_mut()
                .map(|(f, len)| {
                    let start = f.done();
                    (&mut f.seq, &f.input[start..start + *len])
                })
                .unzip();
            self.core.prefill(&mut seqs, &chunks, &finals)
        };
        let delivered = match result {
            Ok(d) => d,
            Err(error) => {
                let reqs = go.into_iter().map(|(f, _)| f.req).collect();
                self.pass_failed(PassFailed { error, reqs });
                return Vec::new();
            }
        };
        let mut out = Vec::new();
        let mut ended = Vec::new();
        let mut still = Vec::new();
        for (((mut f, _), last), d) in go.into_iter().zip(&finals).zip(delivered) {
            let id = f.req.id;
            if last.is_none() {
                still.push(f);
                continue;
            }
            match d {
                None => {}
                Some(Delivery::Continue(next)) => {
                    if let (Some(cache), Some(keys)) = (&self.cache, &f.keys) {
                        // Only whole pages of the computed input enter the
                        // cache; a refusal leaves them private, never lost.
                        let _ = cache.publish(&mut f.seq, keys);
                    }
                    match f.seq.seal(f.input.len()) {
                        Ok(seq) => out.push(Started {
                            req: f.req,
                            seq,
                            next,
                        }),
                        Err(e) => ended.push((id, Outcome::Failed(EngineError::Kv(e.error)))),
                    }
                }
                Some(Delivery::End(outcome)) => ended.push((id, outcome)),
            }
        }
        // Prompts partway through stay in front of those that waited: the
        // oldest keeps going first.
        still.append(&mut self.filling);
        self.filling = still;
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
