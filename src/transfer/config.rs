//! Timeouts and limits of a prefill/decode link.

use std::time::{Duration, Instant};

use crate::fingerprint::ModelFingerprint;
use crate::transfer::error::LinkError;
use std::sync::Arc;

use crate::transfer::link::identity::{Identity, PeerId};

/// Timeouts on every wait and the bound on KV bytes in flight. Obtained
/// from [`TransferConfig::default`] and adjusted with the `with_*` methods;
/// [`TransferConfig::validate`] (called by every transport) refuses
/// inconsistent limits.
#[derive(Clone, Debug)]
pub struct TransferConfig {
    plan_timeout: Duration,
    receipt_timeout: Duration,
    ack_timeout: Duration,
    write_timeout: Duration,
    max_in_flight_bytes: usize,
    max_batch_bytes: usize,
    max_frame_bytes: usize,
    model: Option<ModelFingerprint>,
    identity: Option<Arc<Identity>>,
    auth_timeout: Duration,
    #[cfg(any(test, feature = "fault-injection"))]
    faults: Option<std::sync::Arc<crate::transfer::testing::fault::FaultPlan>>,
}

impl Default for TransferConfig {
    fn default() -> Self {
        TransferConfig {
            plan_timeout: Duration::from_secs(30),
            receipt_timeout: Duration::from_secs(30),
            ack_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_secs(30),
            max_in_flight_bytes: 64 << 20,
            max_batch_bytes: 1 << 20,
            max_frame_bytes: 16 << 20,
            model: None,
            identity: None,
            auth_timeout: Duration::from_secs(5),
            #[cfg(any(test, feature = "fault-injection"))]
            faults: None,
        }
    }
}

impl TransferConfig {
    /// How long prefill waits for a plan before reporting
    /// [`crate::transfer::Wait::Plan`].
    #[must_use]
    pub fn with_plan_timeout(mut self, d: Duration) -> Self {
        self.plan_timeout = d;
        self
    }
    /// How long decode waits for a plan's receipt (from sending the plan).
    /// Must be above zero ([`TransferConfig::validate`] refuses 0).
    #[must_use]
    pub fn with_receipt_timeout(mut self, d: Duration) -> Self {
        self.receipt_timeout = d;
        self
    }
    /// How long prefill holds source pages waiting for decode's answer.
    #[must_use]
    pub fn with_ack_timeout(mut self, d: Duration) -> Self {
        self.ack_timeout = d;
        self
    }
    /// How long a sender waits for room under the in-flight cap, and on
    /// TCP the deadline of a whole frame: once a frame's first byte has
    /// been read, the rest must follow within it (however it trickles in),
    /// else the link ends with a typed `WireError::Stalled`.
    #[must_use]
    pub fn with_write_timeout(mut self, d: Duration) -> Self {
        self.write_timeout = d;
        self
    }
    /// Cap on KV bytes written but not yet landed, per worker pair.
    #[must_use]
    pub fn with_max_in_flight_bytes(mut self, bytes: usize) -> Self {
        self.max_in_flight_bytes = bytes;
        self
    }
    /// Upper bound on the KV bytes (K and V) of one write batch.
    #[must_use]
    pub fn with_max_batch_bytes(mut self, bytes: usize) -> Self {
        self.max_batch_bytes = bytes;
        self
    }
    /// Largest TCP frame accepted (larger ones close the connection).
    #[must_use]
    pub fn with_max_frame_bytes(mut self, bytes: usize) -> Self {
        self.max_frame_bytes = bytes;
        self
    }
    /// The model this side serves (workers set their model's fingerprint
    /// themselves). Decode names it in every plan; prefill refuses a plan
    /// whose model differs from its own with
    /// [`AbortReason::ModelMismatch`](crate::transfer::AbortReason), so KV
    /// computed by other weights never reaches a decoder.
    #[must_use]
    pub fn with_model(mut self, model: ModelFingerprint) -> Self {
        self.model = Some(model);
        self
    }
    /// This worker's identity: its own key and the peers it trusts. TCP
    /// links then authenticate both ends before any frame (see
    /// [`crate::transfer::link::auth`]), refuse a peer off the allowlist,
    /// seal every frame, and may use non-loopback addresses. Without one,
    /// TCP serves loopback only, unauthenticated (tests, demos, single-user
    /// hosts: any local process can connect as the peer).
    #[must_use]
    pub fn with_identity(mut self, identity: impl Into<Arc<Identity>>) -> Self {
        self.identity = Some(identity.into());
        self
    }
    /// How long a connection may take to authenticate (or, without an
    /// identity, to send its hello) before the listener closes it; meanwhile the
    /// listener keeps accepting others, so a silent or slow stranger does
    /// not hold the port. Also bounds the prefill end's handshake.
    #[must_use]
    pub fn with_auth_timeout(mut self, d: Duration) -> Self {
        self.auth_timeout = d;
        self
    }
    /// Injects the faults of `plan` at the protocol steps it names.
    #[cfg(any(test, feature = "fault-injection"))]
    #[must_use]
    pub fn with_faults(
        mut self,
        plan: std::sync::Arc<crate::transfer::testing::fault::FaultPlan>,
    ) -> Self {
        self.faults = Some(plan);
        self
    }

