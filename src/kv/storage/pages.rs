//! One sequence's pages as views over the storage: [`PagesRead`] from a
//! `&KvSeq`, [`PagesWrite`] from a `&mut KvSeq` (its private pages only),
//! so the borrow of the owning handle is the lock (see the module above).

use crate::kv::device::{DeviceError, Residence};
use crate::kv::seq::{KvSeq, SeqState};
use crate::kv::storage::bytes::Bytes;
use crate::kv::storage::elem::store_f32;
use crate::kv::storage::{KvSlice, Storage, prefetch};
use crate::kv::{KvError, PageId};

/// Read access to the bytes of one sequence's pages, for as long as the
/// sequence is borrowed. Pages are addressed by their position in the
/// sequence: `pages[0]` is position `offset` (0 for a whole page table).
#[derive(Clone, Copy)]
pub(crate) struct PagesRead<'a> {
    pub(super) st: &'a Storage,
    pub(super) pages: &'a [PageId],
    offset: usize,
}

/// K (`kv == 0`) or V rows `[slot, slot + rows)` of `layer` in a
/// sequence's `page`-th page ([`PagesRead::rows_xxh3`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct RowRun {
    pub(crate) page: usize,
    pub(crate) layer: usize,
    pub(crate) kv: usize,
    pub(crate) slot: usize,
    pub(crate) rows: usize,
}

/// One run of K (`kv == 0`) or V rows to copy between two sequences'
/// pages ([`PagesWrite::copy_rows_from`]): `rows` rows from slot `src.1`
/// of the source's `src.0`-th page to slot `dst.1` of the destination's
/// `dst.0`-th page.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RowCopy {
    pub(crate) src: (usize, usize),
    pub(crate) dst: (usize, usize),
    pub(crate) kv: usize,
    pub(crate) rows: usize,
}

/// Write access to the bytes of one sequence's *private* pages, for as long
/// as the sequence is borrowed mutably. It holds only the pages after the
/// leased prefix, so a cached page cannot be reached through it.
pub(crate) struct PagesWrite<'a> {
    pub(super) read: PagesRead<'a>,
}

impl<S: SeqState> KvSeq<S> {
    /// Read access to this sequence's pages, the leased prefix included
    /// (module docs: the shared borrow of the owning handle excludes every
    /// writer of its private pages; nobody writes cached pages).
    pub(crate) fn pages_read(&self) -> PagesRead<'_> {
        PagesRead {
            st: &self.pool().shared.storage,
            pages: self.pages(),
            offset: 0,
        }
    }

    /// Write access to this sequence's private pages (module docs: the
    /// exclusive borrow of the owning handle excludes every other access).
    pub(crate) fn pages_write(&mut self) -> PagesWrite<'_> {
        let shared = self.shared_pages();
        self.pages_write_from(shared)
    }

    /// Write access to this sequence's private pages from its `from`-th
    /// page on (at least past the leased prefix): the pages a draft's
    /// rollback scrubs before it frees them.
    pub(crate) fn pages_write_from(&mut self, from: usize) -> PagesWrite<'_> {
        let from = from.max(self.shared_pages());
        PagesWrite {
            read: PagesRead {
                st: &self.pool().shared.storage,
                pages: self.pages().get(from..).unwrap_or(&[]),
                offset: from,
            },
        }
    }
}

impl<'a> PagesRead<'a> {
    /// The pool index of the sequence's `i`-th page, if this view has it.
    #[inline]
    fn page(&self, i: usize) -> Option<u32> {
        Some(self.pages.get(i.checked_sub(self.offset)?)?.index)
    }

