//! The prefill side of a transfer: checks each plan against its own limits,
//! hands out jobs to compute, sends the KV and the receipt, and holds the
//! source pages until decode answers or the transfer is abandoned.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::ids::RequestId;
use crate::kv::{Filling, Held, KvError, KvPool, KvSeq, PrefixCache, PrefixKeys, reserve_prompt};
use crate::sampling::TokenLogprobs;
use crate::sched::AdmissionLimits;
use crate::transfer::config::{TransferConfig, deadline};
use crate::transfer::error::{LinkError, TransferError, Wait};
use crate::transfer::link::PrefillLink;
use crate::transfer::protocol::checksum::{RegionHasher, RegionHashes, region_hash};
use crate::transfer::protocol::{
    Abort, AbortReason, Answer, Nonce, Plan, Receipt, ToDecode, ToPrefill, WriteBatch, WriterRun,
};
use crate::transfer::testing::gate::{PoolHog, Step, WorkerFault, at_release, worker_fault};

/// Messages handled in one receive: bounded work per call.
const DRAIN: usize = 1024;

/// A plan accepted by prefill, with the source pages to compute its KV
/// into. Compute every layer's KV for the rest of the prompt
/// ([`PrefillJob::to_compute`]: all of it, unless the prefix cache held its
/// first pages), then hand it back to [`PrefillSide::complete`] (or
/// [`PrefillSide::fail`]).
#[derive(Debug)]
#[must_use = "a job holds source pages; complete or fail it"]
pub struct PrefillJob {
    plan: Plan,
    seq: KvSeq<Filling>,
    /// The prompt's prefix-cache keys, when the side has a cache.
    keys: Option<PrefixKeys>,
}

impl PrefillJob {
    /// The plan (request, tenant, prompt, destination).
    pub fn plan(&self) -> &Plan {
        &self.plan
    }
    /// The whole prompt.
    pub fn prompt(&self) -> &[u32] {
        &self.plan.prompt
    }
    /// The part of the prompt whose KV is not in the source pages yet: what
    /// the model must compute and append.
    pub fn to_compute(&self) -> &[u32] {
        let done = self.seq.complete_len().unwrap_or(0);
        self.plan.prompt.get(done..).unwrap_or(&[])
    }
    /// The source pages and, at once, the part of the prompt still to
    /// compute ([`PrefillJob::to_compute`]), for a pass that appends a chunk
    /// of it.
    pub fn compute_parts(&mut self) -> (&mut KvSeq<Filling>, &[u32]) {
        let done = self.seq.complete_len().unwrap_or(0);
        (&mut self.seq, self.plan.prompt.get(done..).unwrap_or(&[]))
    }
    /// Prompt tokens whose KV came from the prefix cache.
    pub fn reused_tokens(&self) -> usize {
        self.seq.reused_tokens()
    }
    /// The request.
    pub fn request(&self) -> RequestId {
        self.plan.request
    }
    /// The source pages to write the KV into.
    pub fn seq(&self) -> &KvSeq<Filling> {
        &self.seq
    }
    /// The source pages to write the KV into.
    pub fn seq_mut(&mut self) -> &mut KvSeq<Filling> {
        &mut self.seq
    }
}

/// Counters of a prefill side.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefillStats {
    pub plans: u64,
    /// Plans refused with an abort (no receipt).
    pub aborted: u64,
    /// Receipts sent.
    pub sent: u64,
    pub acked: u64,
    /// Transfers decode failed, timed out or cancelled.
    pub failed_by_decode: u64,
    /// Jobs dropped because decode gave up before they completed.
    pub cancelled_jobs: u64,
    /// Held transfers abandoned after the ack timeout.
    pub ack_timeouts: u64,
    /// Answers for unknown or finished transfers: ignored.
    pub ignored_answers: u64,
    /// Plans received again while being served: ignored.
    pub duplicate_plans: u64,
}

