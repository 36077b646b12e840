//! Storage for KV pages: one contiguous arena, addressed by page index, in
//! host memory or behind a backend's [`DevicePages`]. This is the crate's
//! raw-buffer layer for KV bytes.
//!
//! Host bytes are handed out in place ([`PagesRead::rows`]); device bytes
//! only as staged copies, of one run of rows ([`PagesRead::rows_bytes`]) or
//! of a pass of runs ([`PagesRead::read_row_runs`],
//! [`PagesWrite::write_row_runs`]), so that every path the pool itself takes
//! (appends, transfers, checksums, scrubs) works on both. A device access
//! that fails marks the storage failed: the pool then hands out no page.
//!
//! Page layout, in elements: `[layer][k|v][slot][kv_dim]`, so the K rows of
//! one layer within one page are contiguous (what attention streams over).
//!
//! # No lock, ownership as the proof
//!
//! The arena has no lock. Page bytes are reached only through
//! [`PagesRead`] (made from a `&KvSeq`) and [`PagesWrite`] (made from a
//! `&mut KvSeq`), and only for the pages that sequence owns. The pool hands
//! each page to exactly one live [`KvSeq`] at a time (a page is free, or in
//! the page list of one handle; `KvSeq` is not `Clone` and its pages leave it
//! only when it is dropped, after its scrub). So Rust's borrow rules on the
//! handles are the locking: many readers or one writer per sequence, and
//! different sequences never share a byte they can write. A page moves
//! between threads with its handle (a channel or lock gives the
//! happens-before), or through the free list under the pool's bookkeeping
//! mutex.
//!
//! Cached prefix pages are the one kind shared between sequences, and they
//! are never written: a [`PagesWrite`] is built from a sequence's *private*
//! pages only (the slice after its leased prefix), so no `&mut` path reaches
//! a cached page's bytes. A page becomes cached after its last write, under
//! the bookkeeping mutex that every later lease also takes (happens-before),
//! and leaves the cache only by eviction, under that mutex, with no lease
//! left on it ([`Storage::scrub_evicted`]).
//!
//! Under `--cfg handoff_loom` every page access is also reported to a per-page
//! `loom::cell::UnsafeCell`, so the model checker flags any two accesses
//! to one page that this argument fails to order.
//!
//! The pieces, one concern each: `elem` (the stored dtypes and conversion to
//! and from f32), `arena` (the host allocation), `bytes` (host or device:
//! every element-range access goes through it), `audit` (who wrote each
//! slot and published each page), `scrub` (zero or poison before reuse) and
//! `pages` (the per-sequence views [`PagesRead`] and [`PagesWrite`]).

mod arena;
mod audit;
mod bytes;
mod elem;
mod pages;
mod scrub;

use std::sync::atomic::AtomicU64;

use crate::kv::device::{DeviceError, DevicePages, Residence};
use crate::kv::{KvDtype, KvError, KvGeometry, PoolError};
use arena::Arena;
use bytes::Bytes;

pub(crate) use elem::bytes_to_f32;
pub use elem::{KvElem, KvSlice};
pub(crate) use pages::{PagesRead, PagesWrite, RowCopy, RowRun};

/// The arena plus, when the audit trail is on, who wrote each slot.
pub(crate) struct Storage {
    bytes: Bytes,
    /// The first device access that failed: no page is handed out after
    /// it (its scrub may not have landed).
    failure: std::sync::OnceLock<DeviceError>,
    /// Device storage whose [`DevicePages::xxh3_ranges`] hashes: landed
    /// rows are hashed where they are, never read back for it.
    hashes_in_place: bool,
    geometry: KvGeometry,
    page_size: usize,
    pages: usize,
    /// The audit trail, when on: per (page, layer, slot), 0 = never written
    /// since the page was handed out, otherwise `RequestId + 1` of the writer.
    writers: Option<Box<[AtomicU64]>>,
    /// With the audit trail, per page: `[RequestId + 1, TenantId + 1]` of
    /// the sequence that published it into the prefix cache (0s for a page
    /// not cached). Readers of a cached page check both.
    publishers: Option<Box<[AtomicU64]>>,
    #[cfg(handoff_loom)]
    track: Box<[Tracker]>,
}