    /// Elements of K (`kv == 0`) or V rows `[slot, slot + n)` of `layer` in
    /// the sequence's `i`-th page, or `None` when out of range.
    #[inline]
    pub(crate) fn rows(
        &self,
        i: usize,
        layer: usize,
        kv: usize,
        slot: usize,
        n: usize,
    ) -> Option<KvSlice<'a>> {
        let page = self.page(i)?;
        let off = self.st.offset(page, layer, kv, slot, n)?;
        self.st.track(page, false);
        let len = n * self.st.geometry.kv_dim();
        // SAFETY: in range (offset checked); the page belongs to the
        // sequence this view borrows immutably for 'a, so nothing writes it
        // (a private page: the borrow; a cached page: no writer exists).
        // `None` for device storage.
        unsafe { self.st.slice(off, len) }
    }

    /// The bytes of K (`kv == 0`) or V rows `[slot, slot + n)` of `layer`
    /// in the sequence's `i`-th page: in place for host storage, copied
    /// into `scratch` for device storage. `Ok(None)` when out of range.
    pub(crate) fn rows_bytes<'s>(
        &self,
        i: usize,
        layer: usize,
        kv: usize,
        slot: usize,
        n: usize,
        scratch: &'s mut Vec<u8>,
    ) -> Result<Option<&'s [u8]>, KvError>
    where
        'a: 's,
    {
        if self.st.residence() == Residence::Host {
            return Ok(self.rows(i, layer, kv, slot, n).map(KvSlice::into_bytes));
        }
        let Some(page) = self.page(i) else {
            return Ok(None);
        };
        let Some(off) = self.st.offset(page, layer, kv, slot, n) else {
            return Ok(None);
        };
        self.st.track(page, false);
        scratch.clear();
        scratch.resize(n * self.st.row_bytes(), 0);
        // SAFETY: in range (offset checked); the page belongs to the
        // sequence this view borrows immutably, so nothing writes it.
        unsafe { self.st.read_into(off, scratch) }?;
        Ok(Some(&scratch[..]))
    }

    /// The bytes of each run of K or V rows, handed to `take(run, bytes)`
    /// in order: in place for host storage, read back in one staged pass
    /// for device storage (one wait for the device, not one per run).
    /// `Ok(false)`, having read nothing, when a run is out of range.
    pub(crate) fn read_row_runs(
        &self,
        runs: &[RowRun],
        mut take: impl FnMut(usize, &[u8]),
    ) -> Result<bool, KvError> {
        let Some(spans) = self.spans(runs) else {
            return Ok(false);
        };
        for r in runs {
            if let Some(page) = self.page(r.page) {
                self.st.track(page, false);
            }
        }
        // SAFETY: in range (offsets checked); the pages belong to the
        // sequence this view borrows immutably, so nothing writes them.
        unsafe { self.st.read_runs(&spans, &mut take) }?;
        Ok(true)
    }

    /// Element runs `(start, len)` of `runs`, or `None` when one is out of
    /// range.
    fn spans(&self, runs: &[RowRun]) -> Option<Vec<(usize, usize)>> {
        let kvd = self.st.geometry.kv_dim();
        runs.iter()
            .map(|r| {
                let page = self.page(r.page)?;
                let off = self.st.offset(page, r.layer, r.kv, r.slot, r.rows)?;
                Some((off, r.rows * kvd))
            })
            .collect()
    }

    /// xxh3-64 of each run of K or V rows, hashed where they are in one
    /// device pass. `Ok(None)` unless the storage hashes in place
    /// ([`Storage::hashes_in_place`]), or when a run is out of range.
    pub(crate) fn rows_xxh3(&self, runs: &[RowRun]) -> Result<Option<Vec<u64>>, KvError> {
        let (Bytes::Device(d), true) = (&self.st.bytes, self.st.hashes_in_place) else {
            return Ok(None);
        };
        let esz = self.st.geometry.dtype.size_bytes();
        let mut ranges = Vec::with_capacity(runs.len());
        for r in runs {
            let Some(page) = self.page(r.page) else {
                return Ok(None);
            };
            let Some(off) = self.st.offset(page, r.layer, r.kv, r.slot, r.rows) else {
                return Ok(None);
            };
            ranges.push((off * esz, r.rows * self.st.row_bytes()));
        }
        for r in runs {
            if let Some(page) = self.page(r.page) {
                self.st.track(page, false);
            }
        }
        match d.xxh3_ranges(&ranges) {
            Some(Ok(h)) if h.len() == ranges.len() => Ok(Some(h)),
            Some(Ok(h)) => Err(self.st.device_failed(DeviceError {
                device: d.device_name(),
                what: format!("hash of {} ranges", ranges.len()),
                reason: format!("{} hashes came back", h.len()),
            })),
            Some(Err(e)) => Err(self.st.device_failed(e)),
            None => Ok(None),
        }
    }

    /// Prefetches the K and V rows at `slot` of `layer` in the `i`-th page,
    /// where a decode step's next [`PagesWrite::store_kv_f32`] lands;
    /// nothing when out of range.
    #[inline]
    pub(crate) fn prefetch_kv(&self, i: usize, layer: usize, slot: usize) {
        let Some(page) = self.page(i) else {
            return;
        };
        let Bytes::Host(arena) = &self.st.bytes else {
            return;
        };
        let esz = self.st.geometry.dtype.size_bytes();
        for kv in 0..2 {
            if let Some(off) = self.st.offset(page, layer, kv, slot, 1) {
                prefetch(arena.ptr.as_ptr().wrapping_add(off * esz));
            }
        }
    }

    /// The pool's storage (audit trail).
    pub(crate) fn storage(&self) -> &'a Storage {
        self.st
    }
}

