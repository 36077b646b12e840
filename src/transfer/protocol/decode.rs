//! The decode side of a transfer: admission, destination pages, plans
//! addressed to one of its links' peers, and the verdicts of the verifier
//! (`super::verify`), the only code that turns received KV into KV decode
//! reads.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::ids::{RequestId, TenantId};
use crate::kv::{KvPool, KvSeq, Ready};
use crate::request::Request;
use crate::sampling::TokenLogprobs;
use crate::sched::{AdmissionLimits, Rejection, Scheduler, Ticket};
use crate::transfer::config::{TransferConfig, deadline};
use crate::transfer::error::{IntegrityError, LinkError, TransferError, Wait};
use crate::transfer::link::DecodeLink;
use crate::transfer::link::identity::PeerId;
use crate::transfer::link::landing::{Destination, LandingZone};
use crate::transfer::protocol::ended::{EndedNonces, REMEMBERED};
use crate::transfer::protocol::verify::{Expected, verify};
use crate::transfer::protocol::{
    Abort, AbortReason, Answer, FailReason, Nonce, Plan, PlannedPage, Receipt, ToDecode, ToPrefill,
    Verdict,
};
use crate::transfer::testing::gate::{
    PoolHog, Step, WorkerFault, at_release, requested_cancels, worker_fault,
};

/// KV that passed verification for its request: the only way to obtain a
/// `KvSeq<Ready>` from a transfer.
#[derive(Debug)]
#[must_use = "dropping verified KV releases its pages"]
pub struct VerifiedKv {
    request: Request,
    seq: KvSeq<Ready>,
    first_token: Option<u32>,
    first_logprobs: Option<TokenLogprobs>,
}

impl VerifiedKv {
    /// The request the KV belongs to.
    pub fn request(&self) -> &Request {
        &self.request
    }
    /// The verified KV (prompt positions), ready for decode.
    pub fn seq(&self) -> &KvSeq<Ready> {
        &self.seq
    }
    /// The first generated token, sampled by prefill, if it ran a model.
    pub fn first_token(&self) -> Option<u32> {
        self.first_token
    }
    /// The first token's log-probabilities as prefill reported them (only
    /// for a request that asked; the decode worker checks their shape).
    pub fn first_logprobs(&self) -> Option<&TokenLogprobs> {
        self.first_logprobs.as_ref()
    }
    /// The parts, for the decode loop: the request, its KV, the first
    /// token and its log-probabilities.
    pub fn into_parts(self) -> (Request, KvSeq<Ready>, Option<u32>, Option<TokenLogprobs>) {
        (
            self.request,
            self.seq,
            self.first_token,
            self.first_logprobs,
        )
    }
}

/// How one transfer ended.
#[derive(Debug)]
#[must_use = "an outcome carries either verified KV or the request's error"]
pub struct DecodeOutcome {
    pub request: RequestId,
    pub tenant: TenantId,
    pub result: Result<VerifiedKv, TransferError>,
}

/// What a cancel did. Cancel is idempotent and valid at every step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CancelOutcome {
    /// The request was waiting for pages; it is removed, nothing was held.
    Dequeued,
    /// The transfer was in flight: it is fenced (no write can land any
    /// more), its destination pages are scrubbed and released, and prefill
    /// is told to release its source pages.
    Fenced,
    /// Not waiting or in flight here: unknown, already verified (the
    /// [`VerifiedKv`] owner releases its pages by dropping it), failed or
    /// cancelled before.
    NotLive,
}

/// Counters of a decode side.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeStats {
    pub planned: u64,
    pub verified: u64,
    pub integrity_failures: u64,
    pub aborted: u64,
    pub cancelled: u64,
    pub timed_out: u64,
    pub link_failures: u64,
    /// Receipts for unknown, finished or cancelled requests, and duplicates:
    /// ignored, never applied.
    pub ignored_receipts: u64,
    /// Aborts for unknown, finished or cancelled requests: ignored.
    pub ignored_aborts: u64,
    /// Requests this side turned away after admitting them (draining).
    pub refused: u64,
    /// Receipts for a live transfer that arrived over a link whose
    /// authenticated peer is not the one its plan was addressed to: the
    /// transfer failed ([`IntegrityError::WrongPeer`]), nothing landed
    /// became readable.
    ///
    /// [`IntegrityError::WrongPeer`]: crate::transfer::IntegrityError::WrongPeer
    pub cross_peer_receipts_refused: u64,
}