#[derive(Debug)]
struct HeldTransfer {
    request: RequestId,
    seq: Arc<KvSeq<Held>>,
    deadline: Instant,
}

/// The prefill worker's half of the protocol over one link. Drive it from
/// one thread: [`PrefillSide::next_job`], compute, [`PrefillSide::complete`].
pub struct PrefillSide<L: PrefillLink> {
    link: L,
    link_error: Option<LinkError>,
    pool: KvPool,
    limits: AdmissionLimits,
    cfg: TransferConfig,
    pending: VecDeque<Plan>,
    out: HashSet<Nonce>,
    cancelled: HashSet<Nonce>,
    held: HashMap<Nonce, HeldTransfer>,
    stats: PrefillStats,
    /// Pages taken by an injected exhausted-pool fault.
    hog: PoolHog,
    /// An injected fault asks to turn the next plan away.
    reject_next: bool,
    /// The tenant-scoped prefix cache over `pool`, when on.
    cache: Option<PrefixCache>,
}

/// Why sending a job's KV stopped early.
enum SendStop {
    Link(LinkError),
    /// An injected rejection: abort instead of the rest.
    Refuse,
    /// The device holding the source pages failed (its hash pass): the
    /// receipt could not say what was sent.
    Device(KvError),
}

impl<L: PrefillLink> PrefillSide<L> {
    /// A prefill side computing into `pool`, refusing plans beyond `limits`
    /// (context window, vocabulary) or beyond what the pool can ever hold,
    /// and plans for another model than [`TransferConfig::with_model`]'s.
    pub fn new(link: L, pool: KvPool, limits: AdmissionLimits, cfg: TransferConfig) -> Self {
        PrefillSide {
            link,
            link_error: None,
            pool,
            limits,
            cfg,
            pending: VecDeque::new(),
            out: HashSet::new(),
            cancelled: HashSet::new(),
            held: HashMap::new(),
            stats: PrefillStats::default(),
            hog: PoolHog::default(),
            reject_next: false,
            cache: None,
        }
    }

    /// With `Some(cache)`, starts each job from the pages of its prompt
    /// that `cache` holds for the plan's tenant, and publishes each computed
    /// prompt's full pages into it (the receipt still covers every page
    /// sent); `None` turns the cache off for later jobs. The cache must be
    /// over this side's pool: else nothing changes and this returns false.
    pub fn set_prefix_cache(&mut self, cache: Option<PrefixCache>) -> bool {
        if cache
            .as_ref()
            .is_some_and(|c| !c.pool().same_pool(&self.pool))
        {
            return false;
        }
        self.cache = cache;
        true
    }
    /// The prefix cache, when on.
    pub fn prefix_cache(&self) -> Option<&PrefixCache> {
        self.cache.as_ref()
    }
    /// The source pool.
    pub fn pool(&self) -> &KvPool {
        &self.pool
    }
    /// Counters.
    pub fn stats(&self) -> PrefillStats {
        self.stats
    }
    /// Transfers whose source pages are held, waiting for decode's answer.
    pub fn held_transfers(&self) -> usize {
        self.held.len()
    }
    /// The link's in-flight accounting.
    pub fn in_flight(&self) -> crate::transfer::InFlightStats {
        self.link.in_flight()
    }
    /// The error that ended the link, if it has ended.
    pub fn link_error(&self) -> Option<&LinkError> {
        self.link_error.as_ref()
    }

    /// The next accepted plan whose source pages could be reserved, waiting
    /// at most the configured plan timeout ([`Wait::Plan`]). Answers and
    /// refusals are handled meanwhile.
    pub fn next_job(&mut self) -> Result<PrefillJob, TransferError> {
        self.next_job_within(self.cfg.plan_timeout())
    }

