//! A model's identity, as the workers that share KV compare it.
//!
//! Disaggregated serving computes a prompt's KV on one worker and decodes
//! from it on another; KV computed by other weights is wrong for every token
//! that follows, however well it verifies. Decode names the model it serves
//! in each plan and prefill refuses a plan for any other model. The value is
//! a leaf here so that `transfer` carries it without knowing `model`, which
//! computes it (`ModelFingerprint::of`, in `model::fingerprint`).

use std::fmt;

/// xxh3-64 of a model's configuration and weights (f32 bits, in a fixed
/// order with every tensor's length). Equal models have equal fingerprints;
/// a different bit anywhere gives a different one (up to hash collisions).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ModelFingerprint(u64);

impl ModelFingerprint {
    /// The fingerprint as carried on a wire.
    pub fn to_u64(self) -> u64 {
        self.0
    }

    /// A fingerprint read from a wire.
    pub const fn from_u64(v: u64) -> Self {
        ModelFingerprint(v)
    }
}

impl fmt::Display for ModelFingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}