/// One page's access tracker for loom (no data; loom checks the accesses'
/// causality).
#[cfg(handoff_loom)]
struct Tracker(loom::cell::UnsafeCell<()>);

// SAFETY: loom's cell holds no data here; it only records accesses, which
// loom itself checks for races (the point of sharing it).
#[cfg(handoff_loom)]
unsafe impl Sync for Tracker {}

impl std::fmt::Debug for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Storage")
            .field("pages", &self.pages)
            .field("page_size", &self.page_size)
            .field("audit", &self.writers.is_some())
            .field("residence", &self.residence())
            .finish()
    }
}

impl Storage {
    /// An arena of `pages` pages; the pool has checked that its size does
    /// not overflow.
    /// `Err(bytes)` when the arena or the audit trail cannot be allocated.
    pub(crate) fn new(
        geometry: KvGeometry,
        page_size: usize,
        pages: usize,
        audit: bool,
    ) -> Result<Self, usize> {
        let bytes = Self::bytes_for(&geometry, page_size, pages);
        let arena = Arena::zeroed(bytes).ok_or(bytes)?;
        Self::with_bytes(geometry, page_size, pages, audit, Bytes::Host(arena))
    }

    /// Storage whose page bytes are `dev`'s (at least
    /// [`Storage::bytes_for`] of them, checked by the pool), zeroed here
    /// before any page can be handed out: fresh device memory holds
    /// whatever was there.
    pub(crate) fn on_device(
        geometry: KvGeometry,
        page_size: usize,
        pages: usize,
        audit: bool,
        dev: Box<dyn DevicePages>,
    ) -> Result<Self, PoolError> {
        let len = Self::bytes_for(&geometry, page_size, pages);
        let esz = geometry.dtype.size_bytes();
        dev.fill(0, len, &vec![0u8; esz])
            .map_err(PoolError::Device)?;
        let hashes = dev.xxh3_ranges(&[]).is_some();
        let mut st = Self::with_bytes(geometry, page_size, pages, audit, Bytes::Device(dev))
            .map_err(|bytes| PoolError::OutOfMemory { bytes })?;
        st.hashes_in_place = hashes;
        Ok(st)
    }

    /// Bytes of `pages` pages (the pool has checked that it does not
    /// overflow).
    pub(crate) fn bytes_for(geometry: &KvGeometry, page_size: usize, pages: usize) -> usize {
        pages * page_stride(geometry, page_size) * geometry.dtype.size_bytes()
    }

    fn with_bytes(
        geometry: KvGeometry,
        page_size: usize,
        pages: usize,
        audit: bool,
        bytes: Bytes,
    ) -> Result<Self, usize> {
        let zeroed = |n: usize| -> Result<Box<[AtomicU64]>, usize> {
            let mut w: Vec<AtomicU64> = Vec::new();
            w.try_reserve_exact(n).map_err(|_| n.saturating_mul(8))?;
            w.extend((0..n).map(|_| AtomicU64::new(0)));
            Ok(w.into_boxed_slice())
        };
        let (writers, publishers) = if audit {
            let slots = pages * geometry.n_layers * page_size;
            (Some(zeroed(slots)?), Some(zeroed(pages * 2)?))
        } else {
            (None, None)
        };
        Ok(Storage {
            bytes,
            failure: std::sync::OnceLock::new(),
            hashes_in_place: false,
            geometry,
            page_size,
            pages,
            writers,
            publishers,
            #[cfg(handoff_loom)]
            track: (0..pages)
                .map(|_| Tracker(loom::cell::UnsafeCell::new(())))
                .collect(),
        })
    }

    fn page_stride(&self) -> usize {
        page_stride(&self.geometry, self.page_size)
    }

    /// Bytes of one K or V row.
    fn row_bytes(&self) -> usize {
        self.geometry.kv_dim() * self.geometry.dtype.size_bytes()
    }

