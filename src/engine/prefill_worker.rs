//! A prefill worker running the model: takes plans, prefills them in
//! batches, samples each request's first token, sends KV and receipts.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::backend::{Backend, CpuBackend};
use crate::config::{EngineConfig, Prefill};
use crate::engine::{EngineError, setup};
use crate::kv::{CacheSecret, Filling, KvPool, KvSeq, PrefixCache};
use crate::model::{Model, Scratch};
use crate::sampling::{Draw, Sampler, TokenLogprobs};
use crate::sched::AdmissionLimits;
use crate::transfer::{
    AbortReason, PrefillJob, PrefillLink, PrefillSide, TransferConfig, TransferError, Wait,
};

/// The prefill half of a disaggregated deployment.
pub struct PrefillWorker<L: PrefillLink, B: Backend = CpuBackend> {
    side: PrefillSide<L>,
    model: Model<B>,
    scratch: Scratch<B>,
    max_batch_tokens: usize,
}

impl<L: PrefillLink, B: Backend> std::fmt::Debug for PrefillWorker<L, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefillWorker")
            .field("model", &self.model)
            .field("pool", self.pool())
            .field("held_transfers", &self.side.held_transfers())
            .field("stats", &self.side.stats())
            .field("max_batch_tokens", &self.max_batch_tokens)
            .finish()
    }
}

impl<L: PrefillLink, B: Backend> PrefillWorker<L, B> {
    /// A worker for `model` under a `Prefill` configuration (whose pool
    /// holds twice the window by default), sending over `link`. It computes
    /// KV only for plans naming `model`'s [fingerprint](Model::fingerprint)
    /// (set into `transfer`). Its tenant-scoped prefix cache is on, under a
    /// secret drawn from the operating system
    /// ([`PrefillWorker::with_cache_secret`],
    /// [`PrefillWorker::without_prefix_cache`]).
    pub fn new(
        link: L,
        model: Model<B>,
        cfg: EngineConfig<Prefill>,
        transfer: TransferConfig,
    ) -> Result<Self, EngineError> {
        let pool = setup::new_pool(&model, &cfg)?;
        Self::with_pool(link, model, cfg, pool, transfer)
    }

    /// [`PrefillWorker::new`] over a pool the host built from the same
    /// configuration (to keep a handle for its stats), refused and taken as
    /// [`DecodeWorker::with_pool`](crate::engine::DecodeWorker::with_pool)
    /// refuses and takes one.
    pub fn with_pool(
        link: L,
        model: Model<B>,
        cfg: EngineConfig<Prefill>,
        pool: KvPool,
        transfer: TransferConfig,
    ) -> Result<Self, EngineError> {
        let limits = setup::worker_limits(&model, &cfg, &pool)?;
        let worker = Self::build(link, model, pool, limits, transfer, cfg.max_context());
        Ok(worker.with_cache_secret(CacheSecret::random()?))
    }

    /// Keys the prefix cache under `secret` (from the host's secret store,
    /// so tenant salts are stable across restarts), turning it on.
    #[must_use]
    pub fn with_cache_secret(mut self, secret: CacheSecret) -> Self {
        let cache = PrefixCache::new(self.pool(), self.model.fingerprint().to_u64(), secret);
        self.side.set_prefix_cache(Some(cache));
        self
    }

    /// Turns the prefix cache off: every job computes its whole prompt.
    #[must_use]
    pub fn without_prefix_cache(mut self) -> Self {
        self.side.set_prefix_cache(None);
        self
    }

    /// A worker over a `pool` and admission `limits` that no configuration
    /// has validated, to replay a misconfigured deployment in tests
    /// (fault-injection builds only; [`PrefillWorker::new`] refuses such a
    /// pool). Admission still protects the pool. The model must match the
    /// pool's KV geometry and cover the window of `limits`.
    #[cfg(any(test, feature = "fault-injection"))]
    #[doc(hidden)]
    pub fn with_unvalidated_pool(
        link: L,
        model: Model<B>,
        pool: KvPool,
        limits: AdmissionLimits,
        transfer: TransferConfig,
    ) -> Result<Self, EngineError> {
        let window = limits.max_context();
        setup::check_model(&model, pool.config().geometry(), window)?;
        let limits = limits.vocab(model.config().vocab_size);
        let worker = Self::build(link, model, pool, limits, transfer, window.max(1));
        Ok(worker.with_cache_secret(CacheSecret::random()?))
    }

    /// The worker over checked parts; it computes KV only for plans naming
    /// `model`'s fingerprint.
    fn build(
        link: L,
        model: Model<B>,
        pool: KvPool,
        limits: AdmissionLimits,
        transfer: TransferConfig,
        max_batch_tokens: usize,
    ) -> Self {
        PrefillWorker {
            side: PrefillSide::new(link, pool, limits, transfer.with_model(model.fingerprint())),
            scratch: model.scratch(),
            model,
            max_batch_tokens,
        }
    }

    /// Caps the prompt tokens prefilled in one batched pass (default: the
    /// context window).
    #[must_use]
    pub fn with_max_batch_tokens(mut self, tokens: usize) -> Self {
        self.max_batch_tokens = tokens.max(1);
        self
    }

