//! A decode worker running the model: admits requests, receives their
//! verified KV, and generates, streaming tokens to each request's handle
//! exactly like the colocated [`crate::Engine`].

use std::collections::HashMap;
use std::time::Duration;

use crossbeam_channel::Sender;

use crate::backend::{Backend, CpuBackend};
use crate::config::{EngineConfig, Role};
use crate::engine::{Canceller, EngineError, Event, FinishReason, Outcome, RequestHandle};
use crate::ids::RequestId;
use crate::kv::{KvPool, KvSeq, Ready};
use crate::model::{Model, Scratch};
use crate::request::Request;
use crate::sampling::Sampler;
use crate::sched::{AdmissionLimits, Rejection};
use crate::transfer::config::TransferConfig;
use crate::transfer::decode::{DecodeOutcome, DecodeSide};
use crate::transfer::error::{IntegrityError, LinkError, TransferError};
use crate::transfer::link::DecodeLink;

/// Requests by how they ended, so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeTally {
    pub finished: u64,
    pub rejected: u64,
    pub cancelled: u64,
    pub failed: u64,
}

struct Client {
    sampler: Sampler,
    max_new: usize,
    generated: usize,
    tx: Sender<Event>,
    cancel: Canceller,
}

struct Running {
    id: RequestId,
    seq: KvSeq<Ready>,
    next: u32,
}

/// The decode half of a disaggregated deployment. Drive it from one thread
/// with [`DecodeWorker::step`].
pub struct DecodeWorker<L: DecodeLink, B: Backend = CpuBackend> {
    side: DecodeSide<L>,
    model: Model<B>,
    scratch: Scratch<B>,
    clients: HashMap<RequestId, Client>,
    running: Vec<Running>,
    tokens: Vec<u32>,
    tally: DecodeTally,
}

impl<L: DecodeLink, B: Backend> std::fmt::Debug for DecodeWorker<L, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeWorker")
            .field("model", &self.model)
            .field("pool", self.pool())
            .field("waiting", &self.side.waiting())
            .field("transferring", &self.side.in_flight())
            .field("generating", &self.running.len())
            .field("tally", &self.tally)
            .finish()
    }
}

impl<L: DecodeLink, B: Backend> DecodeWorker<L, B> {
    /// A worker for `model` under a `Decode` configuration (whose pool holds
    /// the window), receiving over `link`. Admission requires prompt plus
    /// max new tokens to fit the window; their pages are reserved up front,
    /// so generation never runs out of pages. Every plan names `model`'s
    /// [fingerprint](Model::fingerprint) (set into `transfer`), so a prefill
    /// worker serving other weights refuses it.
    pub fn new(
        link: L,
        model: Model<B>,
        cfg: &EngineConfig,
        transfer: TransferConfig,
    ) -> Result<Self, EngineError> {
        crate::engine::setup::check(&model, cfg, Role::Decode)?;
        let pool = KvPool::new(cfg.pool_config())?;
        Self::with_pool(link, model, cfg, pool, transfer)
    }

    /// [`DecodeWorker::new`] over a pool the host built, to choose its
    /// [`ScrubPolicy`](crate::ScrubPolicy) (or keep a handle for its
    /// stats): `KvPool::new(cfg.pool_config().scrub(policy))`. Any other
    /// pool, one whose pages something holds, or one another worker took is
    /// refused ([`EngineError::PoolMismatch`], [`EngineError::PoolInUse`],
    /// [`EngineError::PoolClaimed`]). The host's own handle is for stats:
    /// reserving pages on it is outside this contract (the worker admits
    /// against the pages it sees free).
    pub fn with_pool(
        link: L,
        model: Model<B>,
        cfg: &EngineConfig,
        pool: KvPool,
        transfer: TransferConfig,
    ) -> Result<Self, EngineError> {
        crate::engine::setup::check(&model, cfg, Role::Decode)?;
        crate::engine::setup::check_pool(cfg, &pool)?;
        let limits = AdmissionLimits::from_config(cfg).vocab(model.config().vocab_size);
        Ok(Self::build(link, model, pool, limits, transfer))
    }

