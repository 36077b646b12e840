//! Where the links apply injected faults, and where the sides take the
//! worker faults. Without the `fault-injection` feature (and outside tests)
//! the gate holds nothing and passes every message through unchanged, and
//! no worker fault is ever returned.

use std::time::{Duration, Instant};

use crate::ids::RequestId;
use crate::kv::{Filling, KvPool, KvSeq};
use crate::transfer::config::{TransferConfig, deadline};
use crate::transfer::protocol::{ToDecode, ToPrefill, WriteBatch};

/// A protocol step where a fault can be injected.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Step {
    /// Decode sends a plan.
    PlanSent,
    /// Prefill sends a KV write batch.
    KvWriting,
    /// Prefill sends a receipt or an abort.
    ReceiptSent,
    /// Decode sends its answer (ack or fail).
    AckSent,
    /// A side releases pages (held source pages, fenced destination pages).
    /// Only `Fault::Delay` and `Fault::Disconnect` apply here.
    Release,
}

impl Step {
    /// Every step, for fault matrices.
    pub const ALL: [Step; 5] = [
        Step::PlanSent,
        Step::KvWriting,
        Step::ReceiptSent,
        Step::AckSent,
        Step::Release,
    ];
}

/// A KV write as it leaves a sender: the batch, and whether a fault asks
/// for one of its bits to be flipped in flight.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WriteMsg {
    pub(crate) batch: WriteBatch,
    pub(crate) corrupt: bool,
}

/// Messages a fault can act on.
pub(crate) trait Faultable: Clone {
    #[cfg_attr(not(any(test, feature = "fault-injection")), allow(dead_code))]
    fn request(&self) -> RequestId;
    /// Shortens the message; false when it cannot be (it is lost instead).
    #[cfg_attr(not(any(test, feature = "fault-injection")), allow(dead_code))]
    fn truncate(&mut self) -> bool;
    #[cfg_attr(not(any(test, feature = "fault-injection")), allow(dead_code))]
    fn corrupt(&mut self);
    /// Rewrites the message if it is a receipt.
    #[cfg(any(test, feature = "fault-injection"))]
    fn edit_receipt(
        &mut self,
        _f: &(dyn Fn(&mut crate::transfer::protocol::Receipt) + Send + Sync),
    ) {
    }
}

impl Faultable for WriteMsg {
    fn request(&self) -> RequestId {
        self.batch.request
    }
    fn truncate(&mut self) -> bool {
        if self.batch.tokens > 1 {
            self.batch.tokens -= 1;
            true
        } else {
            false
        }
    }
    fn corrupt(&mut self) {
        self.corrupt = true;
    }
}

impl Faultable for ToPrefill {
    fn request(&self) -> RequestId {
        ToPrefill::request(self)
    }
    fn truncate(&mut self) -> bool {
        match self {
            ToPrefill::Plan(p) => p.pages.pop().is_some(),
            ToPrefill::Answer(_) => false,
        }
    }
    fn corrupt(&mut self) {
        match self {
            ToPrefill::Plan(p) => match p.pages.first_mut() {
                Some(pg) => pg.generation ^= 1,
                None => p.nonce.0 ^= 1,
            },
            ToPrefill::Answer(a) => a.nonce.0 ^= 1,
        }
    }
}

impl Faultable for ToDecode {
    fn request(&self) -> RequestId {
        ToDecode::request(self)
    }
    fn truncate(&mut self) -> bool {
        match self {
            ToDecode::Receipt(r) => r.layer_tokens.pop().is_some(),
            ToDecode::Abort(_) => false,
        }
    }
    fn corrupt(&mut self) {
        match self {
            ToDecode::Receipt(r) => match r.page_checksums.first_mut() {
                Some(c) => *c ^= 1,
                None => r.nonce.0 ^= 1,
            },
            ToDecode::Abort(a) => a.nonce.0 ^= 1,
        }
    }
    #[cfg(any(test, feature = "fault-injection"))]
    fn edit_receipt(
        &mut self,
        f: &(dyn Fn(&mut crate::transfer::protocol::Receipt) + Send + Sync),
    ) {
        if let ToDecode::Receipt(r) = self {
            f(r);
        }
    }
}

/// What leaves the gate: the messages to send, in order, and whether the
/// link must close instead of going on.
pub(crate) struct Emit<M> {
    pub(crate) msgs: Vec<M>,
    pub(crate) disconnect: bool,
}

/// The fault hook of one direction of one link.
pub(crate) struct Gate<M> {
    #[cfg(any(test, feature = "fault-injection"))]
    plan: Option<std::sync::Arc<crate::transfer::testing::fault::FaultPlan>>,
    #[cfg(any(test, feature = "fault-injection"))]
    stash: Option<M>,
    _m: std::marker::PhantomData<M>,
}

impl<M: Faultable> Gate<M> {
    pub(crate) fn new(cfg: &TransferConfig) -> Self {
        let _ = cfg;
        Gate {
            #[cfg(any(test, feature = "fault-injection"))]
            plan: cfg.faults().cloned(),
            #[cfg(any(test, feature = "fault-injection"))]
            stash: None,
            _m: std::marker::PhantomData,
        }
    }

    /// Passes `msg` through the faults planned for `step`.
    #[cfg(not(any(test, feature = "fault-injection")))]
    pub(crate) fn pass(&mut self, _step: Step, msg: M) -> Emit<M> {
        Emit {
            msgs: vec![msg],
            disconnect: false,
        }
    }