    /// [`PrefillSide::next_job`] with an explicit wait.
    pub fn next_job_within(&mut self, timeout: Duration) -> Result<PrefillJob, TransferError> {
        let until = deadline(Instant::now(), timeout);
        loop {
            self.expire();
            if let Some(e) = &self.link_error {
                return Err(TransferError::Link(e.clone()));
            }
            if let Some(job) = self.try_start() {
                return Ok(job);
            }
            let now = Instant::now();
            if now >= until {
                return Err(TransferError::Timeout {
                    request: None,
                    waiting_for: Wait::Plan,
                });
            }
            let wait = self
                .next_deadline()
                .map_or(until, |d| d.min(until))
                .saturating_duration_since(now);
            self.receive(wait);
        }
    }

    /// Handles answers and expiries for up to `timeout` without starting a
    /// job. Returns the link error once the link has ended.
    pub fn poll(&mut self, timeout: Duration) -> Result<(), TransferError> {
        let until = deadline(Instant::now(), timeout);
        loop {
            self.expire();
            if let Some(e) = &self.link_error {
                return Err(TransferError::Link(e.clone()));
            }
            let now = Instant::now();
            if now >= until {
                return Ok(());
            }
            let next = self.next_deadline();
            self.receive(
                next.map_or(until, |d| d.min(until))
                    .saturating_duration_since(now),
            );
        }
    }

    /// Sends a computed job's KV and its receipt; the source pages stay held
    /// until decode answers or the ack timeout abandons the transfer.
    /// `first_token` is the token sampled from the prompt's last logits.
    pub fn complete(
        &mut self,
        job: PrefillJob,
        first_token: Option<u32>,
    ) -> Result<(), TransferError> {
        self.complete_with_logprobs(job, first_token, None)
    }

    /// [`PrefillSide::complete`], the receipt also carrying the first
    /// token's log-probabilities (for a request that asked for them).
    pub fn complete_with_logprobs(
        &mut self,
        job: PrefillJob,
        first_token: Option<u32>,
        first_logprobs: Option<TokenLogprobs>,
    ) -> Result<(), TransferError> {
        let PrefillJob { plan, seq, keys } = job;
        self.out.remove(&plan.nonce);
        if self.cancelled.remove(&plan.nonce) {
            self.stats.cancelled_jobs += 1;
            return Err(TransferError::Cancelled {
                request: plan.request,
            });
        }
        if let Some(e) = &self.link_error {
            return Err(TransferError::Link(e.clone()));
        }
        let mut ready = match seq.seal(plan.tokens as usize) {
            Ok(ready) => ready,
            Err(e) => {
                self.abort(&plan, AbortReason::ComputeFailed);
                return Err(TransferError::Kv(e.error));
            }
        };
        if let (Some(cache), Some(keys)) = (&self.cache, &keys) {
            // The prompt's full pages, complete in every layer, become the
            // tenant's to reuse; a refusal leaves them private.
            let _ = cache.publish(&mut ready, keys);
        }
        let held = ready.hold();
        // Audit the source once: every slot must be this request's own.
        if let Err(e) = audit_source(&self.pool, &held) {
            self.abort(&plan, AbortReason::IsolationViolation);
            return Err(TransferError::Kv(e));
        }
        let held = Arc::new(held);
        let checksums = match self.send_kv(&plan, &held) {
            Ok(c) => c,
            Err(SendStop::Link(e)) => {
                self.link_lost(e.clone());
                return Err(TransferError::Link(e));
            }
            Err(SendStop::Refuse) => return Err(self.refuse(&plan)),
            Err(SendStop::Device(e)) => {
                self.abort(&plan, AbortReason::ComputeFailed);
                return Err(TransferError::Kv(e));
            }
        };
        let n_layers = plan.geometry.n_layers;
        let receipt = Receipt {
            request: plan.request,
            nonce: plan.nonce,
            layer_tokens: vec![plan.tokens; n_layers],
            pages: plan.pages.clone(),
            page_checksums: checksums,
            writers: (0..n_layers as u32)
                .map(|layer| WriterRun {
                    layer,
                    start: 0,
                    len: plan.tokens,
                    writer: plan.request,
                })
                .collect(),
            first_token,
            first_logprobs,
        };
        match self.worker_step(Step::ReceiptSent, plan.request) {
            Some(WorkerFault::Kill) => {
                self.link_lost(LinkError::Killed);
                return Err(TransferError::Link(LinkError::Killed));
            }
            Some(WorkerFault::Reject) => return Err(self.refuse(&plan)),
            _ => {}
        }
        self.held.insert(
            plan.nonce,
            HeldTransfer {
                request: plan.request,
                seq: held,
                deadline: deadline(Instant::now(), self.cfg.ack_timeout()),
            },
        );
        if let Err(e) = self.link.send(ToDecode::Receipt(receipt)) {
            self.link_lost(e.clone());
            return Err(TransferError::Link(e));
        }
        self.stats.sent += 1;
        Ok(())
    }