#[derive(Debug)]
struct Live {
    request: Request,
    nonce: Nonce,
    tokens: u32,
    pages: Vec<PlannedPage>,
    deadline: Instant,
    /// The link (index into the side's links) the plan went out on: its
    /// peer is the one the plan is addressed to.
    link: usize,
}

/// One link of a decode side, with its peer and, once it ended, why.
struct Slot<L> {
    link: L,
    peer: Option<PeerId>,
    error: Option<LinkError>,
}

/// Messages a [`DecodeSide::poll`] handles past its timeout, from those
/// already waiting on the links. A decode worker that is generating polls
/// with a zero timeout; receipts that arrived during its step land at the
/// next, up to this many (each verified over its landed bytes).
pub const POLL_BURST: usize = 64;

/// How long a poll over several links waits on one of them before it looks
/// at the others again.
const SLICE: Duration = Duration::from_millis(1);

/// The decode worker's half of the protocol, over one link or several (one
/// per prefill worker, each keyed by its peer's [`PeerId`]).
///
/// Drive it from one thread: [`DecodeSide::submit`] admits (a typed
/// [`Rejection`] if the request can never fit this pool; otherwise it waits
/// until pages are free), reserves destination pages and sends the plan,
/// addressed to one link's peer ([`DecodeSide::submit_to`] names it;
/// [`DecodeSide::submit`] takes the live links in turn);
/// [`DecodeSide::poll`] lands receipts and aborts from every link and
/// reports each transfer's [`DecodeOutcome`]; [`DecodeSide::cancel`] stops
/// one.
///
/// A transfer is named by its nonce, not its request id: a late message of
/// a transfer that has ended is ignored and counted, even when the client
/// retried under the same id. The id itself is free again here once its
/// transfer has ended; a host that goes on generating for the request must
/// keep its ids unique while it does (the engine layer's `DecodeWorker`
/// refuses a live id with [`Rejection::DuplicateId`]).
///
/// A transfer is bound to the peer its plan was addressed to: its
/// destination is registered in that link's landing zone only (a write for
/// its nonce from any other link finds no destination there and never
/// lands), and a receipt for its nonce that arrives over another link, even
/// from an authenticated worker, fails the transfer
/// ([`IntegrityError::WrongPeer`](crate::transfer::IntegrityError::WrongPeer),
/// counted in [`DecodeStats::cross_peer_receipts_refused`]).
pub struct DecodeSide<L: DecodeLink> {
    links: Vec<Slot<L>>,
    /// The link `submit` addresses next.
    turn: usize,
    /// Where a poll over several links looks first.
    listen_from: usize,
    /// Requests `submit_to` addressed to a link, until their plan is sent.
    addressed: HashMap<RequestId, usize>,
    pool: KvPool,
    sched: Scheduler,
    cfg: TransferConfig,
    live: HashMap<RequestId, Live>,
    by_nonce: HashMap<Nonce, RequestId>,
    /// Transfers that ended: their late messages are ignored.
    ended: EndedNonces,
    outcomes: Vec<DecodeOutcome>,
    stats: DecodeStats,
    /// Pages taken by an injected exhausted-pool fault.
    hog: PoolHog,
    /// An injected fault asks to turn the next transfer away.
    reject_next: bool,
}

