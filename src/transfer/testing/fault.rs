//! Fault injection (tests and the `fault-injection` feature only).
//!
//! A [`FaultPlan`] is a list of [`FaultRule`]s consulted at each protocol
//! [`Step`]; the first rule that matches the step and the request applies,
//! so every fault happens at a precise place in the protocol.
//!
//! Two kinds of fault:
//! - message faults ([`Fault::Drop`] to [`Fault::EditReceipt`]) act on the
//!   message leaving the link at that step;
//! - worker faults ([`Fault::Kill`], [`Fault::CancelClient`],
//!   [`Fault::ExhaustPool`], [`Fault::RejectAdmission`]) act on the worker
//!   that carries out the step: decode for [`Step::PlanSent`] and
//!   [`Step::AckSent`], prefill for [`Step::KvWriting`] (consulted per write
//!   batch) and [`Step::ReceiptSent`], and whichever side releases pages for
//!   [`Step::Release`].

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use crate::ids::RequestId;
use crate::transfer::protocol::Receipt;

pub use crate::transfer::testing::gate::Step;

/// What to do to the message at a step.
#[derive(Clone)]
pub enum Fault {
    /// The message is lost.
    Drop,
    /// The message leaves after a pause.
    Delay(Duration),
    /// The message is sent twice.
    Duplicate,
    /// The message is held back and sent after the next one.
    Reorder,
    /// The message loses its tail: a write batch one token, a plan its
    /// last page, a receipt its last layer count (others are lost).
    Truncate,
    /// One bit flips: in the KV bytes of a write batch, a receipt's first
    /// checksum, a plan's first page generation, an answer's nonce.
    Corrupt,
    /// The link closes instead of sending the message.
    Disconnect,
    /// A receipt is rewritten by the function (other messages pass).
    EditReceipt(Arc<dyn Fn(&mut Receipt) + Send + Sync>),
    /// The worker carrying out the step crashes there: its link closes
    /// abruptly, nothing more is sent (no abort, no answer), everything it
    /// held is dropped, and every later call fails with
    /// [`crate::transfer::LinkError::Killed`] until the host replaces it.
    /// A killed decode worker also ends the requests it was generating.
    Kill,
    /// The request's client cancels (or disconnects) at this step. The
    /// decode worker applies it at its next step, as it would a
    /// `RequestHandle::cancel` (engine layer); hosts driving a
    /// [`crate::transfer::DecodeSide`] directly read
    /// [`FaultPlan::take_cancels`].
    CancelClient,
    /// Every page free in the pool of the worker carrying out the step is
    /// taken, and given back after this long: requests behind wait for
    /// pages or time out.
    ExhaustPool(Duration),
    /// The worker carrying out the step turns the request away there, as
    /// its admission would while draining (typed `ShuttingDown`, HTTP 503):
    /// at [`Step::PlanSent`] decode sends no plan and releases the
    /// destination; at [`Step::KvWriting`] and [`Step::ReceiptSent`] prefill
    /// sends an abort instead of the rest of the KV or the receipt; at
    /// [`Step::AckSent`] decode drops the verified KV and answers `Fail`.
    /// At [`Step::Release`] the request is over on that side, so the worker
    /// refuses the next request it would admit instead.
    RejectAdmission,
}

impl std::fmt::Debug for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fault::Drop => write!(f, "Drop"),
            Fault::Delay(d) => write!(f, "Delay({d:?})"),
            Fault::Duplicate => write!(f, "Duplicate"),
            Fault::Reorder => write!(f, "Reorder"),
            Fault::Truncate => write!(f, "Truncate"),
            Fault::Corrupt => write!(f, "Corrupt"),
            Fault::Disconnect => write!(f, "Disconnect"),
            Fault::EditReceipt(_) => write!(f, "EditReceipt(..)"),
            Fault::Kill => write!(f, "Kill"),
            Fault::CancelClient => write!(f, "CancelClient"),
            Fault::ExhaustPool(d) => write!(f, "ExhaustPool({d:?})"),
            Fault::RejectAdmission => write!(f, "RejectAdmission"),
        }
    }
}

impl Fault {
    /// The message faults, for fault matrices.
    pub fn all_basic(delay: Duration) -> Vec<Fault> {
        vec![
            Fault::Drop,
            Fault::Delay(delay),
            Fault::Duplicate,
            Fault::Reorder,
            Fault::Truncate,
            Fault::Corrupt,
            Fault::Disconnect,
        ]
    }

    /// The worker faults, for fault matrices (`hold`: how long an
    /// exhausted pool stays exhausted).
    pub fn all_worker(hold: Duration) -> Vec<Fault> {
        vec![
            Fault::Kill,
            Fault::CancelClient,
            Fault::ExhaustPool(hold),
            Fault::RejectAdmission,
        ]
    }

    /// True for faults that act on the worker rather than on a message.
    pub fn is_worker_fault(&self) -> bool {
        matches!(
            self,
            Fault::Kill | Fault::CancelClient | Fault::ExhaustPool(_) | Fault::RejectAdmission
        )
    }
}

/// One fault at one step, optionally for one request, after skipping some
/// matching messages, for a number of times.
#[derive(Clone, Debug)]
pub struct FaultRule {
    step: Step,
    fault: Fault,
    request: Option<RequestId>,
    skip: usize,
    times: usize,
}

