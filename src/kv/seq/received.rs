//! The receiving side of a [`KvSeq`]: rows a peer wrote land in a
//! `KvSeq<Received>` (unreadable until the transfer verifier checks them
//! against the plan and hands back a `KvSeq<Ready>`), and every landing path
//! (host copy, NIXL in place, device to device) hands the verifier the rows
//! that landed.

use crate::kv::KvError;
use crate::kv::seq::{Held, KvSeq, Ready, Received, row_runs, runs, unreachable_rows};
use crate::kv::storage::{PagesRead, RowCopy, RowRun};

/// A fault injector's hook on each run of rows copied into a destination:
/// `(kv, done, dst)` (see [`KvSeq::receive_rows_from`]).
pub(crate) type Tamper<'a> = &'a mut dyn FnMut(usize, usize, &mut [u8]);

impl KvSeq<Received> {
    /// Only the transfer verifier calls this, after checking the receipt
    /// against the plan and the bytes that landed. With the audit trail on,
    /// the verified slots are recorded as written by this sequence's owner
    /// (the verifier has checked the receipt's writer ids say so); until
    /// then, peer-written slots have no trusted writer.
    pub(crate) fn into_verified(mut self) -> KvSeq<Ready> {
        if self.pool.config().audit_enabled() {
            let (ps, owner) = (self.pool.page_size(), self.owner.0);
            let written = self.written.clone();
            let w = self.pages_write();
            for (layer, &n) in written.iter().enumerate() {
                for (i, slot, _, run) in runs(0, n, ps) {
                    w.record_writers(i, layer, slot, run, owner);
                }
            }
        }
        self.into_state()
    }

    /// Appends `n` tokens to `layer` on behalf of a peer: `fill(kv, done,
    /// dst)` writes the raw storage-dtype bytes of K (`kv == 0`) or V
    /// (`kv == 1`) rows `[done, done + dst_rows)` of the batch into `dst`,
    /// one run of consecutive slots of one page at a time. Right after each
    /// run is written, `landed(page, kv, rows)` is called with the bytes of
    /// that page's rows `[0, end)` of `layer` as they now are in the pool
    /// (`page` is the position in [`KvSeq::pages`], `end` the slot after the
    /// run): the transfer verifier hashes them there, cache-hot (not when
    /// the pool's device hashes in place: see
    /// [`KvSeq::device_region_xxh3`]). The slots
    /// get no writer in the audit trail until [`KvSeq::into_verified`].
    pub(crate) fn receive_rows(
        &mut self,
        layer: usize,
        n: usize,
        mut fill: impl FnMut(usize, usize, &mut [u8]),
        mut landed: impl FnMut(usize, usize, &[u8]),
    ) -> Result<(), KvError> {
        let kvd = self.geometry().kv_dim();
        self.check_append(layer, n * kvd, n * kvd)?;
        let (ps, start) = (self.pool.page_size(), self.written[layer]);
        let mut w = self.pages_write();
        // A device that hashes where the bytes are hashes them all at once
        // when the receipt is verified: nothing is read back here.
        let hash_here = !w.read().storage().hashes_in_place();
        if w.read().storage().residence() == crate::kv::Residence::Device {
            // Device pages: the whole batch is staged and written in one
            // pass, then (a device that cannot hash) read back in one.
            let pr: Vec<_> = runs(start, n, ps).collect();
            let rr = row_runs(layer, &pr, &[0, 1], false);
            if !w.write_row_runs(&rr, |r, dst| fill(r % 2, pr[r / 2].2, dst))? {
                return Err(unreachable_rows(n));
            }
            if hash_here {
                hand_landed(w.read(), layer, pr.into_iter(), &mut landed)?;
            }
            self.written[layer] += n;
            return Ok(());
        }
        // Host pages: each run written in place and handed to `landed`
        // while it is still in cache.
        for (i, slot, done, run) in runs(start, n, ps) {
            for kv in 0..2 {
                let dst = w
                    .rows_mut(i, layer, kv, slot, run)
                    .ok_or_else(|| unreachable_rows(n))?;
                fill(kv, done, dst);
                if !hash_here {
                    continue;
                }
                if let Some(rows) = w.read().rows(i, layer, kv, 0, slot + run) {
                    landed(i, kv, rows.into_bytes());
                }
            }
        }
        self.written[layer] += n;
        Ok(())
    }