impl<L: DecodeLink> DecodeSide<L> {
    /// A decode side over `link`, admitting against `limits` (which should
    /// require the pool to hold prompt plus max new tokens of every request
    /// it accepts, as [`AdmissionLimits::from_config`] of a decode config
    /// does), bounded by `pool` itself: a request the pool can never hold is
    /// rejected, whatever pool the limits were written for. Plans name the
    /// model of [`TransferConfig::with_model`] (a host running its own model
    /// should set its [`ModelFingerprint`](crate::fingerprint::ModelFingerprint)
    /// there, as `Model::fingerprint` gives it). More links join with
    /// [`DecodeSide::add_link`].
    pub fn new(link: L, pool: KvPool, limits: AdmissionLimits, cfg: TransferConfig) -> Self {
        let limits = limits.within_pool(pool.capacity(), pool.page_size());
        let peer = link.peer();
        DecodeSide {
            links: vec![Slot {
                link,
                peer,
                error: None,
            }],
            turn: 0,
            listen_from: 0,
            addressed: HashMap::new(),
            pool,
            sched: Scheduler::new(limits),
            cfg,
            live: HashMap::new(),
            by_nonce: HashMap::new(),
            ended: EndedNonces::new(REMEMBERED),
            outcomes: Vec::new(),
            stats: DecodeStats::default(),
            hog: PoolHog::default(),
            reject_next: false,
        }
    }

    /// Adds a link to another prefill worker; returns its peer's id, by
    /// which [`DecodeSide::submit_to`] addresses plans to it. Every link of
    /// a side with several must name its peer (an authenticated link, or
    /// one inside this process), and no two the same peer
    /// ([`LinkError::Config`] otherwise; the link is closed).
    pub fn add_link(&mut self, mut link: L) -> Result<PeerId, LinkError> {
        let refuse = |link: &mut L, what| {
            link.close();
            Err(LinkError::Config { what })
        };
        let Some(peer) = link.peer() else {
            return refuse(
                &mut link,
                "a decode side with several links needs each link's peer identified: \
                 authenticate the link (TransferConfig::with_identity)",
            );
        };
        if self.links.iter().any(|s| s.peer.is_none()) {
            return refuse(
                &mut link,
                "this decode side's first link has an unidentified peer: it takes no other link",
            );
        }
        if self
            .links
            .iter()
            .any(|s| s.peer == Some(peer) && s.error.is_none())
        {
            return refuse(
                &mut link,
                "this decode side already holds a live link to that peer",
            );
        }
        self.links.push(Slot {
            link,
            peer: Some(peer),
            error: None,
        });
        Ok(peer)
    }

    /// The peers of the links that are still up.
    pub fn peers(&self) -> Vec<PeerId> {
        self.links
            .iter()
            .filter(|s| s.error.is_none())
            .filter_map(|s| s.peer)
            .collect()
    }

    /// The destination pool.
    pub fn pool(&self) -> &KvPool {
        &self.pool
    }
    /// Counters.
    pub fn stats(&self) -> DecodeStats {
        self.stats
    }
    /// The first link's landing zone (stray and refused write counters).
    pub fn landing(&self) -> &LandingZone {
        self.links[0].link.landing()
    }
    /// The landing zone of the link to `peer`, if this side holds one.
    pub fn landing_of(&self, peer: &PeerId) -> Option<&LandingZone> {
        let i = self.index_of(peer)?;
        Some(self.links[i].link.landing())
    }
    /// Transfers in flight (planned, not yet ended).
    pub fn in_flight(&self) -> usize {
        self.live.len()
    }
    /// Receipts and aborts that have arrived on the links and wait for the
    /// next [`DecodeSide::poll`] (the backlog the next step lands).
    pub fn arrived(&self) -> usize {
        self.links.iter().map(|s| s.link.arrived()).sum()
    }
    /// Requests waiting for destination pages.
    pub fn waiting(&self) -> usize {
        self.sched.waiting()
    }
    /// The error that ended this side's links, once every one has ended
    /// (the first link's): the side serves nothing more.
    pub fn link_error(&self) -> Option<&LinkError> {
        if self.links.iter().all(|s| s.error.is_some()) {
            self.links[0].error.as_ref()
        } else {
            None
        }
    }

    /// True once every link has ended.
    fn ended_all(&self) -> bool {
        self.links.iter().all(|s| s.error.is_some())
    }

    /// The live link to `peer`.
    fn index_of(&self, peer: &PeerId) -> Option<usize> {
        self.links
            .iter()
            .position(|s| s.peer.as_ref() == Some(peer) && s.error.is_none())
    }