    pub fn plan_timeout(&self) -> Duration {
        self.plan_timeout
    }
    pub fn receipt_timeout(&self) -> Duration {
        self.receipt_timeout
    }
    pub fn ack_timeout(&self) -> Duration {
        self.ack_timeout
    }
    pub fn write_timeout(&self) -> Duration {
        self.write_timeout
    }
    pub fn max_in_flight_bytes(&self) -> usize {
        self.max_in_flight_bytes
    }
    pub fn max_batch_bytes(&self) -> usize {
        self.max_batch_bytes
    }
    pub fn max_frame_bytes(&self) -> usize {
        self.max_frame_bytes
    }
    /// The model this side serves, if set.
    pub fn model(&self) -> Option<ModelFingerprint> {
        self.model
    }
    /// This worker's identity, if links authenticate.
    pub fn identity(&self) -> Option<&Arc<Identity>> {
        self.identity.as_ref()
    }
    /// This worker's id, if links authenticate.
    pub fn peer_id(&self) -> Option<PeerId> {
        self.identity.as_ref().map(|i| i.peer_id())
    }
    pub fn auth_timeout(&self) -> Duration {
        self.auth_timeout
    }
    #[cfg(any(test, feature = "fault-injection"))]
    pub(crate) fn faults(
        &self,
    ) -> Option<&std::sync::Arc<crate::transfer::testing::fault::FaultPlan>> {
        self.faults.as_ref()
    }

    /// Refuses limits that cannot work together.
    pub fn validate(&self) -> Result<(), LinkError> {
        if self.receipt_timeout.is_zero() {
            return Err(LinkError::Config {
                what: "receipt_timeout must be > 0: with 0 every transfer times out before its \
                       receipt can land (Duration::MAX waits without a limit)",
            });
        }
        if self.write_timeout.is_zero() {
            return Err(LinkError::Config {
                what: "write_timeout must be > 0: with 0 every sender gives up at the in-flight \
                       cap and a TCP socket refuses it (Duration::MAX waits without a limit)",
            });
        }
        if self.plan_timeout.is_zero() || self.ack_timeout.is_zero() {
            return Err(LinkError::Config {
                what: "plan_timeout and ack_timeout must be > 0 (Duration::MAX waits without a \
                       limit)",
            });
        }
        if self.auth_timeout.is_zero() {
            return Err(LinkError::Config {
                what: "auth_timeout must be > 0: with 0 no peer can authenticate in time",
            });
        }
        if self.max_batch_bytes == 0 {
            return Err(LinkError::Config {
                what: "max_batch_bytes must be > 0",
            });
        }
        if self.max_in_flight_bytes < self.max_batch_bytes {
            return Err(LinkError::Config {
                what: "max_in_flight_bytes must be >= max_batch_bytes",
            });
        }
        if self.max_frame_bytes < self.max_batch_bytes + 4096 {
            return Err(LinkError::Config {
                what: "max_frame_bytes must exceed max_batch_bytes by at least 4096",
            });
        }
        if u32::try_from(self.max_frame_bytes).is_err() {
            return Err(LinkError::Config {
                what: "max_frame_bytes must fit in 32 bits",
            });
        }
        Ok(())
    }
}

/// `from + d`, or a point past any real wait when that is beyond the
/// clock's range: "no timeout" written as `Duration::MAX` (as std's own
/// timeouts accept it) waits as long as it takes instead of panicking on
/// the addition.
pub(crate) fn deadline(from: Instant, d: Duration) -> Instant {
    const FAR: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
    from.checked_add(d)
        .or_else(|| from.checked_add(FAR))
        .unwrap_or(from)
}