    /// Gives up on a job whose KV could not be computed: decode gets an
    /// abort, no receipt.
    pub fn fail(&mut self, job: PrefillJob, reason: AbortReason) {
        self.out.remove(&job.plan.nonce);
        if !self.cancelled.remove(&job.plan.nonce) {
            self.abort(&job.plan, reason);
        }
    }

    /// Closes the link and releases everything held.
    pub fn shutdown(&mut self) {
        self.link_lost(LinkError::Disconnected);
    }

    /// Writes every layer's rows in batches, hashing each destination
    /// page's regions as they go; returns the per-page checksums.
    fn send_kv(&mut self, plan: &Plan, src: &Arc<KvSeq<Held>>) -> Result<Vec<u64>, SendStop> {
        let g = plan.geometry;
        let row = g.kv_dim() * g.dtype.size_bytes();
        let tokens = plan.tokens as usize;
        let dest_ps = plan.page_size as usize;
        let batch_tokens = (self.cfg.max_batch_bytes() / (2 * row)).max(1);
        // Whole destination pages per batch when they fit.
        let batch_tokens = if batch_tokens >= dest_ps {
            batch_tokens / dest_ps * dest_ps
        } else {
            batch_tokens
        };
        let mut regions = RegionHashes::new(plan.pages.len(), g.n_layers);
        let mut cursors: Vec<[RegionHasher; 2]> = (0..g.n_layers)
            .map(|_| [RegionHasher::new(), RegionHasher::new()])
            .collect();
        // A source device that hashes where the bytes are hashes every
        // destination region in one pass after the last batch, instead of
        // each batch's rows being read back here to hash.
        let on_device = src.hashes_on_device_for(dest_ps);
        // Group-major, layer-minor: each group of positions is sent for
        // every layer before the next group, so source and destination
        // pages are walked nearly in address order and a group's bytes are
        // still in cache when they are hashed.
        let mut start = 0;
        while start < tokens {
            let n = batch_tokens.min(tokens - start);
            for (layer, cursor) in cursors.iter_mut().enumerate() {
                match self.worker_step(Step::KvWriting, plan.request) {
                    Some(WorkerFault::Kill) => return Err(SendStop::Link(LinkError::Killed)),
                    Some(WorkerFault::Reject) => return Err(SendStop::Refuse),
                    _ => {}
                }
                // Hash first: the hash reads the rows from memory and leaves
                // them in cache for the transport's copy right after.
                for (kv, hasher) in cursor.iter_mut().enumerate() {
                    if !on_device {
                        hash_rows(src, layer, kv, start, n, dest_ps, row, hasher, &mut regions);
                    }
                }
                self.link
                    .write_kv(
                        WriteBatch {
                            request: plan.request,
                            nonce: plan.nonce,
                            layer: layer as u32,
                            start: start as u32,
                            tokens: n as u32,
                        },
                        src,
                    )
                    .map_err(SendStop::Link)?;
            }
            start += n;
        }
        if on_device {
            let per_page = 2 * g.n_layers;
            match src.device_dest_region_xxh3(tokens, dest_ps) {
                Ok(Some(h)) => {
                    for (page, hs) in h.chunks(per_page).enumerate() {
                        for (at, &hash) in hs.iter().enumerate() {
                            regions.set(page, at / 2, at % 2, hash);
                        }
                    }
                    return Ok(regions.finish());
                }
                // The device failed: the request is aborted with its error
                // (decode gets the abort, not a receipt that cannot match).
                Err(e) => return Err(SendStop::Device(e)),
                // Rows that cannot be hashed there are read back as before.
                Ok(None) => {
                    for (layer, cursor) in cursors.iter_mut().enumerate() {
                        for (kv, hasher) in cursor.iter_mut().enumerate() {
                            hash_rows(
                                src,
                                layer,
                                kv,
                                0,
                                tokens,
                                dest_ps,
                                row,
                                hasher,
                                &mut regions,
                            );
                        }
                    }
                }
            }
        }
        if !tokens.is_multiple_of(dest_ps) {
            for (layer, cursor) in cursors.iter().enumerate() {
                for (kv, hasher) in cursor.iter().enumerate() {
                    regions.set(tokens / dest_ps, layer, kv, hasher.digest());
                }
            }
        }
        Ok(regions.finish())
    }

