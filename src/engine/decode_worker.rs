//! A decode worker running the model: admits requests, receives their
//! verified KV, and generates on the shared generation core, streaming
//! tokens to each request's handle exactly like the colocated
//! [`crate::Engine`].

use std::time::Duration;

use crate::backend::{Backend, CpuBackend};
use crate::config::{Decode, EngineConfig};
use crate::engine::generate::{Delivery, Generator, PassFailed, Started, Steps};
use crate::engine::{EngineError, Outcome, RequestHandle, Tally, setup};
use crate::ids::RequestId;
use crate::kv::KvPool;
use crate::model::Model;
use crate::request::{Request, SpecConfig};
use crate::sampling::TokenLogprobs;
use crate::sched::{AdmissionLimits, Rejection};
use crate::transfer::{
    DecodeLink, DecodeOutcome, DecodeSide, IntegrityError, LinkError, TransferConfig, TransferError,
};

/// How long an idle decode worker's step waits on its link for a landing
/// unless [`DecodeWorker::with_idle_wait`] says otherwise.
pub const DEFAULT_IDLE_WAIT: Duration = Duration::from_millis(20);

/// The decode half of a disaggregated deployment. Drive it from one thread
/// with [`DecodeWorker::step`].
pub struct DecodeWorker<L: DecodeLink, B: Backend = CpuBackend> {
    side: DecodeSide<L>,
    core: Generator<B>,
    idle_wait: Duration,
}