    /// Passes `msg` through the faults planned for `step`.
    #[cfg(any(test, feature = "fault-injection"))]
    pub(crate) fn pass(&mut self, step: Step, mut msg: M) -> Emit<M> {
        use crate::transfer::testing::fault::Fault;
        let fault = self.plan.as_ref().and_then(|p| p.take(step, msg.request()));
        let mut msgs = Vec::with_capacity(2);
        let mut disconnect = false;
        let mut stash = None;
        match fault {
            None => msgs.push(msg),
            Some(Fault::Drop) => {}
            Some(Fault::Delay(d)) => {
                std::thread::sleep(d);
                msgs.push(msg);
            }
            Some(Fault::Duplicate) => {
                msgs.push(msg.clone());
                msgs.push(msg);
            }
            Some(Fault::Reorder) => stash = Some(msg),
            Some(Fault::Truncate) => {
                if msg.truncate() {
                    msgs.push(msg);
                }
            }
            Some(Fault::Corrupt) => {
                msg.corrupt();
                msgs.push(msg);
            }
            Some(Fault::Disconnect) => disconnect = true,
            Some(Fault::EditReceipt(f)) => {
                msg.edit_receipt(&*f);
                msgs.push(msg);
            }
            // Worker faults are taken by the sides, never here.
            Some(
                Fault::Kill | Fault::CancelClient | Fault::ExhaustPool(_) | Fault::RejectAdmission,
            ) => msgs.push(msg),
        }
        // A message held back by an earlier Reorder goes after this one.
        if let Some(held) = self.stash.take() {
            msgs.push(held);
        }
        self.stash = stash;
        Emit { msgs, disconnect }
    }
}

/// The fault planned for a release of `request`'s pages: a pause, or
/// whether the link must be disconnected now.
#[cfg(any(test, feature = "fault-injection"))]
pub(crate) fn at_release(cfg: &TransferConfig, request: RequestId) -> bool {
    use crate::transfer::testing::fault::Fault;
    match cfg.faults().and_then(|p| p.take(Step::Release, request)) {
        Some(Fault::Delay(d)) => {
            std::thread::sleep(d);
            false
        }
        Some(Fault::Disconnect) => true,
        _ => false,
    }
}

/// The fault planned for a release (none without fault injection).
#[cfg(not(any(test, feature = "fault-injection")))]
pub(crate) fn at_release(_cfg: &TransferConfig, _request: RequestId) -> bool {
    false
}

/// The pause a slow receiver takes before landing each write batch.
pub(crate) fn receiver_delay(cfg: &TransferConfig) -> Option<std::time::Duration> {
    let _ = cfg;
    #[cfg(any(test, feature = "fault-injection"))]
    {
        cfg.faults().and_then(|p| p.receiver_delay())
    }
    #[cfg(not(any(test, feature = "fault-injection")))]
    {
        None
    }
}

/// A worker fault, as the side carrying out a step acts on it
/// ([`crate::transfer::Fault::CancelClient`] is handed to the decode worker
/// through the plan instead).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(any(test, feature = "fault-injection")), allow(dead_code))]
pub(crate) enum WorkerFault {
    Kill,
    ExhaustPool(Duration),
    Reject,
}

/// The worker fault planned for `request` at `step`, if any.
#[cfg(any(test, feature = "fault-injection"))]
pub(crate) fn worker_fault(
    cfg: &TransferConfig,
    step: Step,
    request: RequestId,
) -> Option<WorkerFault> {
    use crate::transfer::testing::fault::Fault;
    let plan = cfg.faults()?;
    match plan.take_worker(step, request)? {
        Fault::Kill => Some(WorkerFault::Kill),
        Fault::CancelClient => {
            plan.request_cancel(request);
            None
        }
        Fault::ExhaustPool(d) => Some(WorkerFault::ExhaustPool(d)),
        Fault::RejectAdmission => Some(WorkerFault::Reject),
        _ => None,
    }
}

/// The worker fault planned for a step (none without fault injection).
#[cfg(not(any(test, feature = "fault-injection")))]
pub(crate) fn worker_fault(
    _cfg: &TransferConfig,
    _step: Step,
    _request: RequestId,
) -> Option<WorkerFault> {
    None
}

/// Requests whose client an injected fault has cancelled.
pub(crate) fn requested_cancels(cfg: &TransferConfig) -> Vec<RequestId> {
    let _ = cfg;
    #[cfg(any(test, feature = "fault-injection"))]
    {
        cfg.faults().map(|p| p.take_cancels()).unwrap_or_default()
    }
    #[cfg(not(any(test, feature = "fault-injection")))]
    {
        Vec::new()
    }
}

/// The owner recorded on pages taken by an exhausted-pool fault.
const HOG: RequestId = RequestId(u64::MAX);

/// Pages taken by [`WorkerFault::ExhaustPool`], each batch given back at
/// its deadline (or when the side is dropped).
#[derive(Debug, Default)]
pub(crate) struct PoolHog {
    taken: Vec<(KvSeq<Filling>, Instant)>,
}

impl PoolHog {
    /// Takes every page free in `pool` now, for `hold`.
    pub(crate) fn exhaust(&mut self, pool: &KvPool, hold: Duration) {
        let free = pool.stats().free;
        if free == 0 {
            return;
        }
        // Another thread may have taken pages meanwhile: then the pool is
        // exhausted anyway.
        if let Ok(seq) = pool.reserve(HOG, free * pool.page_size()) {
            self.taken.push((seq, deadline(Instant::now(), hold)));
        }
    }

    /// Gives back the pages whose hold has run out.
    pub(crate) fn expire(&mut self) {
        if self.taken.is_empty() {
            return;
        }
        let now = Instant::now();
        self.taken.retain(|(_, until)| *until > now);
    }

    /// When the next pages come back.
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.taken.iter().map(|(_, until)| *until).min()
    }
}