    /// Turns a job away while draining (an injected rejection): decode
    /// gets an abort instead of the rest of the KV or the receipt. Writes
    /// already sent hold their own reference to the source pages.
    fn refuse(&mut self, plan: &Plan) -> TransferError {
        self.abort(plan, AbortReason::ShuttingDown);
        TransferError::Aborted {
            request: plan.request,
            reason: AbortReason::ShuttingDown,
        }
    }

    /// Takes the worker fault injected at `step` for `request`: an
    /// exhausted pool is applied here, a kill or a rejection is returned.
    fn worker_step(&mut self, step: Step, request: RequestId) -> Option<WorkerFault> {
        match worker_fault(&self.cfg, step, request)? {
            WorkerFault::ExhaustPool(hold) => {
                self.hog.exhaust(&self.pool, hold);
                None
            }
            f => Some(f),
        }
    }

    /// The next moment something held comes due (an ack timeout, pages
    /// taken by an injected fault).
    fn next_deadline(&self) -> Option<Instant> {
        self.held
            .values()
            .map(|h| h.deadline)
            .chain(self.hog.next_deadline())
            .min()
    }

    fn abort(&mut self, plan: &Plan, reason: AbortReason) {
        self.stats.aborted += 1;
        let msg = ToDecode::Abort(Abort {
            request: plan.request,
            nonce: plan.nonce,
            reason,
        });
        if let Err(e) = self.link.send(msg) {
            self.link_lost(e);
        }
    }

    /// Starts the first pending plan if the pool has room for it now.
    fn try_start(&mut self) -> Option<PrefillJob> {
        let plan = self.pending.front()?;
        let need = self.pool.pages_for(plan.tokens as usize);
        // Idle cached pages are evicted on demand: they count as free.
        if need > self.pool.stats().available() {
            return None;
        }
        let plan = self.pending.pop_front()?;
        let cache = self.cache.as_ref().filter(|_| plan.prefix_cache);
        let (owner, tenant, tokens) = (plan.request, plan.tenant, plan.tokens as usize);
        match reserve_prompt(&self.pool, cache, owner, tenant, &plan.prompt, tokens) {
            Ok((seq, keys)) => {
                self.out.insert(plan.nonce);
                Some(PrefillJob { plan, seq, keys })
            }
            Err(_) => {
                self.pending.push_front(plan);
                None
            }
        }
    }