impl<L: DecodeLink, B: Backend> std::fmt::Debug for DecodeWorker<L, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeWorker")
            .field("model", &self.core.model)
            .field("pool", self.pool())
            .field("waiting", &self.side.waiting())
            .field("transferring", &self.side.in_flight())
            .field("generating", &self.core.running().len())
            .field("tally", &self.core.tally())
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
        cfg: EngineConfig<Decode>,
        transfer: TransferConfig,
    ) -> Result<Self, EngineError> {
        let pool = setup::new_pool(&model, &cfg)?;
        Self::with_pool(link, model, cfg, pool, transfer)
    }

    /// [`DecodeWorker::new`] over a pool the host built from the same
    /// configuration (to keep a handle for its stats):
    /// `KvPool::new(cfg.pool_config())`. Any other
    /// pool, one whose pages something holds, or one another worker took is
    /// refused ([`EngineError::PoolMismatch`], [`EngineError::PoolInUse`],
    /// [`EngineError::PoolClaimed`]). The host's own handle is for stats:
    /// reserving pages on it is outside this contract (the worker admits
    /// against the pages it sees free).
    pub fn with_pool(
        link: L,
        model: Model<B>,
        cfg: EngineConfig<Decode>,
        pool: KvPool,
        transfer: TransferConfig,
    ) -> Result<Self, EngineError> {
        let limits = setup::worker_limits(&model, &cfg, &pool)?;
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
        setup::check_model(&model, pool.config().geometry(), window)?;
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
            core: Generator::new(model),
            idle_wait: DEFAULT_IDLE_WAIT,
        }
    }

    /// How long a step waits on the link for a landing when nothing is
    /// generating (default 20 ms); a step that has
    /// sequences to decode never waits.
    #[must_use]
    pub fn with_idle_wait(mut self, wait: Duration) -> Self {
        self.idle_wait = wait;
        self
    }

    /// Decodes speculatively with `spec` the requests that do not choose
    /// ([`crate::Request::speculative`] is `None`); prefill is unchanged.
    /// Refused, typed, for sizes out of range.
    pub fn with_speculative(mut self, spec: Option<SpecConfig>) -> Result<Self, EngineError> {
        if let Some(s) = &spec {
            s.validate().map_err(EngineError::Speculative)?;
        }
        self.core.set_speculative(spec);
        Ok(self)
    }

    /// The protocol side (counters, landing zone).
    pub fn side(&self) -> &DecodeSide<L> {
        &self.side
    }
    /// The decode pool.
    pub fn pool(&self) -> &KvPool {
        self.side.pool()
    }
    pub fn model(&self) -> &Model<B> {
        &self.core.model
    }
    /// How requests have ended so far, and what every step did.
    pub fn tally(&self) -> Tally {
        self.core.tally()
    }
    /// True when no request is waiting, transferring or generating.
    pub fn is_idle(&self) -> bool {
        self.core.is_idle()
    }

    /// Admits `req` or rejects it at once (typed, before any allocation).
    pub fn submit(&mut self, req: Request) -> Result<RequestHandle, Rejection> {
        // The transfer side frees an id once its KV is verified; the core
        // keeps it taken until the request ends.
        let side = &mut self.side;
        self.core
            .admit(req, |req| side.submit(req).map(|_ticket| ()))
    }

    /// Cancels `id` now: a transfer in flight is fenced before its pages are
    /// released; a generating sequence's pages are released. False if `id`
    /// is not live.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        let cancelled = self.cancel_now(id);
        self.core.take_step();
        cancelled
    }

    /// Applies cancellations, lands transfers (waiting up to the idle wait
    /// when nothing is generating), and decodes one token for every running
    /// sequence.
    pub fn step(&mut self) -> Tally {
        let wait = self.idle_wait;
        self.step_within(wait)
    }

    /// [`DecodeWorker::step`] waiting up to `wait` on the link when nothing
    /// is generating (a service thread's own polling interval).
    pub(crate) fn step_within(&mut self, wait: Duration) -> Tally {
        // Clients an injected fault cancelled (fault injection only).
        for id in self.side.requested_cancels() {
            self.core.cancel_as_client(id);
        }
        for (id, was_running) in self.core.stop_cancelled() {
            if !was_running {
                let _ = self.side.cancel(id);
            }
            self.core.end(id, Outcome::Cancelled);
        }
        let wait = if self.core.running().is_empty() {
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
            for req in self.core.stop_all_running() {
                let e = EngineError::Transfer(TransferError::Link(LinkError::Killed));
                self.core.end(req.id, Outcome::Failed(e));
            }
        }
        if let Err(PassFailed { error, reqs }) = self.core.decode() {
            // KV that came from a peer cannot be recomputed here: the pass's
            // requests fail.
            for req in reqs {
                let e = EngineError::Forward(error.clone());
                self.core.end(req.id, Outcome::Failed(e));
            }
        }
        self.core.take_step()
    }

    /// Steps until every request has ended. Every transfer ends within the
    /// link's receipt timeout, so this returns within about that long; with
    /// unbounded timeouts and a silent peer it waits as asked. See
    /// [`DecodeWorker::run_until_idle_within`] for a bounded wait. Returns
    /// the number of steps.
    pub fn run_until_idle(&mut self) -> usize {
        crate::engine::generate::run_until_idle(self, None).0
    }

    /// Steps until every request has ended or `limit` has passed; true if
    /// idle. Requests still live stay live (cancel or shut down to end them).
    #[must_use = "false means requests are still live"]
    pub fn run_until_idle_within(&mut self, limit: Duration) -> bool {
        crate::engine::generate::run_until_idle(self, Some(limit)).1
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
                    self.core
                        .end(id, Outcome::Rejected(Rejection::ShuttingDown { id }));
                }
                _ => self.land(o),
            }
        }
        for req in self.core.stop_all_running() {
            self.core
                .end(req.id, Outcome::Failed(EngineError::Shutdown));
        }
        self.core.take_step();
    }

    /// Cancels `id` within the current step's counts.
    fn cancel_now(&mut self, id: RequestId) -> bool {
        if !self.core.is_live(id) {
            return false;
        }
        if self.core.stop_running(id).is_none() {
            let _ = self.side.cancel(id);
        }
        self.core.end(id, Outcome::Cancelled);
        true
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
                self.core.end(id, outcome);
                return;
            }
        };
        let (req, seq, first, first_logprobs) = verified.into_parts();
        let vocab = self.core.model.config().vocab_size;
        let Some(first) = first.filter(|&t| (t as usize) < vocab) else {
            drop(seq);
            let e = IntegrityError::FirstToken {
                request: id,
                token: first,
                vocab,
            };
            self.core
                .end(id, Outcome::Failed(EngineError::Transfer(e.into())));
            return;
        };
        let asked = req.sampling.logprobs;
        let first_logprobs = match check_first_logprobs(asked, first, first_logprobs, vocab) {
            Ok(lp) => lp,
            Err(what) => {
                drop(seq);
                let e = IntegrityError::FirstLogprobs { request: id, what };
                self.core
                    .end(id, Outcome::Failed(EngineError::Transfer(e.into())));
                return;
            }
        };
        self.core.step_mut().landed += 1;
        match self.core.deliver_drawn(id, first, first_logprobs) {
            None => {}
            Some(Delivery::Continue(next)) => self.core.start(Started { req, seq, next }),
            Some(Delivery::End(outcome)) => {
                drop(seq);
                self.core.end(id, outcome);
            }
        }
    }
}