impl PagesWrite<'_> {
    /// K (`kv == 0`) or V rows `[slot, slot + n)` of `layer` in the
    /// sequence's `i`-th page as raw bytes, or `None` when out of range,
    /// the page is not private, or the storage is a device's (see
    /// [`PagesWrite::write_row_runs`]).
    #[inline]
    pub(crate) fn rows_mut(
        &mut self,
        i: usize,
        layer: usize,
        kv: usize,
        slot: usize,
        n: usize,
    ) -> Option<&mut [u8]> {
        let st = self.read.st;
        if st.residence() != Residence::Host {
            return None;
        }
        let page = self.read.page(i)?;
        let off = st.offset(page, layer, kv, slot, n)?;
        st.track(page, true);
        // SAFETY: in range (offset checked); the page is one of the private
        // pages of the sequence borrowed mutably for this writer's life, and
        // `&mut self` makes the returned rows the only live reference into it.
        Some(unsafe { st.bytes_mut(off, n * st.geometry.kv_dim()) })
    }

    /// The K rows, then the V rows, of `layer` in each run `(i, slot, n)`
    /// (the sequence's `i`-th page, rows `[slot, slot + n)`), all at once as
    /// raw bytes: `None` when a run is out of range or not private, or the
    /// storage is a device's. The runs must lie in distinct pages.
    #[cfg_attr(not(feature = "nixl"), allow(dead_code))]
    pub(crate) fn rows_mut_runs(
        &mut self,
        layer: usize,
        runs: &[(usize, usize, usize)],
    ) -> Option<Vec<&mut [u8]>> {
        let st = self.read.st;
        if st.residence() != Residence::Host {
            return None;
        }
        let mut pages: Vec<u32> = Vec::with_capacity(runs.len());
        let mut out = Vec::with_capacity(2 * runs.len());
        for kv in 0..2 {
            for &(i, slot, n) in runs {
                let page = self.read.page(i)?;
                if kv == 0 {
                    if pages.contains(&page) {
                        return None;
                    }
                    pages.push(page);
                }
                let off = st.offset(page, layer, kv, slot, n)?;
                st.track(page, true);
                // SAFETY: in range (offset checked); the page is one of the
                // private pages of the sequence borrowed mutably for this
                // writer's life, and `&mut self` keeps it so while the rows
                // live. The slices are disjoint: each (page, kv) pair is
                // taken once (pages checked distinct above), and K and V of
                // a page are separate regions of it.
                out.push(unsafe { st.bytes_mut(off, n * st.geometry.kv_dim()) });
            }
        }
        Some(out)
    }

    /// Writes each run of K or V rows with the bytes `fill(run, dst)`
    /// gives (once per run, in order): in place for host storage, staged
    /// and written in one pass for device storage (one wait for the device,
    /// not one per run). `Ok(false)`, having written nothing, when a run is
    /// out of range or its page is not private. Runs must not overlap.
    pub(crate) fn write_row_runs(
        &mut self,
        runs: &[RowRun],
        mut fill: impl FnMut(usize, &mut [u8]),
    ) -> Result<bool, KvError> {
        let Some(spans) = self.read.spans(runs) else {
            return Ok(false);
        };
        let st = self.read.st;
        for r in runs {
            if let Some(page) = self.read.page(r.page) {
                st.track(page, true);
            }
        }
        // SAFETY: in range (offsets checked); private pages of the
        // sequence borrowed mutably for this writer's life, and the host
        // path hands out one run's rows at a time.
        unsafe { st.write_runs(&spans, &mut fill) }?;
        Ok(true)
    }

    /// Copies K or V rows of `layer` from `src`'s pages into this
    /// sequence's pages, device to device in one pass, run by run as
    /// `copies` says. `Ok(false)`, having written nothing, when either
    /// storage is the host's, the destination device cannot reach the
    /// source's memory, or a run is out of range: the caller then stages
    /// the rows. A device error fails both pools (either device may be the
    /// one that failed).
    pub(crate) fn copy_rows_from(
        &mut self,
        src: &PagesRead<'_>,
        layer: usize,
        copies: &[RowCopy],
    ) -> Result<bool, KvError> {
        let (st, sst) = (self.read.st, src.st);
        let (Bytes::Device(to), Bytes::Device(from)) = (&st.bytes, &sst.bytes) else {
            return Ok(false);
        };
        if st.geometry != sst.geometry {
            return Ok(false);
        }
        let (esz, row) = (st.geometry.dtype.size_bytes(), st.row_bytes());
        let mut runs = Vec::with_capacity(copies.len());
        for c in copies {
            let (Some(dp), Some(sp)) = (self.read.page(c.dst.0), src.page(c.src.0)) else {
                return Ok(false);
            };
            let (Some(d), Some(s)) = (
                st.offset(dp, layer, c.kv, c.dst.1, c.rows),
                sst.offset(sp, layer, c.kv, c.src.1, c.rows),
            ) else {
                return Ok(false);
            };
            runs.push((s * esz, d * esz, c.rows * row));
        }
        for c in copies {
            if let (Some(dp), Some(sp)) = (self.read.page(c.dst.0), src.page(c.src.0)) {
                st.track(dp, true);
                sst.track(sp, false);
            }
        }
        match to.copy_from(from.as_ref(), &runs) {
            None => Ok(false),
            Some(Ok(())) => Ok(true),
            Some(Err(e)) => {
                let _ = sst.device_failed(e.clone());
                Err(st.device_failed(e))
            }
        }
    }

    /// The same pages for reading (what just landed, for the verifier),
    /// while no row is borrowed for writing.
    #[inline]
    pub(crate) fn read(&self) -> PagesRead<'_> {
        self.read
    }

    /// Stores K and V rows (f32, converted to the storage dtype) starting
    /// at `slot` of `layer` in the `i`-th page, and records `writer` for
    /// them in the audit trail: one range check for both. Nothing is
    /// written when out of range (the caller checked the reservation); an
    /// error only from a device.
    pub(crate) fn store_kv_f32(
        &mut self,
        i: usize,
        layer: usize,
        slot: usize,
        k: &[f32],
        v: &[f32],
        writer: u64,
    ) -> Result<(), KvError> {
        let st = self.read.st;
        let kvd = st.geometry.kv_dim();
        let n = k.len() / kvd.max(1);
        if v.len() != k.len() {
            return Ok(());
        }
        let Some(page) = self.read.page(i) else {
            return Ok(());
        };
        let (Some(ko), Some(vo)) = (
            st.offset(page, layer, 0, slot, n),
            st.offset(page, layer, 1, slot, n),
        ) else {
            return Ok(());
        };
        st.track(page, true);
        let (dtype, device) = (st.geometry.dtype, st.residence() == Residence::Device);
        // Device rows are converted here and copied over (no allocation on
        // the host path).
        let mut staged = Vec::new();
        for (off, src) in [(ko, k), (vo, v)] {
            if device {
                staged.resize(src.len() * dtype.size_bytes(), 0);
                store_f32(dtype, &mut staged, src);
                // SAFETY: in range (both offsets checked for `n` rows); a
                // private page of the sequence borrowed mutably for this
                // writer's life.
                unsafe { st.write_from(off, &staged) }?;
            } else {
                // SAFETY: in range (both offsets checked for `n` rows); the
                // page is a private page of the sequence borrowed mutably for
                // this writer's life, and `&mut self` makes these rows the
                // only live reference into it.
                store_f32(dtype, unsafe { st.bytes_mut(off, src.len()) }, src);
            }
        }
        st.record_writers(page, layer, slot, n, writer);
        Ok(())
    }

    /// Clears the audit trail's writer of rows `[slot, slot + n)` of
    /// `layer` in the `i`-th page (a private page only): rows rolled back,
    /// which no one may read as anyone's.
    pub(crate) fn clear_writers_rows(&self, i: usize, layer: usize, slot: usize, n: usize) {
        if let Some(p) = self.read.page(i) {
            self.read.st.clear_writer_rows(p, layer, slot, n);
        }
    }

    /// Records `writer` in the audit trail for rows `[slot, slot + n)` of
    /// `layer` in the `i`-th page (a private page only).
    pub(crate) fn record_writers(
        &self,
        i: usize,
        layer: usize,
        slot: usize,
        n: usize,
        writer: u64,
    ) {
        if let Some(p) = self.read.page(i) {
            self.read.st.record_writers(p, layer, slot, n, writer);
        }
    }
}
