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
use crate::transfer::error::WriteRefusal;
use crate::transfer::protocol::checksum::LandedHashes;
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

/// Outcome of [`LandingZone::apply_direct`].
#[derive(Debug, PartialEq, Eq)]
#[cfg_attr(not(feature = "nixl"), allow(dead_code))]
pub(crate) enum Direct<E> {
    /// Checked and landed, refused, or stray, as [`LandingZone::apply`].
    Landed(Landed),
    /// The destination pages are a device's: nothing was done.
    Staged,
    /// The fill failed; the write's rows count as not written.
    Failed(E),
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

    /// Applies one write batch whose K and V each carry `bytes_each` bytes
    /// by handing every destination row to `fill` at once, in place
    /// ([`KvSeq::receive_rows_at_once`]), under the fence: `fill` gets the
    /// destination pool and the rows (K runs, then V runs) and must have
    /// finished writing them when it returns. Nothing is written, and
    /// `fill` is not called, when the write is refused or stray, or the
    /// pages are a device's ([`Direct::Staged`]: land it with
    /// [`LandingZone::apply`] instead).
    #[cfg_attr(not(feature = "nixl"), allow(dead_code))]
    pub(crate) fn apply_direct<E>(
        &self,
        batch: &WriteBatch,
        bytes_each: usize,
        fill: impl FnOnce(&KvPool, &mut [&mut [u8]]) -> Result<(), E>,
    ) -> Direct<E> {
        let layer = batch.layer as usize;
        let (mut device, mut failed) = (false, None);
        let landed = self.apply_with(batch, bytes_each, None, |seq, landed| {
            let pool = seq.pool().clone();
            let got = seq.receive_rows_at_once(
                layer,
                batch.tokens as usize,
                |rows| fill(&pool, rows),
                |page, kv, rows| landed.landed(page, layer, kv, rows),
            )?;
            match got {
                None => device = true,
                Some(Ok(())) => {}
                Some(Err(e)) => failed = Some(e),
            }
            Ok(())
        });
        match (failed, device) {
            (Some(e), _) => Direct::Failed(e),
            (None, true) => Direct::Staged,
            (None, false) => Direct::Landed(landed),
        }
    }