    /// Requests whose client an injected fault cancelled (fault injection
    /// only; empty otherwise).
    pub(crate) fn requested_cancels(&self) -> Vec<RequestId> {
        requested_cancels(&self.cfg)
    }

    /// Admits `req` (or rejects it at once, allocating nothing) and starts
    /// its transfer as soon as its pages are free, addressed to the next
    /// live link's peer in turn.
    pub fn submit(&mut self, req: Request) -> Result<Ticket, Rejection> {
        let ticket = self.sched.submit(req)?;
        self.pump();
        Ok(ticket)
    }

    /// [`DecodeSide::submit`], addressed to the prefill worker `peer`. A
    /// peer this side holds no live link to is refused with
    /// [`Rejection::ShuttingDown`] (503: route the request to another
    /// worker).
    pub fn submit_to(&mut self, req: Request, peer: &PeerId) -> Result<Ticket, Rejection> {
        let id = req.id;
        let Some(link) = self.index_of(peer) else {
            return Err(Rejection::ShuttingDown { id });
        };
        let ticket = self.sched.submit(req)?;
        self.addressed.insert(id, link);
        self.pump();
        Ok(ticket)
    }

    /// Cancels `id` (client cancel or disconnect). Never frees pages that a
    /// write may still target: the transfer is fenced first.
    pub fn cancel(&mut self, id: RequestId) -> CancelOutcome {
        if self.sched.remove_waiting(id).is_some() {
            self.sched.finish(id);
            self.addressed.remove(&id);
            self.stats.cancelled += 1;
            return CancelOutcome::Dequeued;
        }
        let Some(live) = self.live.remove(&id) else {
            return CancelOutcome::NotLive;
        };
        self.forget(live.nonce);
        self.end_failed(&live, FailReason::Cancelled);
        self.stats.cancelled += 1;
        self.pump();
        CancelOutcome::Fenced
    }

    /// Waits up to `timeout` for transfers to end; returns those that did
    /// (verified, failed, aborted, timed out). Returns early once something
    /// ended, after handling every message already waiting on the links (at
    /// most [`POLL_BURST`] past the timeout): a decode worker that is
    /// generating polls with a zero timeout once a step, and lands every
    /// receipt that has arrived, not one a step.
    #[must_use = "each outcome is a transfer that ended: verified KV to decode from, or a request's typed error to report"]
    pub fn poll(&mut self, timeout: Duration) -> Vec<DecodeOutcome> {
        let until = deadline(Instant::now(), timeout);
        let mut late = 0usize;
        loop {
            self.expire();
            self.pump();
            if self.ended_all() {
                break;
            }
            let now = Instant::now();
            let wait = if self.outcomes.is_empty() {
                let next = self
                    .live
                    .values()
                    .map(|l| l.deadline)
                    .chain(self.hog.next_deadline())
                    .min();
                next.map_or(until, |d| d.min(until))
                    .saturating_duration_since(now)
            } else {
                Duration::ZERO
            };
            match self.next_message(wait) {
                Some((from, Ok(msg))) => {
                    self.handle(from, msg);
                    // Past the timeout only messages already waiting are
                    // handled (the wait above is then zero), and at most
                    // POLL_BURST of them: a peer that never stops sending
                    // does not hold the caller for long.
                    if Instant::now() >= until {
                        late += 1;
                        if late >= POLL_BURST {
                            break;
                        }
                    }
                }
                None => {
                    if !self.outcomes.is_empty() || Instant::now() >= until {
                        break;
                    }
                }
                Some((from, Err(e))) => self.link_lost(from, e),
            }
        }
        self.expire();
        std::mem::take(&mut self.outcomes)
    }