impl FaultRule {
    /// `fault` at the first message of `step`, once.
    pub fn at(step: Step, fault: Fault) -> Self {
        FaultRule {
            step,
            fault,
            request: None,
            skip: 0,
            times: 1,
        }
    }
    /// Only for messages about `request`.
    #[must_use]
    pub fn for_request(mut self, request: RequestId) -> Self {
        self.request = Some(request);
        self
    }
    /// Lets the first `n` matching messages pass.
    #[must_use]
    pub fn skip(mut self, n: usize) -> Self {
        self.skip = n;
        self
    }
    /// Applies `n` times (`usize::MAX`: always).
    #[must_use]
    pub fn times(mut self, n: usize) -> Self {
        self.times = n;
        self
    }
}

type SourceFn = dyn Fn(Step, RequestId) -> Option<Fault> + Send + Sync;

/// A function choosing faults, for plans too large to list as rules.
struct Source(Box<SourceFn>);

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Source(..)")
    }
}

/// The faults to inject into one link (shared by its two ends).
#[derive(Debug, Default)]
pub struct FaultPlan {
    rules: Mutex<Vec<FaultRule>>,
    source: Option<Source>,
    /// (step, request) pairs the source has fired at.
    sourced: Mutex<HashSet<(Step, RequestId)>>,
    slow_receiver: Mutex<Option<Duration>>,
    cancels: Mutex<Vec<RequestId>>,
    fired: AtomicU64,
}

impl FaultPlan {
    /// A plan injecting nothing.
    pub fn new() -> Self {
        Self::default()
    }
    /// Adds a rule.
    #[must_use]
    pub fn with(self, rule: FaultRule) -> Self {
        self.rules.lock().push(rule);
        self
    }
    /// Adds a fault source: where no rule matches, `f(step, request)` names
    /// the fault to inject, if any. Each (step, request) fires at most once
    /// (at the first message or worker step of that request at that step),
    /// so a deterministic `f` can drive long runs (a soak) where both ends
    /// of a link, even in two processes, agree on the faults.
    #[must_use]
    pub fn with_source(
        mut self,
        f: impl Fn(Step, RequestId) -> Option<Fault> + Send + Sync + 'static,
    ) -> Self {
        self.source = Some(Source(Box::new(f)));
        self
    }
    /// Adds a rule to a plan already in use (rules added later apply to
    /// messages sent from then on).
    pub fn add(&self, rule: FaultRule) {
        self.rules.lock().push(rule);
    }
    /// Shorthand for `with(FaultRule::at(step, fault))`.
    #[must_use]
    pub fn at(self, step: Step, fault: Fault) -> Self {
        self.with(FaultRule::at(step, fault))
    }
    /// Makes the receiving end pause this long before landing each write
    /// batch (a slow decode worker).
    #[must_use]
    pub fn slow_receiver(self, per_batch: Duration) -> Self {
        *self.slow_receiver.lock() = Some(per_batch);
        self
    }
    /// Faults injected so far.
    pub fn fired(&self) -> u64 {
        self.fired.load(Ordering::Relaxed)
    }

    /// Requests whose client a [`Fault::CancelClient`] has cancelled and
    /// that no decode worker has acted on yet; taking them clears them.
    pub fn take_cancels(&self) -> Vec<RequestId> {
        std::mem::take(&mut *self.cancels.lock())
    }

    pub(crate) fn receiver_delay(&self) -> Option<Duration> {
        *self.slow_receiver.lock()
    }

    pub(crate) fn request_cancel(&self, request: RequestId) {
        self.cancels.lock().push(request);
    }

    /// The message fault to apply to a message of `request` at `step`.
    pub(crate) fn take(&self, step: Step, request: RequestId) -> Option<Fault> {
        self.take_where(step, request, false)
    }

    /// The worker fault to apply when a worker carries out `step` for
    /// `request`.
    pub(crate) fn take_worker(&self, step: Step, request: RequestId) -> Option<Fault> {
        self.take_where(step, request, true)
    }

    fn take_where(&self, step: Step, request: RequestId, worker: bool) -> Option<Fault> {
        let mut rules = self.rules.lock();
        let Some(i) = rules.iter().position(|r| {
            r.step == step
                && r.times > 0
                && r.fault.is_worker_fault() == worker
                && r.request.is_none_or(|q| q == request)
        }) else {
            drop(rules);
            return self.take_sourced(step, request, worker);
        };
        let rule = &mut rules[i];
        if rule.skip > 0 {
            rule.skip -= 1;
            return None;
        }
        rule.times -= 1;
        let fault = rule.fault.clone();
        if rule.times == 0 {
            // Spent rules go, so that long runs with many rules stay fast.
            rules.remove(i);
        }
        self.fired.fetch_add(1, Ordering::Relaxed);
        Some(fault)
    }

    fn take_sourced(&self, step: Step, request: RequestId, worker: bool) -> Option<Fault> {
        let fault = (self.source.as_ref()?.0)(step, request)?;
        if fault.is_worker_fault() != worker || !self.sourced.lock().insert((step, request)) {
            return None;
        }
        self.fired.fetch_add(1, Ordering::Relaxed);
        Some(fault)
    }
}