    /// The protocol side (counters, held transfers).
    pub fn side(&self) -> &PrefillSide<L> {
        &self.side
    }
    /// The prefill pool.
    pub fn pool(&self) -> &KvPool {
        self.side.pool()
    }

    /// Waits up to `wait` for plans, prefills every job available in one
    /// batched pass, and sends each job's KV and receipt. Returns the jobs
    /// handled; a link failure ends the worker with its error.
    pub fn step(&mut self, wait: Duration) -> Result<usize, TransferError> {
        let mut jobs = match self.side.next_job_within(wait) {
            Ok(job) => vec![job],
            Err(TransferError::Timeout {
                waiting_for: Wait::Plan,
                ..
            }) => return Ok(0),
            Err(e) => return Err(e),
        };
        let mut tokens = jobs[0].to_compute().len();
        while tokens < self.max_batch_tokens {
            match self.side.next_job_within(Duration::ZERO) {
                Ok(job) => {
                    tokens += job.to_compute().len();
                    jobs.push(job);
                }
                Err(_) => break,
            }
        }
        let n = jobs.len();
        let firsts = self.compute(&mut jobs);
        for (job, first) in jobs.into_iter().zip(firsts) {
            match first {
                Some((token, lp)) => match self.side.complete_with_logprobs(job, Some(token), lp) {
                    Ok(()) | Err(TransferError::Cancelled { .. }) => {}
                    Err(TransferError::Link(e)) => return Err(TransferError::Link(e)),
                    // Incomplete KV or an isolation violation: the side
                    // has already aborted the transfer with its reason.
                    Err(_) => {}
                },
                None => self.side.fail(job, AbortReason::ComputeFailed),
            }
        }
        Ok(n)
    }

    /// Runs until `stop` is set or the link ends.
    pub fn run(&mut self, stop: &AtomicBool) -> Result<(), TransferError> {
        while !stop.load(Ordering::Acquire) {
            self.step(Duration::from_millis(20))?;
        }
        Ok(())
    }

    /// Closes the link; held source pages are released, and the prefix
    /// cache's idle pages scrubbed and freed (no tenant's KV outlives the
    /// worker's service).
    pub fn shutdown(&mut self) {
        self.side.shutdown();
        if let Some(cache) = self.side.prefix_cache() {
            cache.evict_idle();
        }
    }

    /// Prefills the jobs in passes of at most `max_batch_tokens` prompt
    /// tokens (a prompt longer than that is computed in chunks, appended
    /// after the KV already written, which gives the KV and logits of one
    /// pass); returns each job's first token (and its log-probabilities
    /// where the request asked), or `None` where a pass or sampling failed
    /// (every job in a failed pass fails: its KV may be half-written).
    fn compute(&mut self, jobs: &mut [PrefillJob]) -> Vec<Option<First>> {
        let mut samplers: Vec<Option<Sampler>> = jobs
            .iter()
            .map(|j| Sampler::new(&j.plan().sampling).ok())
            .collect();
        let mut firsts: Vec<Option<First>> = vec![None; jobs.len()];
        let mut failed = vec![false; jobs.len()];
        loop {
            // This pass: a chunk of each job in order, within the budget;
            // what is left of a prompt follows from the KV it holds.
            let mut budget = self.max_batch_tokens;
            let lens: Vec<usize> = jobs
                .iter()
                .zip(&failed)
                .map(|(j, &failed)| {
                    let len = if failed {
                        0
                    } else {
                        j.to_compute().len().min(budget)
                    };
                    budget -= len;
                    len
                })
                .collect();
            let pass: Vec<usize> = (0..jobs.len()).filter(|&i| lens[i] > 0).collect();
            if pass.is_empty() {
                break;
            }
            // A job whose prompt ends in this pass draws its first token;
            // the others' rows take a greedy draw that is discarded.
            let ends: Vec<bool> = pass
                .iter()
                .map(|&i| lens[i] == jobs[i].to_compute().len())
                .collect();
            let draws: Vec<Draw> = pass
                .iter()
                .zip(&ends)
                .map(|(&i, &end)| match (&mut samplers[i], end) {
                    (Some(s), true) => s.next_draw(),
                    _ => Draw::greedy(),
                })
                .collect();
            let (mut refs, chunks): (Vec<&mut KvSeq<Filling>>, Vec<&[u32]>) = jobs
                .iter_mut()
                .zip(&lens)
                .filter(|(_, len)| **len > 0)
                .map(|(j, &len)| {
                    let (seq, rest) = j.compute_parts();
                    (seq, &rest[..len])
                })
                .unzip();
            let sampled = self
                .model
                .prefill_sampled(&mut self.scratch, &mut refs, &chunks, &draws);
            drop(refs);
            match sampled {
                Ok(sampled) => {
                    for (row, ((&i, &end), token)) in
                        pass.iter().zip(&ends).zip(sampled).enumerate()
                    {
                        if end && samplers[i].is_some() {
                            firsts[i] = token
                                .clone()
                                .ok()
                                .map(|t| (t, sampled.logprobs(row).cloned()));
                        }
                    }
                }
                Err(_) => pass.iter().for_each(|&i| failed[i] = true),
            }
        }
        firsts
    }
}

/// A prompt's first token and, where its request asked, its
/// log-probabilities.
type First = (u32, Option<TokenLogprobs>);
