//! The decode side's landing zone: where KV writes from the peer land.
//!
//! Each planned transfer registers its destination handle here under its
//! nonce. A write is applied only to the entry its nonce names, only in
//! order, only within the plan; anything else is refused (recorded against
//! the entry) or, for an unknown nonce, ignored and counted. Taking an entry
//! out ([`LandingZone::take`]) is the fence: the copy of a write happens
//! under the same lock, so once taken, no write can land in its pages.

use std::collections::HashMap;

use crate::sync::Mutex;
use crate::sync::atomic::{AtomicU64, Ordering};

use crate::ids::RequestId;
use crate::kv::{Held, KvError, KvPool, KvSeq, Received};
use crate::transfer::checksum::LandedHashes;
use crate::transfer::error::WriteRefusal;
use crate::transfer::protocol::{Nonce, WriteBatch};

/// A registered destination.
#[derive(Debug)]
pub(crate) struct Destination {
    pub(crate) request: RequestId,
    pub(crate) tokens: usize,
    pub(crate) seq: KvSeq<Received>,
    /// The first refused write, reported when the receipt is verified.
    pub(crate) refused: Option<WriteRefusal>,
    /// Region hashes recomputed over the destination bytes as they land.
    pub(crate) landed: LandedHashes,
}

impl Destination {
    /// `tokens` tokens of `request` to land in `seq`.
    pub(crate) fn new(request: RequestId, tokens: usize, seq: KvSeq<Received>) -> Self {
        let g = seq.pool().config().geometry();
        let landed = LandedHashes::new(
            tokens,
            seq.pool().page_size(),
            g.n_layers,
            g.kv_dim() * g.dtype.size_bytes(),
        );
        Destination {
            request,
            tokens,
            seq,
            refused: None,
            landed,
        }
    }
}

/// Outcome of one write.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Landed {
    Applied,
    /// Refused and recorded against the transfer (it will fail).
    Refused,
    /// No transfer with that nonce: ignored, counted.
    Stray,
}

/// Destinations of the transfers in flight on one decode worker's link.
#[derive(Debug, Default)]
pub struct LandingZone {
    entries: Mutex<HashMap<Nonce, Destination>>,
    stray_writes: AtomicU64,
    refused_writes: AtomicU64,
}

impl LandingZone {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Writes for unknown, finished or cancelled transfers, ignored.
    pub fn stray_writes(&self) -> u64 {
        self.stray_writes.load(Ordering::Relaxed)
    }

    /// Writes refused for breaking order or the plan's bounds.
    pub fn refused_writes(&self) -> u64 {
        self.refused_writes.load(Ordering::Relaxed)
    }

    /// Transfers registered now.
    pub fn open_transfers(&self) -> usize {
        self.entries.lock().len()
    }

    pub(crate) fn register(&self, nonce: Nonce, dest: Destination) {
        self.entries.lock().insert(nonce, dest);
    }

    /// Removes the entry: from now on, no write can land in its pages.
    pub(crate) fn take(&self, nonce: Nonce) -> Option<Destination> {
        self.entries.lock().remove(&nonce)
    }

    /// Applies one write batch whose K and V each carry `bytes_each` bytes;
    /// `fill(kv, done, dst)` copies rows `[done, done + rows)` of K or V of
    /// the batch into `dst`. `source` is the pool the bytes come from, if
    /// any (writes from a pool into itself are refused).
    pub(crate) fn apply(
        &self,
        batch: &WriteBatch,
        bytes_each: usize,
        source: Option<&KvPool>,
        fill: impl FnMut(usize, usize, &mut [u8]),
    ) -> Landed {
        let layer = batch.layer as usize;
        self.apply_with(batch, bytes_each, source, |seq, landed| {
            seq.receive_rows(layer, batch.tokens as usize, fill, |page, kv, rows| {
                landed.landed(page, layer, kv, rows)
            })
        })
    }

    /// Applies one write batch straight from the rows `[batch.start,
    /// batch.start + batch.tokens)` of `batch.layer` of the held `src` (one
    /// copy from the source pages into the destination pages). `after(kv,
    /// done, dst)` sees each
    /// copied run (fault injection).
    pub(crate) fn apply_from(
        &self,
        batch: &WriteBatch,
        src: &KvSeq<Held>,
        after: impl FnMut(usize, usize, &mut [u8]),
    ) -> Landed {
        let g = src.pool().config().geometry();
        let bytes_each = batch.tokens as usize * g.kv_dim() * g.dtype.size_bytes();
        let layer = batch.layer as usize;
        self.apply_with(batch, bytes_each, Some(src.pool()), |seq, landed| {
            seq.receive_rows_from(
                layer,
                batch.tokens as usize,
                src,
                batch.start as usize,
                after,
                |page, kv, rows| landed.landed(page, layer, kv, rows),
            )
        })
    }

    /// Checks a write against its entry and lands it with `receive`, under
    /// the entries lock (the fence).
    fn apply_with(
        &self,
        batch: &WriteBatch,
        bytes_each: usize,
        source: Option<&KvPool>,
        receive: impl FnOnce(&mut KvSeq<Received>, &mut LandedHashes) -> Result<(), KvError>,
    ) -> Landed {
        let mut entries = self.entries.lock();
        let Some(dest) = entries.get_mut(&batch.nonce) else {
            self.stray_writes.fetch_add(1, Ordering::Relaxed);
            return Landed::Stray;
        };
        match Self::check(dest, batch, bytes_each, source) {
            Ok(()) => match receive(&mut dest.seq, &mut dest.landed) {
                Ok(()) => Landed::Applied,
                Err(e) => {
                    self.refuse(dest, WriteRefusal::Kv(e));
                    Landed::Refused
                }
            },
            Err(r) => {
                self.refuse(dest, r);
                Landed::Refused
            }
        }
    }

    fn refuse(&self, dest: &mut Destination, r: WriteRefusal) {
        self.refused_writes.fetch_add(1, Ordering::Relaxed);
        dest.refused.get_or_insert(r);
    }

    fn check(
        dest: &Destination,
        b: &WriteBatch,
        bytes_each: usize,
        source: Option<&KvPool>,
    ) -> Result<(), WriteRefusal> {
        if b.request != dest.request {
            return Err(WriteRefusal::WrongRequest {
                planned: dest.request,
                got: b.request,
            });
        }
        let g = dest.seq.pool().config().geometry();
        if source.is_some_and(|p| p.same_pool(dest.seq.pool())) {
            return Err(WriteRefusal::Kv(crate::kv::KvError::Shape {
                what: "source pool (must differ from the destination pool)",
                expected: 0,
                got: 0,
            }));
        }
        if b.layer as usize >= g.n_layers {
            return Err(WriteRefusal::LayerOutOfRange {
                layer: b.layer,
                n_layers: g.n_layers,
            });
        }
        let landed = dest.seq.written(b.layer as usize);
        if b.start as usize != landed {
            return Err(WriteRefusal::OutOfOrder {
                layer: b.layer,
                start: b.start,
                expected: landed,
            });
        }
        let end = u64::from(b.start) + u64::from(b.tokens);
        if end > dest.tokens as u64 {
            return Err(WriteRefusal::PastPlan {
                layer: b.layer,
                end,
                planned: dest.tokens,
            });
        }
        let expected = b.tokens as usize * g.kv_dim() * g.dtype.size_bytes();
        if bytes_each != expected {
            return Err(WriteRefusal::BadLength {
                tokens: b.tokens,
                expected,
                got: bytes_each,
            });
        }
        Ok(())
    }
}