    /// The arena's address and length in bytes, for a transport that
    /// registers it to read held pages in place (NIXL). Reading through it
    /// is the transport's business: it may read only rows that
    /// [`KvSeq::read_rows`](crate::kv::KvSeq) hands out, of pages held for
    /// it.
    /// `None` for device storage, which has no host address.
    #[cfg(feature = "nixl")]
    pub(crate) fn span(&self) -> Option<(usize, usize)> {
        match &self.bytes {
            Bytes::Host(a) => Some((a.ptr.as_ptr() as usize, a.layout.size())),
            Bytes::Device(_) => None,
        }
    }

    /// The stored element type.
    pub(crate) fn dtype(&self) -> KvDtype {
        self.geometry.dtype
    }

    /// Where the page bytes live.
    pub(crate) fn residence(&self) -> Residence {
        match self.bytes {
            Bytes::Host(_) => Residence::Host,
            Bytes::Device(_) => Residence::Device,
        }
    }

    /// The device storage, for the backend that made it (kernels reach its
    /// memory directly); `None` for host storage.
    pub(crate) fn device_pages(&self) -> Option<&dyn DevicePages> {
        match &self.bytes {
            Bytes::Host(_) => None,
            Bytes::Device(d) => Some(d.as_ref()),
        }
    }

    /// Whether landed rows are hashed where they are (device storage whose
    /// [`DevicePages::xxh3_ranges`] hashes) rather than read back.
    pub(crate) fn hashes_in_place(&self) -> bool {
        self.hashes_in_place
    }

    /// The first device access that failed, if one has.
    pub(crate) fn failure(&self) -> Option<DeviceError> {
        self.failure.get().cloned()
    }

    /// Records a device failure (the pool refuses allocations from now on)
    /// and turns it into the KV layer's error.
    fn device_failed(&self, e: DeviceError) -> KvError {
        let _ = self.failure.set(e.clone());
        KvError::Device(e)
    }

    /// Element offset of (page, layer, k=0|v=1, slot), or `None` when any
    /// coordinate (or `slot + n`) is out of range.
    #[inline]
    fn offset(&self, page: u32, layer: usize, kv: usize, slot: usize, n: usize) -> Option<usize> {
        let ok = (page as usize) < self.pages
            && layer < self.geometry.n_layers
            && kv < 2
            && slot.checked_add(n).is_some_and(|end| end <= self.page_size);
        ok.then(|| {
            page as usize * self.page_stride()
                + ((layer * 2 + kv) * self.page_size + slot) * self.geometry.kv_dim()
        })
    }

    /// Tells loom about an access to `page` (nothing otherwise).
    #[inline(always)]
    fn track(&self, _page: u32, _write: bool) {
        #[cfg(handoff_loom)]
        if let Some(cell) = self.track.get(_page as usize) {
            if _write {
                cell.0.with_mut(|_| ());
            } else {
                cell.0.with(|_| ());
            }
        }
    }
}

/// Asks the CPU to bring the cache line holding `p` closer, ahead of a
/// use a few sequences later in a batch loop: a pass over a thousand
/// sequences otherwise waits on each one's scattered page table, counters
/// and KV rows in turn. A hint only: it reads nothing and cannot fault.
#[inline(always)]
pub(crate) fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        // SAFETY: a prefetch is a hint that never dereferences `p` (any
        // address is allowed, none faults); SSE is baseline on x86_64.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast::<i8>()) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Elements per page (K and V of every layer); the pool has checked with
/// [`checked_page_stride`] that it does not overflow.
pub(crate) fn page_stride(g: &KvGeometry, page_size: usize) -> usize {
    g.n_layers * 2 * page_size * g.kv_dim()
}

/// [`page_stride`], or `None` when it overflows.
pub(crate) fn checked_page_stride(g: &KvGeometry, page_size: usize) -> Option<usize> {
    g.n_kv_heads
        .checked_mul(g.head_dim)?
        .checked_mul(g.n_layers)?
        .checked_mul(2)?
        .checked_mul(page_size)
}