impl<L: DecodeLink, B: Backend> Steps for DecodeWorker<L, B> {
    fn idle(&self) -> bool {
        self.is_idle()
    }
    fn step_once(&mut self) -> Tally {
        self.step()
    }
    fn stalled(&self, _step: &Tally) -> bool {
        // A step that landed nothing was waiting on the peer; every
        // transfer ends within the link's timeouts.
        false
    }
}

impl<L: DecodeLink, B: Backend> Drop for DecodeWorker<L, B> {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Checks the first token's log-probabilities from a receipt against what
/// the request asked (`asked`: its `logprobs`) and the vocabulary: the same
/// token, as many alternatives as asked (fewer only when the vocabulary is
/// smaller), every id inside the vocabulary, every value finite and <= 0,
/// the alternatives most likely first. The values themselves come from the
/// authenticated prefill worker that computed the token.
fn check_first_logprobs(
    asked: Option<u8>,
    first: u32,
    lp: Option<TokenLogprobs>,
    vocab: usize,
) -> Result<Option<TokenLogprobs>, &'static str> {
    let (n, lp) = match (asked, lp) {
        (None, None) => return Ok(None),
        (None, Some(_)) => return Err("the request did not ask for them"),
        (Some(_), None) => return Err("missing, and the request asked for them"),
        (Some(n), Some(lp)) => (n as usize, lp),
    };
    let ok = |x: f32| x.is_finite() && x <= 0.0;
    if lp.token != first {
        Err("they are another token's")
    } else if lp.top.len() != n.min(vocab) {
        Err("not as many alternatives as asked")
    } else if lp.top.iter().any(|&(id, _)| id as usize >= vocab) {
        Err("an alternative is outside the vocabulary")
    } else if !ok(lp.logprob) || lp.top.iter().any(|&(_, x)| !ok(x)) {
        Err("a value is not a finite log-probability (<= 0)")
    } else if lp.top.windows(2).any(|w| w[1].1 > w[0].1) {
        Err("the alternatives are not most likely first")
    } else {
        Ok(Some(lp))
    }
}

#[cfg(test)]
mod logprob_checks {
    use super::check_first_logprobs as check;
    use crate::sampling::TokenLogprobs;

    fn lp(token: u32, top: &[(u32, f32)]) -> Option<TokenLogprobs> {
        Some(TokenLogprobs {
            token,
            logprob: top.iter().find(|t| t.0 == token).map_or(-3.0, |t| t.1),
            top: top.to_vec(),
        })
    }

    #[test]
    fn a_receipts_first_logprobs_must_be_what_the_request_asked() {
        let good = [(5, -0.1), (9, -2.5)];
        assert_eq!(check(None, 5, None, 100), Ok(None));
        assert_eq!(check(Some(2), 5, lp(5, &good), 100), Ok(lp(5, &good)));
        // Fewer alternatives than asked only when the vocabulary is smaller.
        let two = [(1, -0.1), (0, -2.5)];
        assert!(check(Some(20), 1, lp(1, &two), 2).is_ok());
        let refused = [
            check(None, 5, lp(5, &good), 100),
            check(Some(2), 5, None, 100),
            check(Some(2), 6, lp(5, &good), 100),
            check(Some(3), 5, lp(5, &good), 100),
            check(Some(2), 5, lp(5, &[(5, -0.1), (100, -2.5)]), 100),
            check(Some(2), 5, lp(5, &[(5, -0.1), (9, 0.5)]), 100),
            check(Some(2), 5, lp(5, &[(5, -0.1), (9, f32::NAN)]), 100),
            check(Some(2), 5, lp(5, &[(9, -2.5), (5, -0.1)]), 100),
        ];
        for (i, r) in refused.iter().enumerate() {
            assert!(r.is_err(), "case {i} accepted: {r:?}");
        }
    }
}
