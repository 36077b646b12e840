//! Entry points into the transfer layer's shared state, for the loom models
//! in tests/loom_transfer.rs. Compiled only under `cfg(handoff_loom)`: these
//! wrappers expose crate-private operations (registering a destination,
//! landing a write, fencing) that no normal build makes public.

use std::time::Duration;

use crate::ids::RequestId;
use crate::kv::{Held, KvError, KvPool, KvSeq, Ready};
use crate::transfer::error::LinkError;
use crate::transfer::link::credits;
use crate::transfer::link::landing::{self, Destination, LandingZone};
use crate::transfer::protocol::{Nonce, WriteBatch};

pub use crate::transfer::link::credits::InFlightStats;

/// What became of one write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Landed {
    Applied,
    Refused,
    Stray,
}

/// A decode side's landing zone.
#[derive(Debug, Default)]
pub struct Landing(LandingZone);

/// A destination taken out of the zone: fenced, no write can land in it.
#[derive(Debug)]
pub struct Fenced(Destination);

impl Fenced {
    /// Tokens landed in `layer` before the fence.
    pub fn written(&self, layer: usize) -> usize {
        self.0.seq.written(layer)
    }
    /// True when a write was refused.
    pub fn refused(&self) -> bool {
        self.0.refused.is_some()
    }
    /// The verifier's last step: the landed KV becomes readable.
    pub fn into_verified(self) -> KvSeq<Ready> {
        self.0.seq.into_verified()
    }
}

impl Landing {
    pub fn new() -> Self {
        Landing(LandingZone::new())
    }
    /// Reserves destination pages in `pool` for `tokens` tokens of
    /// `request` and registers them under `nonce`, as a plan does.
    pub fn register(
        &self,
        pool: &KvPool,
        request: RequestId,
        nonce: Nonce,
        tokens: usize,
    ) -> Result<(), KvError> {
        let seq = pool.reserve_for_receive(request, tokens)?;
        self.0
            .register(nonce, Destination::new(request, tokens, seq));
        Ok(())
    }
    /// Lands `batch`, carrying `bytes_each` bytes of K and of V, every byte
    /// equal to `byte`, as a transport's receiving thread does.
    pub fn write(&self, batch: &WriteBatch, bytes_each: usize, byte: u8) -> Landed {
        match self
            .0
            .apply(batch, bytes_each, None, |_, _, dst| dst.fill(byte))
        {
            landing::Landed::Applied => Landed::Applied,
            landing::Landed::Refused => Landed::Refused,
            landing::Landed::Stray => Landed::Stray,
        }
    }
    /// Lands `batch` straight from the rows of `src`, a held sequence of
    /// another pool, as the in-process transport's lander does.
    pub fn write_from(&self, batch: &WriteBatch, src: &KvSeq<Held>) -> Landed {
        match self.0.apply_from(batch, src, None) {
            landing::Landed::Applied => Landed::Applied,
            landing::Landed::Refused => Landed::Refused,
            landing::Landed::Stray => Landed::Stray,
        }
    }
    /// Fences the transfer of `nonce` and hands its destination over.
    pub fn take(&self, nonce: Nonce) -> Option<Fenced> {
        self.0.take(nonce).map(Fenced)
    }
    pub fn stray_writes(&self) -> u64 {
        self.0.stray_writes()
    }
    pub fn refused_writes(&self) -> u64 {
        self.0.refused_writes()
    }
    pub fn open_transfers(&self) -> usize {
        self.0.open_transfers()
    }
}

/// The byte credits of one link.
#[derive(Debug)]
pub struct Credits(credits::Credits);

impl Credits {
    pub fn new(cap: usize) -> Self {
        Credits(credits::Credits::new(cap))
    }
    /// Takes credit, waiting for room (loom does not model the timeout).
    pub fn acquire(&self, bytes: usize) -> Result<(), LinkError> {
        self.0.acquire(bytes, Duration::from_secs(3600))
    }
    pub fn release(&self, bytes: usize) {
        self.0.release(bytes)
    }
    /// Waits until `total` bytes in all came back (loom does not model the
    /// timeout).
    pub fn wait_released(&self, total: u64) -> Result<(), LinkError> {
        self.0.wait_released(total, Duration::from_secs(3600))
    }
    pub fn close(&self) {
        self.0.close()
    }
    pub fn stats(&self) -> InFlightStats {
        self.0.stats()
    }
}