    /// Handles the first message that arrives within `wait`, then those
    /// already queued, so a plan and its cancel are seen together; at most
    /// [`DRAIN`] in one call, so a peer that never stops sending cannot
    /// hold the caller.
    fn receive(&mut self, wait: Duration) {
        let mut wait = wait;
        for _ in 0..DRAIN {
            if self.link_error.is_some() {
                return;
            }
            match self.link.recv(wait) {
                Ok(Some(ToPrefill::Plan(plan))) => self.on_plan(plan),
                Ok(Some(ToPrefill::Answer(a))) => self.on_answer(a),
                Ok(None) => return,
                Err(e) => self.link_lost(e),
            }
            wait = Duration::ZERO;
        }
    }

    fn on_plan(&mut self, plan: Plan) {
        self.stats.plans += 1;
        let n = plan.nonce;
        if self.out.contains(&n)
            || self.held.contains_key(&n)
            || self.pending.iter().any(|p| p.nonce == n)
        {
            // A duplicate of a plan being served: the original goes on.
            self.stats.duplicate_plans += 1;
            return;
        }
        if std::mem::take(&mut self.reject_next) {
            self.abort(&plan, AbortReason::ShuttingDown);
            return;
        }
        if self.pending.len() >= self.limits.queue_limit() {
            let pending = self.pending.len() as u64;
            self.abort(&plan, AbortReason::Busy { pending });
            return;
        }
        match self.check(&plan) {
            Ok(()) => self.pending.push_back(plan),
            Err(reason) => self.abort(&plan, reason),
        }
    }

    /// Prefill's own admission: before any allocation.
    fn check(&self, plan: &Plan) -> Result<(), AbortReason> {
        // A plan addressed to another worker is not this worker's to serve
        // (a decode end that mixed up its links, or a replay elsewhere).
        if let (Some(me), Some(to)) = (self.cfg.peer_id(), plan.peer)
            && me != to
        {
            return Err(AbortReason::MalformedPlan);
        }
        if plan.model != self.cfg.model() {
            return Err(AbortReason::ModelMismatch {
                planned: plan.model,
                served: self.cfg.model(),
            });
        }
        let tokens = plan.tokens as usize;
        let page_size = plan.page_size as usize;
        if plan.prompt.len() != tokens
            || plan.geometry != self.pool.config().geometry()
            || page_size == 0
            || !page_size.is_power_of_two()
            || plan.pages.len() != crate::kv::pages_for(tokens, page_size)
        {
            return Err(AbortReason::MalformedPlan);
        }
        if tokens == 0 {
            return Err(AbortReason::EmptyPrompt);
        }
        let pool_tokens = self.pool.capacity() * self.pool.page_size();
        if tokens > pool_tokens {
            return Err(AbortReason::ExceedsPool {
                tokens: tokens as u64,
                pool_tokens: pool_tokens as u64,
            });
        }
        if tokens > self.limits.max_context() {
            return Err(AbortReason::PromptTooLong {
                prompt: tokens as u64,
                max_context: self.limits.max_context() as u64,
            });
        }
        if let Some(vocab) = self.limits.vocab_size()
            && let Some((index, &token)) = plan
                .prompt
                .iter()
                .enumerate()
                .find(|&(_, &t)| t as usize >= vocab)
        {
            return Err(AbortReason::InvalidToken {
                index: index as u64,
                token,
                vocab: vocab as u64,
            });
        }
        Ok(())
    }

    fn on_answer(&mut self, a: Answer) {
        match self.held.get(&a.nonce) {
            Some(h) if h.request == a.request => {
                if let Some(h) = self.held.remove(&a.nonce) {
                    match a.verdict {
                        crate::transfer::protocol::Verdict::Ack => self.stats.acked += 1,
                        crate::transfer::protocol::Verdict::Fail(_) => {
                            self.stats.failed_by_decode += 1
                        }
                    }
                    self.release(h);
                }
            }
            _ if self.out.contains(&a.nonce) => {
                // Decode gave up while the job is computing: drop it on
                // completion, send nothing.
                self.cancelled.insert(a.nonce);
                self.stats.failed_by_decode += 1;
            }
            _ => {
                if let Some(i) = self
                    .pending
                    .iter()
                    .position(|p| p.nonce == a.nonce && p.request == a.request)
                {
                    self.pending.remove(i);
                    self.stats.failed_by_decode += 1;
                } else {
                    self.stats.ignored_answers += 1;
                }
            }
        }
    }

