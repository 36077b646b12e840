//! Fault injection (tests and the `fault-injection` feature only).
//!
//! A [`FaultPlan`] is a list of [`FaultRule`]s; the links consult it at each
//! protocol [`Step`] and apply the first rule that matches the message's
//! request, so every fault happens at a precise place in the protocol.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use crate::ids::RequestId;
use crate::transfer::protocol::Receipt;

pub use crate::transfer::gate::Step;

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

/// The faults to inject into one link.
#[derive(Debug, Default)]
pub struct FaultPlan {
    rules: Mutex<Vec<FaultRule>>,
    slow_receiver: Mutex<Option<Duration>>,
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

    pub(crate) fn receiver_delay(&self) -> Option<Duration> {
        *self.slow_receiver.lock()
    }

    /// The fault to apply to a message of `request` at `step`, if any.
    pub(crate) fn take(&self, step: Step, request: RequestId) -> Option<Fault> {
        let mut rules = self.rules.lock();
        let rule = rules
            .iter_mut()
            .find(|r| r.step == step && r.times > 0 && r.request.is_none_or(|q| q == request))?;
        if rule.skip > 0 {
            rule.skip -= 1;
            return None;
        }
        rule.times -= 1;
        self.fired.fetch_add(1, Ordering::Relaxed);
        Some(rule.fault.clone())
    }
}
