//! What a server did: one counter type for a step and for a server's whole
//! life, the same for the colocated engine and the decode worker.

use crate::engine::Outcome;

/// Counts of what happened: returned by one `step` (that step's) and by
/// `tally()` (every step's so far, plus rejected submissions), on the
/// colocated [`crate::Engine`] and the decode worker alike.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// Requests prefilled here (colocated: admitted or recomputed).
    pub prefilled: u64,
    /// Prompt (and recomputed) tokens prefilled.
    pub prefill_tokens: u64,
    /// Prompt tokens whose KV came from the prefix cache, not computed.
    pub reused_tokens: u64,
    /// Requests whose verified KV landed and started generating (decode
    /// worker).
    pub landed: u64,
    /// Sequences that decoded one token (summed over steps).
    pub decoded: u64,
    /// Tokens drafted and scored by a speculative verify pass.
    pub drafted: u64,
    /// Drafted tokens the target kept (each one a token gained over one
    /// token per step).
    pub accepted: u64,
    /// Sequences preempted (pages released, request requeued to recompute).
    pub preempted: u64,
    /// Requests that ended `Finished`.
    pub finished: u64,
    /// Requests turned away: at submission, or ended `Rejected`.
    pub rejected: u64,
    /// Requests that ended `Cancelled`.
    pub cancelled: u64,
    /// Requests that ended `Failed`.
    pub failed: u64,
}

impl Tally {
    /// True when the step computed or changed anything.
    pub fn progressed(&self) -> bool {
        *self != Tally::default()
    }

    /// Counts a request's final outcome.
    pub(crate) fn count(&mut self, outcome: &Outcome) {
        match outcome {
            Outcome::Finished(_) => self.finished += 1,
            Outcome::Rejected(_) => self.rejected += 1,
            Outcome::Cancelled => self.cancelled += 1,
            Outcome::Failed(_) => self.failed += 1,
        }
    }

    /// Adds `other`'s counts to these.
    pub(crate) fn add(&mut self, other: &Tally) {
        let Tally {
            prefilled,
            prefill_tokens,
            reused_tokens,
            landed,
            decoded,
            drafted,
            accepted,
            preempted,
            finished,
            rejected,
            cancelled,
            failed,
        } = *other;
        self.prefilled += prefilled;
        self.prefill_tokens += prefill_tokens;
        self.reused_tokens += reused_tokens;
        self.landed += landed;
        self.decoded += decoded;
        self.drafted += drafted;
        self.accepted += accepted;
        self.preempted += preempted;
        self.finished += finished;
        self.rejected += rejected;
        self.cancelled += cancelled;
        self.failed += failed;
    }
}