    /// Drops the sender's reference to held source pages. Writes still in
    /// flight keep their own reference; the pages are freed once the last
    /// one is delivered or discarded (drained).
    fn release(&mut self, h: HeldTransfer) {
        let request = h.request;
        if at_release(&self.cfg, request) {
            self.link_lost(LinkError::Disconnected);
        }
        drop(h.seq);
        if self.link_error.is_none() {
            match self.worker_step(Step::Release, request) {
                Some(WorkerFault::Kill) => self.link_lost(LinkError::Killed),
                Some(WorkerFault::Reject) => self.reject_next = true,
                _ => {}
            }
        }
    }

    fn expire(&mut self) {
        self.hog.expire();
        let now = Instant::now();
        let expired: Vec<Nonce> = self
            .held
            .iter()
            .filter(|(_, h)| h.deadline <= now)
            .map(|(&n, _)| n)
            .collect();
        for n in expired {
            if let Some(h) = self.held.remove(&n) {
                self.stats.ack_timeouts += 1;
                self.release(h);
            }
        }
    }

    fn link_lost(&mut self, e: LinkError) {
        if self.link_error.is_none() {
            self.link_error = Some(e);
        }
        // A side whose link has ended serves nothing more: pages taken by
        // an injected exhausted-pool fault go back now.
        self.hog = PoolHog::default();
        self.link.close();
        // Nothing more can be written: the transfers are abandoned, and
        // closing the link drained or discarded what was in flight.
        self.pending.clear();
        self.cancelled.extend(self.out.iter().copied());
        for (_, h) in std::mem::take(&mut self.held) {
            drop(h.seq);
        }
    }
}

impl<L: PrefillLink> Drop for PrefillSide<L> {
    fn drop(&mut self) {
        self.link.close();
    }
}

/// Reads every layer through the audited reader once: a slot not written by
/// the sequence's owner is an isolation violation and nothing is sent.
fn audit_source(pool: &KvPool, seq: &KvSeq<Held>) -> Result<(), crate::kv::KvError> {
    let reader = pool.reader();
    let view = reader.seq(seq)?;
    for layer in 0..pool.config().geometry().n_layers {
        view.layer(layer)?;
    }
    Ok(())
}

/// Feeds K or V rows `[start, start + n)` of `layer` into the running
/// region hash, closing a destination page's region at each page boundary.
#[allow(clippy::too_many_arguments)]
fn hash_rows(
    src: &KvSeq<Held>,
    layer: usize,
    kv: usize,
    start: usize,
    n: usize,
    dest_ps: usize,
    row: usize,
    hasher: &mut RegionHasher,
    regions: &mut RegionHashes,
) {
    let _ = src.read_rows(layer, kv, start, n, |done, mut bytes| {
        let mut pos = start + done;
        while !bytes.is_empty() {
            let room = dest_ps - pos % dest_ps;
            let take = room.min(bytes.len() / row);
            if take == 0 {
                break;
            }
            let (chunk, rest) = bytes.split_at(take * row);
            let whole = pos.is_multiple_of(dest_ps) && take == dest_ps;
            bytes = rest;
            pos += take;
            if whole {
                // The common case: a whole region in one piece, hashed in
                // one shot (twice as fast as streaming).
                regions.set(pos / dest_ps - 1, layer, kv, region_hash(chunk));
            } else {
                hasher.update(chunk);
                if pos.is_multiple_of(dest_ps) {
                    regions.set(pos / dest_ps - 1, layer, kv, hasher.digest());
                    *hasher = RegionHasher::new();
                }
            }
        }
    });
}