    /// A worker over a `pool` and admission `limits` that no configuration
    /// has validated, to replay a misconfigured deployment in tests
    /// (fault-injection builds only; [`DecodeWorker::new`] refuses such a
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
        crate::engine::setup::check_model(&model, pool.config().geometry(), window)?;
        let limits = limits.vocab(model.config().vocab_size);
        Ok(Self::build(link, model, pool, limits, transfer))
    }

    /// The worker over checked parts; plans name `model`'s fingerprint.
    fn build(
        link: L,
        model: Model<B>,
        pool: KvPool,
        limits: AdmissionLimits,
        transfer: TransferConfig,
    ) -> Self {
        DecodeWorker {
            side: DecodeSide::new(link, pool, limits, transfer.with_model(model.fingerprint())),
            scratch: model.scratch(),
            model,
            clients: HashMap::new(),
            running: Vec::new(),
            tokens: Vec::new(),
            tally: DecodeTally::default(),
        }
    }

    /// The protocol side (counters, landing zone).
    pub fn side(&self) -> &DecodeSide<L> {
        &self.side
    }
    /// The decode pool.
    pub fn pool(&self) -> &KvPool {
        self.side.pool()
    }
    /// How requests have ended so far.
    pub fn tally(&self) -> DecodeTally {
        self.tally
    }
    /// True when no request is waiting, transferring or generating.
    pub fn is_idle(&self) -> bool {
        self.clients.is_empty()
    }

    /// Admits `req` or rejects it at once (typed, before any allocation).
    pub fn submit(&mut self, req: Request) -> Result<RequestHandle, Rejection> {
        let id = req.id;
        let max_new = req.max_new_tokens;
        let sampler = match Sampler::for_request(&req) {
            Ok(s) => s,
            Err(r) => {
                self.tally.rejected += 1;
                return Err(r);
            }
        };
        // The transfer side frees an id once its KV is verified; the id
        // stays taken here until the request ends, so tokens of one request
        // can never reach another's handle.
        if self.clients.contains_key(&id) {
            self.tally.rejected += 1;
            return Err(Rejection::DuplicateId { id });
        }
        if let Err(r) = self.side.submit(req) {
            self.tally.rejected += 1;
            return Err(r);
        }
        let (tx, events) = crossbeam_channel::unbounded();
        let cancel = Canceller::default();
        self.clients.insert(
            id,
            Client {
                sampler,
                max_new,
                generated: 0,
                tx,
                cancel: cancel.clone(),
            },
        );
        Ok(RequestHandle::new(id, events, cancel))
    }

    /// Cancels `id` now: a transfer in flight is fenced before its pages are
    /// released; a generating sequence's pages are released. False if `id`
    /// is not live.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        if !self.clients.contains_key(&id) {
            return false;
        }
        if let Some(i) = self.running.iter().position(|r| r.id == id) {
            self.running.remove(i).seq.release();
        } else {
            let _ = self.side.cancel(id);
        }
        self.end(id, Outcome::Cancelled);
        true
    }

    /// Applies cancellations, lands transfers (waiting up to `wait` when
    /// nothing is generating), and decodes one token for every running
    /// sequence.
    pub fn step(&mut self, wait: Duration) {
        // Clients an injected fault cancelled (fault injection only).
        for id in self.side.requested_cancels() {
            if let Some(c) = self.clients.get(&id) {
                c.cancel.cancel();
            }
        }
        let cancelled: Vec<RequestId> = self
            .clients
            .iter()
            .filter(|(_, c)| c.cancel.is_cancelled())
            .map(|(&id, _)| id)
            .collect();
        for id in cancelled {
            self.cancel(id);
        }
        let wait = if self.running.is_empty() {
            wait
        } else {
            Duration::ZERO
        };
        for o in self.side.poll(wait) {
            self.land(o);
        }
        if self.side.link_error() == Some(&LinkError::Killed) {
            // The worker crashed (an injected kill): what it was generating
            // is lost with it.
            for r in std::mem::take(&mut self.running) {
                r.seq.release();
                let e = EngineError::Transfer(TransferError::Link(LinkError::Killed));
                self.end(r.id, Outcome::Failed(e));
            }
        }
        self.decode();
    }

    /// Steps until every request has ended. Every transfer ends within the
    /// link's receipt timeout, so this returns within about that long; with
    /// unbounded timeouts and a silent peer it waits as asked. See
    /// [`DecodeWorker::run_until_idle_within`] for a bounded wait.
    pub fn run_until_idle(&mut self) {
        while !self.is_idle() {
            self.step(Duration::from_millis(20));
        }
    }

    /// Steps until every request has ended or `limit` has passed; true if
    /// idle. Requests still live stay live (cancel or shut down to end them).
    #[must_use = "false means requests are still live"]
    pub fn run_until_idle_within(&mut self, limit: Duration) -> bool {
        let start = std::time::Instant::now();
        while !self.is_idle() {
            let left = limit.saturating_sub(start.elapsed());
            if left.is_zero() {
                return false;
            }
            self.step(left.min(Duration::from_millis(20)));
        }
        true
    }

    /// Ends every live request and closes the link (the prefill peer sees
    /// a disconnect). As at the colocated [`crate::Engine`]'s shutdown, a
    /// request that has streamed tokens fails ([`EngineError::Shutdown`],
    /// 503), and one still waiting or transferring, which has generated
    /// nothing, is turned away ([`Rejection::ShuttingDown`], 503: retry it on
    /// another worker). Later submissions get `ShuttingDown` too.
    pub fn shutdown(&mut self) {
        // Transfers ended by this shutdown, not by a link that had already
        // failed: their request is turned away, not blamed on the peer.
        let ours = self.side.link_error().is_none();
        for o in self.side.shutdown() {
            match o.result {
                Err(TransferError::Link(_)) if ours => {
                    let id = o.request;
                    self.end(id, Outcome::Rejected(Rejection::ShuttingDown { id }));
                }
                _ => self.land(o),
            }
        }
        for r in std::mem::take(&mut self.running) {
            r.seq.release();
            self.end(r.id, Outcome::Failed(EngineError::Shutdown));
        }
    }

    /// Starts generating from verified KV, or ends the request with the
    /// transfer's error.
    fn land(&mut self, o: DecodeOutcome) {
        let id = o.request;
        let verified = match o.result {
            Ok(v) => v,
            Err(e) => {
                let outcome = match &e {
                    TransferError::Aborted { request, reason }
                    | TransferError::Refused { request, reason } => {
                        match reason.to_rejection(*request) {
                            Some(r) => Outcome::Rejected(r),
                            None => Outcome::Failed(EngineError::Transfer(e)),
                        }
                    }
                    _ => Outcome::Failed(EngineError::Transfer(e)),
                };
                self.end(id, outcome);
                return;
            }
        };
        let (_req, seq, first) = verified.into_parts();
        let vocab = self.model.config().vocab_size;
        let Some(first) = first.filter(|&t| (t as usize) < vocab) else {
            drop(seq);
            let e = IntegrityError::FirstToken {
                request: id,
                token: first,
                vocab,
            };
            self.end(id, Outcome::Failed(EngineError::Transfer(e.into())));
            return;
        };
        let Some(client) = self.clients.get_mut(&id) else {
            return;
        };
        // Prefill drew the first token from this request's stream: advance
        // ours past it (a greedy sampler draws nothing; any other draws
        // exactly once per token), so later tokens match colocated serving.
        let _ = client.sampler.sample(&[0.0]);
        match deliver(client, first) {
            None => self.running.push(Running {
                id,
                seq,
                next: first,
            }),
            Some(outcome) => {
                drop(seq);
                self.end(id, outcome);
            }
        }
    }

    /// One batched decode pass over every running sequence.
    fn decode(&mut self) {
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
                for r in std::mem::take(&mut self.running) {
                    r.seq.release();
                    self.end(r.id, Outcome::Failed(EngineError::Forward(e.clone())));
                }
                return;
            }
        };
        let mut ended = Vec::new();
        for (i, r) in self.running.iter_mut().enumerate() {
            let Some(client) = self.clients.get_mut(&r.id) else {
                continue;
            };
            let outcome = match client.sampler.sample(logits.row(i)) {
                Ok(t) => match deliver(client, t) {
                    None => {
                        r.next = t;
                        continue;
                    }
                    Some(o) => o,
                },
                Err(e) => Outcome::Failed(EngineError::Sampling(e)),
            };
            ended.push((r.id, outcome));
        }
        for (id, outcome) in ended {
            if let Some(i) = self.running.iter().position(|r| r.id == id) {
                self.running.remove(i).seq.release();
            }
            self.end(id, outcome);
        }
    }

    fn end(&mut self, id: RequestId, outcome: Outcome) {
        let Some(c) = self.clients.remove(&id) else {
            return;
        };
        match &outcome {
            Outcome::Finished(_) => self.tally.finished += 1,
            Outcome::Rejected(_) => self.tally.rejected += 1,
            Outcome::Cancelled => self.tally.cancelled += 1,
            Outcome::Failed(_) => self.tally.failed += 1,
        }
        let _ = c.tx.send(Event::Done(outcome));
    }
}

/// Streams `token`; returns the outcome if the request ends with it.
fn deliver(client: &mut Client, token: u32) -> Option<Outcome> {
    client.generated += 1;
    if client.tx.send(Event::Token(token)).is_err() {
        return Some(Outcome::Cancelled);
    }
    if client.sampler.is_stop(token) {
        Some(Outcome::Finished(FinishReason::Stop(token)))
    } else if client.generated >= client.max_new {
        Some(Outcome::Finished(FinishReason::Length))
    } else {
        None
    }
}

impl<L: DecodeLink, B: Backend> Drop for DecodeWorker<L, B> {
    fn drop(&mut self) {
        self.shutdown();
    }
}