    /// [`KvSeq::receive_rows`] with every destination row of the batch
    /// handed to `fill` at once, in place in host pages: the K rows of each
    /// page run in order, then the V rows (the order a write batch carries
    /// them), for a fill that lands them all in one go (a data plane's
    /// READ). `Ok(None)`, writing nothing, when the pages are a device's;
    /// `Ok(Some(Err(e)))` when `fill` failed: the rows are then not written
    /// (the written count stays, so nothing reads them).
    #[cfg_attr(not(feature = "nixl"), allow(dead_code))]
    pub(crate) fn receive_rows_at_once<E>(
        &mut self,
        layer: usize,
        n: usize,
        fill: impl FnOnce(&mut [&mut [u8]]) -> Result<(), E>,
        mut landed: impl FnMut(usize, usize, &[u8]),
    ) -> Result<Option<Result<(), E>>, KvError> {
        let kvd = self.geometry().kv_dim();
        self.check_append(layer, n * kvd, n * kvd)?;
        let (ps, start) = (self.pool.page_size(), self.written[layer]);
        let runs: Vec<_> = runs(start, n, ps).collect();
        let spans: Vec<_> = runs
            .iter()
            .map(|&(i, slot, _, run)| (i, slot, run))
            .collect();
        let mut w = self.pages_write();
        let Some(mut rows) = w.rows_mut_runs(layer, &spans) else {
            if w.read().storage().residence() != crate::kv::Residence::Host {
                return Ok(None);
            }
            return Err(KvError::Shape {
                what: "destination rows (a page not private to the sequence)",
                expected: n,
                got: 0,
            });
        };
        if let Err(e) = fill(&mut rows) {
            return Ok(Some(Err(e)));
        }
        drop(rows);
        hand_landed(w.read(), layer, runs.iter().copied(), &mut landed)?;
        self.written[layer] += n;
        Ok(Some(Ok(())))
    }

    /// [`KvSeq::receive_rows`] with the rows copied straight from rows
    /// `[src_start, src_start + n)` of `layer` of `src`, a held sequence
    /// (one copy, no staging buffer, no lock on either pool's bytes: the
    /// two handles' borrows are the proof of access). Between two device
    /// pools whose devices reach each other the copy is device to device,
    /// in one pass. `after(kv, done, dst)`, when given, sees each run right
    /// after it is copied (fault injection tampers there), which stages the
    /// rows through the host. A source page that is no longer held leaves
    /// its rows unwritten (zero or stale), which the receipt's checksums
    /// then refuse.
    pub(crate) fn receive_rows_from(
        &mut self,
        layer: usize,
        n: usize,
        src: &KvSeq<Held>,
        src_start: usize,
        after: Option<Tamper<'_>>,
        mut landed: impl FnMut(usize, usize, &[u8]),
    ) -> Result<(), KvError> {
        let g = self.geometry();
        if src.geometry() != g {
            return Err(KvError::Shape {
                what: "source geometry (must equal the destination's)",
                expected: g.bytes_per_token(),
                got: src.geometry().bytes_per_token(),
            });
        }
        src.check_rows(layer, src_start, n)?;
        let src_held = src.check_rows_held(src_start, n).is_ok();
        if after.is_none()
            && src_held
            && self.receive_rows_on_device(layer, n, src, src_start, &mut landed)?
        {
            return Ok(());
        }
        let mut after = after;
        let row = g.kv_dim() * g.dtype.size_bytes();
        let src_ps = src.pool.page_size();
        let r = src.pages_read();
        let (mut staged, mut failed) = (Vec::new(), None);
        self.receive_rows(
            layer,
            n,
            |kv, done, dst| {
                if src_held {
                    let rows = dst.len() / row.max(1);
                    for (j, slot, at, run) in runs(src_start + done, rows, src_ps) {
                        let s = match r.rows_bytes(j, layer, kv, slot, run, &mut staged) {
                            Ok(s) => s,
                            Err(e) => {
                                failed.get_or_insert(e);
                                None
                            }
                        };
                        if let (Some(s), Some(d)) = (s, dst.get_mut(at * row..(at + run) * row)) {
                            d.copy_from_slice(s);
                        }
                    }
                }
                if let Some(after) = after.as_mut() {
                    after(kv, done, dst);
                }
            },
            landed,
        )?;
        // The source's device failed: what landed is incomplete.
        failed.map_or(Ok(()), Err)
    }