    /// The next receipt or abort from any live link, and the link it came
    /// on, waiting at most `wait`; `None` when nothing came in time. With
    /// one live link this is that link's own wait; with several, each is
    /// looked at in turn, and the wait is spent in slices of [`SLICE`] on
    /// one link after another.
    fn next_message(&mut self, wait: Duration) -> Option<(usize, Result<ToDecode, LinkError>)> {
        let live: Vec<usize> = (0..self.links.len())
            .filter(|&i| self.links[i].error.is_none())
            .collect();
        let from = |i: usize, r: Result<Option<ToDecode>, LinkError>| match r {
            Ok(Some(m)) => Some((i, Ok(m))),
            Ok(None) => None,
            Err(e) => Some((i, Err(e))),
        };
        if let [i] = live[..] {
            return from(i, self.links[i].link.recv(wait));
        }
        let until = deadline(Instant::now(), wait);
        let mut next = self.listen_from;
        loop {
            for k in 0..live.len() {
                let i = live[(next + k) % live.len()];
                if let Some(got) = from(i, self.links[i].link.recv(Duration::ZERO)) {
                    // The next look starts after this link: a busy peer
                    // does not starve the others.
                    self.listen_from = (next + k + 1) % live.len();
                    return Some(got);
                }
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() || live.is_empty() {
                return None;
            }
            let i = live[next % live.len()];
            next = next.wrapping_add(1);
            if let Some(got) = from(i, self.links[i].link.recv(left.min(SLICE))) {
                return Some(got);
            }
        }
    }

    /// Fails every transfer and waiting request, and closes every link.
    #[must_use = "each outcome is a request that ended with the link: report it to its client"]
    pub fn shutdown(&mut self) -> Vec<DecodeOutcome> {
        self.lose_all(LinkError::Disconnected);
        std::mem::take(&mut self.outcomes)
    }

    /// Starts the transfers of waiting requests whose pages are free now.
    fn pump(&mut self) {
        while !self.ended_all() {
            let free = self.pool.stats().free;
            let pool = &self.pool;
            let Some(req) = self
                .sched
                .pop_if(|r| pool.pages_for(r.max_total_tokens()) <= free)
            else {
                break;
            };
            self.start(req);
        }
    }

    /// The link a request's plan goes out on: the one `submit_to` named, or
    /// the next live one in turn. `None` when the named link has ended.
    fn pick_link(&mut self, id: RequestId) -> Option<usize> {
        if let Some(i) = self.addressed.remove(&id) {
            return self.links[i].error.is_none().then_some(i);
        }
        let n = self.links.len();
        let i = (0..n)
            .map(|k| (self.turn + k) % n)
            .find(|&i| self.links[i].error.is_none())?;
        self.turn = (i + 1) % n;
        Some(i)
    }

    fn start(&mut self, req: Request) {
        let id = req.id;
        let Some(link) = self.pick_link(id) else {
            let e = self.links.iter().find_map(|s| s.error.clone());
            self.sched.finish(id);
            self.stats.link_failures += 1;
            self.outcomes.push(DecodeOutcome {
                request: id,
                tenant: req.tenant,
                result: Err(TransferError::Link(e.unwrap_or(LinkError::Disconnected))),
            });
            return;
        };
        // Pages for prompt and every token it may generate: decode never
        // runs out mid-generation.
        let seq = match self.pool.reserve_for_receive(id, req.max_total_tokens()) {
            Ok(seq) => seq,
            Err(e) => {
                self.sched.finish(id);
                self.outcomes.push(DecodeOutcome {
                    request: id,
                    tenant: req.tenant,
                    result: Err(TransferError::Kv(e)),
                });
                return;
            }
        };
        let tokens = req.prompt.len();
        let n_pages = self.pool.pages_for(tokens);
        let pages: Vec<PlannedPage> = seq.pages()[..n_pages].iter().map(|&p| p.into()).collect();
        let nonce = Nonce::fresh();
        let plan = Plan {
            request: id,
            tenant: req.tenant,
            nonce,
            prompt: req.prompt.clone(),
            // Admission bounded the prompt by the pool, itself u32-indexed.
            tokens: u32::try_from(tokens).unwrap_or(u32::MAX),
            geometry: self.pool.config().geometry(),
            page_size: u32::try_from(self.pool.page_size()).unwrap_or(u32::MAX),
            pages: pages.clone(),
            sampling: req.sampling.clone(),
            model: self.cfg.model(),
            peer: self.links[link].peer,
            prefix_cache: req.prefix_cache,
        };
        // The destination waits in the addressed link's landing zone only.
        self.links[link]
            .link
            .landing()
            .register(nonce, Destination::new(id, tokens, seq));
        let live = Live {
            tokens: plan.tokens,
            request: req,
            nonce,
            pages,
            deadline: deadline(Instant::now(), self.cfg.receipt_timeout()),
            link,
        };
        self.stats.planned += 1;
        let fault = self.worker_step(Step::PlanSent, id);
        if fault == Some(WorkerFault::Kill) {
            self.by_nonce.insert(nonce, id);
            self.live.insert(id, live);
            self.lose_all(LinkError::Killed);
            return;
        }
        if fault == Some(WorkerFault::Reject) || std::mem::take(&mut self.reject_next) {
            self.refuse(&live, None);
            return;
        }
        match self.links[link].link.send(ToPrefill::Plan(plan)) {
            Ok(()) => {
                self.by_nonce.insert(nonce, id);
                self.live.insert(id, live);
            }
            Err(e) => {
                self.fence_and_release(&live);
                self.sched.finish(id);
                self.stats.link_failures += 1;
                self.outcomes.push(DecodeOutcome {
                    request: id,
                    tenant: live.request.tenant,
                    result: Err(TransferError::Link(e.clone())),
                });
                self.link_lost(link, e);
            }
        }
    }

    fn handle(&mut self, from: usize, msg: ToDecode) {
        match msg {
            ToDecode::Receipt(r) => self.on_receipt(from, r),
            ToDecode::Abort(a) => self.on_abort(from, a),
        }
    }

    /// Finds the transfer a message that came on link `from` belongs to:
    /// by nonce; not at all for the nonce of a transfer that has ended (a
    /// late message, even if a new transfer for the same request id is
    /// live); else (a nonce this side never issued, naming a live request)
    /// by the request it names only when the peer is authenticated (or in
    /// this process) and the request's plan went to that same peer: a peer
    /// that proved who it is and still sends a wrong nonce for its own
    /// transfer is broken or lying, and the request fails closed
    /// ([`IntegrityError::NonceMismatch`](crate::transfer::IntegrityError::NonceMismatch)).
    /// From an unauthenticated peer (TCP on loopback without identities), or
    /// naming another peer's transfer (request ids are guessable), such a
    /// message is ignored and counted, so a peer cannot end a transfer it
    /// cannot name; the transfer goes on to its real receipt or its timeout.
    fn route(&self, from: usize, nonce: Nonce, request: RequestId) -> Option<RequestId> {
        if let Some(&id) = self.by_nonce.get(&nonce) {
            return Some(id);
        }
        if self.ended.contains(&nonce) || !self.links[from].link.peer_authenticated() {
            return None;
        }
        self.live
            .get(&request)
            .is_some_and(|l| l.link == from)
            .then_some(request)
    }

    /// The transfer with `nonce` has ended: messages for it are ignored.
    fn forget(&mut self, nonce: Nonce) {
        self.by_nonce.remove(&nonce);
        self.ended.insert(nonce);
    }

    fn on_abort(&mut self, from: usize, a: Abort) {
        let Some(id) = self.route(from, a.nonce, a.request) else {
            self.stats.ignored_aborts += 1;
            return;
        };
        let Some(live) = self.live.get(&id) else {
            self.stats.ignored_aborts += 1;
            return;
        };
        if live.nonce != a.nonce || live.request.id != a.request || live.link != from {
            // A garbled abort, or one from another peer, does not end
            // someone else's transfer.
            self.stats.ignored_aborts += 1;
            return;
        }
        let Some(live) = self.live.remove(&id) else {
            return;
        };
        self.forget(live.nonce);
        // Prefill sends no receipt after an abort and releases on its own.
        self.fence_and_release(&live);
        self.sched.finish(id);
        self.stats.aborted += 1;
        self.outcomes.push(DecodeOutcome {
            request: id,
            tenant: live.request.tenant,
            result: Err(TransferError::Aborted {
                request: id,
                reason: a.reason,
            }),
        });
    }

    fn on_receipt(&mut self, from: usize, r: Receipt) {
        let Some(id) = self.route(from, r.nonce, r.request) else {
            self.stats.ignored_receipts += 1;
            return;
        };
        let Some(live) = self.live.remove(&id) else {
            self.stats.ignored_receipts += 1;
            return;
        };
        self.forget(live.nonce);
        // Fence first: from here no write can land in these pages.
        let dest = self.links[live.link].link.landing().take(live.nonce);
        let tenant = live.request.tenant;
        let expected = Expected {
            request: id,
            nonce: live.nonce,
            peer: self.links[live.link].peer,
            tokens: live.tokens,
            pages: &live.pages,
        };
        let verdict = verify(&self.pool, expected, self.links[from].peer, &r, dest);
        self.sched.finish(id);
        let result = match verdict {
            Ok(seq) => match self.worker_step(Step::AckSent, id) {
                Some(WorkerFault::Kill) => {
                    // A crash before the ack: the verified KV is lost with
                    // the worker.
                    drop(seq);
                    self.outcomes.push(DecodeOutcome {
                        request: id,
                        tenant,
                        result: Err(TransferError::Link(LinkError::Killed)),
                    });
                    self.lose_all(LinkError::Killed);
                    return;
                }
                Some(WorkerFault::Reject) => {
                    drop(seq);
                    self.refuse(&live, Some(FailReason::Cancelled));
                    return;
                }
                _ => {
                    self.stats.verified += 1;
                    self.answer(&live, Verdict::Ack);
                    Ok(VerifiedKv {
                        request: live.request,
                        seq,
                        first_token: r.first_token,
                        first_logprobs: r.first_logprobs,
                    })
                }
            },
            Err(refused) => {
                let (e, dest) = *refused;
                if matches!(e, IntegrityError::WrongPeer { .. }) {
                    self.stats.cross_peer_receipts_refused += 1;
                }
                self.release_dest(live.link, id, dest);
                self.stats.integrity_failures += 1;
                // The peer the plan was addressed to releases its source.
                self.answer(&live, Verdict::Fail(FailReason::Integrity));
                Err(TransferError::Integrity(e))
            }
        };
        self.outcomes.push(DecodeOutcome {
            request: id,
            tenant,
            result,
        });
    }

    fn answer(&mut self, live: &Live, verdict: Verdict) {
        // A lost answer only delays prefill's release until its ack timeout.
        let slot = &mut self.links[live.link];
        if slot.error.is_none() {
            let _ = slot.link.send(ToPrefill::Answer(Answer {
                request: live.request.id,
                nonce: live.nonce,
                verdict,
            }));
        }
    }

    /// Fences the transfer, scrubs and frees its destination pages.
    fn fence_and_release(&mut self, live: &Live) {
        let dest = self.links[live.link].link.landing().take(live.nonce);
        self.release_dest(live.link, live.request.id, dest);
    }

    /// Scrubs and frees a fenced destination of a transfer on `link`.
    fn release_dest(&mut self, link: usize, id: RequestId, dest: Option<Destination>) {
        if at_release(&self.cfg, id) {
            self.links[link].link.close();
        }
        drop(dest);
        if !self.ended_all() {
            match self.worker_step(Step::Release, id) {
                Some(WorkerFault::Kill) => self.lose_all(LinkError::Killed),
                Some(WorkerFault::Reject) => self.reject_next = true,
                _ => {}
            }
        }
    }

    fn end_failed(&mut self, live: &Live, why: FailReason) {
        self.fence_and_release(live);
        self.sched.finish(live.request.id);
        if !self.ended_all()
            && self.worker_step(Step::AckSent, live.request.id) == Some(WorkerFault::Kill)
        {
            // The worker dies before telling prefill: prefill's ack timeout
            // or the closed link releases the source pages.
            self.lose_all(LinkError::Killed);
            return;
        }
        self.answer(live, Verdict::Fail(why));
    }

    /// Turns an admitted request away while draining (an injected
    /// rejection): its destination is fenced and freed, prefill is told
    /// (`answer`) if it was planned, and the request ends with a typed
    /// `ShuttingDown` rejection.
    fn refuse(&mut self, live: &Live, answer: Option<FailReason>) {
        let id = live.request.id;
        self.fence_and_release(live);
        self.sched.finish(id);
        if let Some(why) = answer {
            self.answer(live, Verdict::Fail(why));
        }
        self.stats.refused += 1;
        self.outcomes.push(DecodeOutcome {
            request: id,
            tenant: live.request.tenant,
            result: Err(TransferError::Refused {
                request: id,
                reason: AbortReason::ShuttingDown,
            }),
        });
    }

    /// Takes the worker fault injected at `step` for `id`: an exhausted
    /// pool is applied here, a kill or a rejection is returned to the
    /// caller, which knows how to carry it out at that point.
    fn worker_step(&mut self, step: Step, id: RequestId) -> Option<WorkerFault> {
        match worker_fault(&self.cfg, step, id)? {
            WorkerFault::ExhaustPool(hold) => {
                self.hog.exhaust(&self.pool, hold);
                None
            }
            f => Some(f),
        }
    }

    fn expire(&mut self) {
        self.hog.expire();
        let now = Instant::now();
        let expired: Vec<RequestId> = self
            .live
            .iter()
            .filter(|(_, l)| l.deadline <= now)
            .map(|(&id, _)| id)
            .collect();
        for id in expired {
            let Some(live) = self.live.remove(&id) else {
                continue;
            };
            self.forget(live.nonce);
            self.end_failed(&live, FailReason::Timeout);
            self.stats.timed_out += 1;
            self.outcomes.push(DecodeOutcome {
                request: id,
                tenant: live.request.tenant,
                result: Err(TransferError::Timeout {
                    request: Some(id),
                    waiting_for: Wait::Receipt,
                }),
            });
        }
    }

    /// The whole worker is gone (killed, shut down): every link ends.
    fn lose_all(&mut self, e: LinkError) {
        for i in 0..self.links.len() {
            self.link_lost(i, e.clone());
        }
    }

    /// Link `i` ended with `e`: its transfers in flight, and requests
    /// addressed to it, fail with `e`; once every link has ended, so does
    /// every waiting request, and the side takes no more.
    fn link_lost(&mut self, i: usize, e: LinkError) {
        if self.links[i].error.is_none() {
            self.links[i].error = Some(e.clone());
        }
        let lost: Vec<RequestId> = self
            .live
            .iter()
            .filter(|(_, l)| l.link == i)
            .map(|(&id, _)| id)
            .collect();
        for id in lost {
            let Some(live) = self.live.remove(&id) else {
                continue;
            };
            self.by_nonce.remove(&live.nonce);
            self.fence_and_release(&live);
            self.sched.finish(id);
            self.stats.link_failures += 1;
            self.outcomes.push(DecodeOutcome {
                request: id,
                tenant: live.request.tenant,
                result: Err(TransferError::Link(e.clone())),
            });
        }
        let addressed: Vec<RequestId> = self
            .addressed
            .iter()
            .filter(|&(_, &l)| l == i)
            .map(|(&id, _)| id)
            .collect();
        for id in addressed {
            self.addressed.remove(&id);
            if let Some(req) = self.sched.remove_waiting(id) {
                self.sched.finish(id);
                self.stats.link_failures += 1;
                self.outcomes.push(DecodeOutcome {
                    request: id,
                    tenant: req.tenant,
                    result: Err(TransferError::Link(e.clone())),
                });
            }
        }
        self.links[i].link.close();
        if !self.ended_all() {
            return;
        }
        // A side whose links have all ended serves nothing more: pages
        // taken by an injected exhausted-pool fault go back now.
        self.hog = PoolHog::default();
        self.sched.close();
        self.by_nonce.clear();
        while let Some(req) = self.sched.pop_if(|_| true) {
            self.sched.finish(req.id);
            self.stats.link_failures += 1;
            self.outcomes.push(DecodeOutcome {
                request: req.id,
                tenant: req.tenant,
                result: Err(TransferError::Link(e.clone())),
            });
        }
    }
}

impl<L: DecodeLink> Drop for DecodeSide<L> {
    fn drop(&mut self) {
        // Fence every transfer before its pages go back to the pool.
        for s in &mut self.links {
            s.link.close();
        }
        for live in std::mem::take(&mut self.live).into_values() {
            drop(self.links[live.link].link.landing().take(live.nonce));
        }
    }
}