    /// Applies one write batch straight from the rows `[batch.start,
    /// batch.start + batch.tokens)` of `batch.layer` of the held `src` (one
    /// copy from the source pages into the destination pages, device to
    /// device where both pools' devices allow). `after(kv, done, dst)`, when
    /// given, sees each copied run (fault injection; the rows then pass
    /// through the host).
    pub(crate) fn apply_from(
        &self,
        batch: &WriteBatch,
        src: &KvSeq<Held>,
        after: Option<crate::kv::Tamper<'_>>,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PoolConfig;
    use crate::kv::{KvDtype, KvGeometry};

    const TOKENS: usize = 10;
    const ROW: usize = 4 * 2; // kv_dim 4, f16

    fn zone() -> (LandingZone, KvPool, Nonce) {
        let g = KvGeometry {
            n_layers: 2,
            n_kv_heads: 2,
            head_dim: 2,
            dtype: KvDtype::F16,
        };
        let pool = KvPool::new(PoolConfig::new(g, 4, 8)).unwrap();
        let seq = pool.reserve_for_receive(RequestId(7), TOKENS).unwrap();
        let zone = LandingZone::new();
        let nonce = Nonce(42);
        zone.register(nonce, Destination::new(RequestId(7), TOKENS, seq));
        (zone, pool, nonce)
    }

    fn batch(nonce: Nonce, request: u64, layer: u32, start: u32, tokens: u32) -> WriteBatch {
        WriteBatch {
            request: RequestId(request),
            nonce,
            layer,
            start,
            tokens,
        }
    }

    /// Applies `b` carrying `bytes_each` bytes per K and V; returns the
    /// outcome and the refusal recorded against the transfer.
    fn land(b: WriteBatch, bytes_each: usize) -> (Landed, Option<WriteRefusal>, KvPool) {
        let (zone, pool, nonce) = zone();
        let b = WriteBatch { nonce, ..b };
        let landed = zone.apply(&b, bytes_each, None, |_, _, dst| dst.fill(1));
        let refused = zone.take(nonce).and_then(|d| d.refused);
        (landed, refused, pool)
    }

    #[test]
    fn a_write_within_the_plan_lands() {
        let (landed, refused, pool) = land(batch(Nonce(0), 7, 1, 0, 4), 4 * ROW);
        assert_eq!(landed, Landed::Applied);
        assert_eq!(refused, None);
        assert!(pool.stats().is_full(), "taking the entry frees its pages");
    }

    #[test]
    fn each_write_rule_refuses_and_is_recorded_against_the_transfer() {
        let cases = [
            (batch(Nonce(0), 8, 0, 0, 4), 4 * ROW, "another request"),
            (
                batch(Nonce(0), 7, 2, 0, 4),
                4 * ROW,
                "a layer past the model",
            ),
            (
                batch(Nonce(0), 7, 0, 4, 4),
                4 * ROW,
                "a start past what landed",
            ),
            (
                batch(Nonce(0), 7, 0, 0, 11),
                11 * ROW,
                "past the planned tokens",
            ),
            (
                batch(Nonce(0), 7, 0, 0, 4),
                4 * ROW - 1,
                "bytes not matching tokens",
            ),
        ];
        for (b, bytes, what) in cases {
            let (landed, refused, pool) = land(b, bytes);
            assert_eq!(landed, Landed::Refused, "{what}");
            let refused = refused.unwrap_or_else(|| panic!("{what}: nothing recorded"));
            let ok = match what {
                "another request" => matches!(
                    refused,
                    WriteRefusal::WrongRequest {
                        planned: RequestId(7),
                        got: RequestId(8)
                    }
                ),
                "a layer past the model" => {
                    matches!(
                        refused,
                        WriteRefusal::LayerOutOfRange {
                            layer: 2,
                            n_layers: 2
                        }
                    )
                }
                "a start past what landed" => matches!(
                    refused,
                    WriteRefusal::OutOfOrder {
                        layer: 0,
                        start: 4,
                        expected: 0
                    }
                ),
                "past the planned tokens" => matches!(
                    refused,
                    WriteRefusal::PastPlan {
                        layer: 0,
                        end: 11,
                        planned: TOKENS
                    }
                ),
                _ => matches!(refused, WriteRefusal::BadLength { tokens: 4, .. }),
            };
            assert!(ok, "{what}: {refused:?}");
            assert!(pool.stats().is_full(), "{what}");
        }
    }

    /// A data plane's READ lands every row of a batch at once, in order
    /// (K runs then V runs, across a page boundary), from inside the fence;
    /// a refused or stray write never starts one, and a failed one leaves
    /// the rows unwritten.
    #[test]
    fn a_direct_write_fills_every_row_at_once_and_only_when_let_in() {
        let (zone, pool, nonce) = zone();
        // Rows 2..8 of layer 0 cross the page boundary at 4: two runs.
        let first = batch(nonce, 7, 0, 0, 2);
        assert_eq!(
            zone.apply(&first, 2 * ROW, None, |_, _, dst| dst.fill(0)),
            Landed::Applied
        );
        let b = batch(nonce, 7, 0, 2, 6);
        let mut seen = Vec::new();
        let got = zone.apply_direct::<()>(&b, 6 * ROW, |p, rows| {
            assert!(p.same_pool(&pool));
            seen = rows.iter().map(|r| r.len() / ROW).collect();
            let mut x = 1u8;
            for r in rows.iter_mut() {
                for byte in r.iter_mut() {
                    *byte = x;
                    x = x.wrapping_add(1);
                }
            }
            Ok(())
        });
        assert_eq!(got, Direct::Landed(Landed::Applied));
        assert_eq!(seen, vec![2, 4, 2, 4], "K runs, then V runs");
        let dest = zone.take(nonce).unwrap();
        assert_eq!(dest.seq.written(0), 8);
        // The bytes read back in batch order: K rows 2..8, then V rows.
        let mut back = Vec::new();
        for kv in 0..2 {
            for (page, slot, rows) in [(0, 2, 2), (1, 0, 4)] {
                let mut scratch = Vec::new();
                let got = dest
                    .seq
                    .pages_read()
                    .rows_bytes(page, 0, kv, slot, rows, &mut scratch);
                back.extend_from_slice(got.unwrap().unwrap());
            }
        }
        let want: Vec<u8> = (0..12 * ROW).map(|i| (i + 1) as u8).collect();
        assert_eq!(back, want);
        drop(dest);
        assert!(pool.stats().is_full());

        // Refused (out of order), stray, failed: no READ, nothing written.
        let (zone, _pool, nonce) = self::zone();
        let never = |_: &KvPool, _: &mut [&mut [u8]]| -> Result<(), ()> {
            panic!("a READ for a write that was not let in")
        };
        assert_eq!(
            zone.apply_direct(&batch(nonce, 7, 0, 4, 4), 4 * ROW, never),
            Direct::Landed(Landed::Refused)
        );
        assert_eq!(
            zone.apply_direct(&batch(Nonce(nonce.0 + 1), 7, 0, 0, 4), 4 * ROW, never),
            Direct::Landed(Landed::Stray)
        );
        let failed = zone.apply_direct(&batch(nonce, 7, 1, 0, 4), 4 * ROW, |_, rows| {
            rows[0].fill(9);
            Err("the READ did not end")
        });
        assert_eq!(failed, Direct::Failed("the READ did not end"));
        assert_eq!(zone.take(nonce).unwrap().seq.written(1), 0);
    }

    #[test]
    fn a_write_for_an_unknown_transfer_lands_nowhere_and_is_counted() {
        let (zone, _pool, nonce) = zone();
        let stray = batch(Nonce(nonce.0 + 1), 7, 0, 0, 4);
        assert_eq!(
            zone.apply(&stray, 4 * ROW, None, |_, _, dst| dst.fill(1)),
            Landed::Stray
        );
        assert_eq!(zone.stray_writes(), 1);
        let dest = zone.take(nonce).unwrap();
        assert_eq!(dest.refused, None);
        assert_eq!(
            dest.seq.written(0),
            0,
            "nothing landed in the planned pages"
        );
    }
}