    /// [`KvSeq::receive_rows_from`] device to device: every run of K and V
    /// rows of the batch copied in one pass from `src`'s pages into this
    /// sequence's. `Ok(false)`, with nothing written, when the two pools'
    /// storages cannot do that (see `PagesWrite::copy_rows_from`).
    fn receive_rows_on_device(
        &mut self,
        layer: usize,
        n: usize,
        src: &KvSeq<Held>,
        src_start: usize,
        landed: &mut impl FnMut(usize, usize, &[u8]),
    ) -> Result<bool, KvError> {
        let kvd = self.geometry().kv_dim();
        self.check_append(layer, n * kvd, n * kvd)?;
        let (ps, start) = (self.pool.page_size(), self.written[layer]);
        let src_ps = src.pool.page_size();
        let mut copies = Vec::new();
        for (i, slot, done, run) in runs(start, n, ps) {
            for (j, src_slot, at, rows) in runs(src_start + done, run, src_ps) {
                for kv in 0..2 {
                    copies.push(RowCopy {
                        src: (j, src_slot),
                        dst: (i, slot + at),
                        kv,
                        rows,
                    });
                }
            }
        }
        let mut w = self.pages_write();
        if !w.copy_rows_from(&src.pages_read(), layer, &copies)? {
            return Ok(false);
        }
        if !w.read().storage().hashes_in_place() {
            // The verifier hashes what landed as `receive_rows` has it do.
            hand_landed(w.read(), layer, runs(start, n, ps), landed)?;
        }
        self.written[layer] += n;
        Ok(true)
    }

    /// xxh3-64 of the written K and V rows of every layer of each of the
    /// first `n_pages` pages, as `[page][layer][K, V]` (the values
    /// [`KvSeq::received_region_hashes`] gives with xxh3), computed on the
    /// device in one pass. `Ok(None)` unless the pool's device hashes in
    /// place; then [`KvSeq::receive_rows`] handed every landed run to its
    /// `landed` callback instead.
    pub(crate) fn device_region_xxh3(&self, n_pages: usize) -> Result<Option<Vec<u64>>, KvError> {
        let ps = self.pool.page_size();
        let mut runs = Vec::with_capacity(n_pages * self.written.len() * 2);
        for page in 0..n_pages.min(self.pages.len()) {
            for (layer, &w) in self.written.iter().enumerate() {
                let rows = w.saturating_sub(page * ps).min(ps);
                for kv in 0..2 {
                    runs.push(RowRun {
                        page,
                        layer,
                        kv,
                        slot: 0,
                        rows,
                    });
                }
            }
        }
        self.pages_read().rows_xxh3(&runs)
    }

    /// Hashes, with `hash`, the written K and V rows of every layer of each
    /// of the first `n_pages` pages, in parallel over pages; returns them
    /// as `[page][layer][K, V]`. For the transfer verifier, which recomputes
    /// checksums over what actually landed.
    pub(crate) fn received_region_hashes(
        &self,
        n_pages: usize,
        hash: impl Fn(&[u8]) -> u64 + Sync,
    ) -> Vec<u64> {
        use rayon::prelude::*;
        let r = self.pages_read();
        let ps = self.pool.page_size();
        let written = &self.written;
        let per_page = |i: usize| -> Vec<u64> {
            let mut out = Vec::with_capacity(2 * written.len());
            let mut scratch = Vec::new();
            for (layer, &w) in written.iter().enumerate() {
                let t = w.saturating_sub(i * ps).min(ps);
                for kv in 0..2 {
                    // Rows a device could not read hash as no rows, which
                    // no receipt's checksum matches unless none were sent.
                    let bytes = r
                        .rows_bytes(i, layer, kv, 0, t, &mut scratch)
                        .ok()
                        .flatten()
                        .map(&hash);
                    out.push(bytes.unwrap_or_else(|| hash(&[])));
                }
            }
            out
        };
        (0..n_pages.min(self.pages.len()))
            .into_par_iter()
            .with_min_len(4)
            .flat_map_iter(per_page)
            .collect()
    }
}

/// Hands `landed(page, kv, rows)` the K and V rows of `layer` from slot 0
/// through the end of each run just written (`runs` as [`runs`] gives
/// them): what the verifier hashes of a page that received rows. Read in
/// place from host pages, in one staged pass from a device's.
fn hand_landed(
    read: PagesRead<'_>,
    layer: usize,
    runs: impl Iterator<Item = (usize, usize, usize, usize)>,
    landed: &mut impl FnMut(usize, usize, &[u8]),
) -> Result<(), KvError> {
    let rr = row_runs(layer, &runs.collect::<Vec<_>>(), &[0, 1], true);
    read.read_row_runs(&rr, |r, rows| landed(rr[r].page, rr[r].kv, rows))?;
    Ok(())
}
