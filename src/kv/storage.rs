//! Host storage for KV pages: one contiguous arena, addressed by page index.
//! This is the crate's raw-buffer layer for KV bytes.
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

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use half::{bf16, f16};

use crate::ids::{RequestId, TenantId};
use crate::kv::PageId;
use crate::kv::pool::Meta;
use crate::kv::seq::{KvSeq, SeqState};
use crate::kv::{KvDtype, KvGeometry};

/// A stored KV element type.
pub trait KvElem: Copy + Send + Sync + bytemuck::Pod + 'static {
    const DTYPE: KvDtype;
    const ZERO: Self;
    const POISON: Self;
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
}

impl KvElem for f32 {
    const DTYPE: KvDtype = KvDtype::F32;
    const ZERO: Self = 0.0;
    const POISON: Self = f32::NAN;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl KvElem for f16 {
    const DTYPE: KvDtype = KvDtype::F16;
    const ZERO: Self = f16::ZERO;
    const POISON: Self = f16::NAN;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}

impl KvElem for bf16 {
    const DTYPE: KvDtype = KvDtype::BF16;
    const ZERO: Self = bf16::ZERO;
    const POISON: Self = bf16::NAN;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

/// A borrowed run of stored elements, typed by the pool's dtype.
#[derive(Clone, Copy, Debug)]
pub enum KvSlice<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
}

impl KvSlice<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            KvSlice::F32(s) => s.len(),
            KvSlice::F16(s) => s.len(),
            KvSlice::BF16(s) => s.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The raw bytes (little-endian on every supported target).
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            KvSlice::F32(s) => bytemuck::cast_slice(s),
            KvSlice::F16(s) => bytemuck::cast_slice(s),
            KvSlice::BF16(s) => bytemuck::cast_slice(s),
        }
    }
    /// Converts to f32 into `out` (same length).
    pub fn to_f32_into(&self, out: &mut [f32]) {
        fn conv<T: KvElem>(s: &[T], out: &mut [f32]) {
            for (o, x) in out.iter_mut().zip(s) {
                *o = x.to_f32();
            }
        }
        match self {
            KvSlice::F32(s) => out.copy_from_slice(s),
            KvSlice::F16(s) => conv(s, out),
            KvSlice::BF16(s) => conv(s, out),
        }
    }
}

/// The zeroed bytes of the arena. Allocated with `alloc_zeroed` at the
/// platform's minimum alignment, which is `calloc`: pages never handed out
/// cost no resident memory.
struct Arena {
    ptr: NonNull<u8>,
    layout: Layout,
}

/// Alignment of the arena: enough for every KV dtype (at most 4 bytes) and
/// no more than what `calloc` gives, so allocation stays lazy.
const ARENA_ALIGN: usize = 16;

impl Arena {
    /// `bytes` zeroed bytes, or `None` when the allocator refuses them (the
    /// pool reports that as a typed error rather than aborting).
    fn zeroed(bytes: usize) -> Option<Arena> {
        let layout = Layout::from_size_align(bytes.max(1), ARENA_ALIGN).ok()?;
        // SAFETY: the layout has non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        NonNull::new(raw).map(|ptr| Arena { ptr, layout })
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: allocated in `Arena::zeroed` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

// SAFETY: the arena is plain bytes; who may touch which bytes is decided by
// page ownership (module docs), not by the thread that holds the pointer.
unsafe impl Send for Arena {}
// SAFETY: as above; shared access hands out bytes only through `PagesRead`
// and `PagesWrite`, whose constructors borrow the owning `KvSeq`.
unsafe impl Sync for Arena {}

/// The arena plus, when the audit trail is on, who wrote each slot.
pub(crate) struct Storage {
    arena: Arena,
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
        let bytes = pages * page_stride(&geometry, page_size) * geometry.dtype.size_bytes();
        let arena = Arena::zeroed(bytes).ok_or(bytes)?;
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
            arena,
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

    /// The arena's address and length in bytes, for a transport that
    /// registers it to read held pages in place (NIXL). Reading through it
    /// is the transport's business: it may read only rows that
    /// [`KvSeq::read_rows`](crate::kv::KvSeq) hands out, of pages held for
    /// it.
    #[cfg(feature = "nixl")]
    pub(crate) fn span(&self) -> (usize, usize) {
        (self.arena.ptr.as_ptr() as usize, self.arena.layout.size())
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

    /// Elements `[start, start + len)`, in range (checked by `offset`).
    ///
    /// # Safety
    /// No one may write these elements while the returned slice lives.
    unsafe fn slice(&self, start: usize, len: usize) -> KvSlice<'_> {
        let esz = self.geometry.dtype.size_bytes();
        // SAFETY: in range of the arena (the caller's offset was checked), and
        // aligned for the dtype (arena aligned to 16, offsets in elements).
        let p = unsafe { self.arena.ptr.as_ptr().add(start * esz) };
        // SAFETY: in range and aligned as above; no writer, per the contract.
        unsafe {
            match self.geometry.dtype {
                KvDtype::F32 => KvSlice::F32(std::slice::from_raw_parts(p.cast(), len)),
                KvDtype::F16 => KvSlice::F16(std::slice::from_raw_parts(p.cast(), len)),
                KvDtype::BF16 => KvSlice::BF16(std::slice::from_raw_parts(p.cast(), len)),
            }
        }
    }

    /// Elements `[start, start + len)` as bytes, in range (checked by
    /// `offset`).
    ///
    /// # Safety
    /// No one else may read or write these elements while the returned slice
    /// lives.
    #[allow(clippy::mut_from_ref)]
    unsafe fn bytes_mut(&self, start: usize, len: usize) -> &mut [u8] {
        let esz = self.geometry.dtype.size_bytes();
        // SAFETY: in range of the arena; exclusive per the contract.
        unsafe {
            std::slice::from_raw_parts_mut(self.arena.ptr.as_ptr().add(start * esz), len * esz)
        }
    }

    #[inline]
    fn writer_index(&self, page: u32, layer: usize, slot: usize) -> usize {
        (page as usize * self.geometry.n_layers + layer) * self.page_size + slot
    }

    /// True when the audit trail is on.
    pub(crate) fn audited(&self) -> bool {
        self.writers.is_some()
    }

    /// The recorded writers of slots `[slot, slot + n)` of one page and
    /// layer (`RequestId + 1`, 0 for never written), or `None` when the
    /// audit trail is off or the slots are out of range: a caller that
    /// audits checks [`Storage::audited`] first and treats `None` as a
    /// failed audit.
    pub(crate) fn writers(
        &self,
        page: u32,
        layer: usize,
        slot: usize,
        n: usize,
    ) -> Option<impl Iterator<Item = u64> + '_> {
        let i = self.writer_index(page, layer, slot);
        let w = self.writers.as_ref()?.get(i..i + n)?;
        Some(w.iter().map(|x| x.load(Ordering::Relaxed)))
    }

    /// Records `writer` for `n` consecutive slots of one page and layer.
    /// The trail is bookkeeping beside the bytes, in atomics: a wrong
    /// record can only make a read fail its audit, never touch data.
    pub(crate) fn record_writers(
        &self,
        page: u32,
        layer: usize,
        slot: usize,
        n: usize,
        writer: u64,
    ) {
        let i = self.writer_index(page, layer, slot);
        if let Some(w) = self.writers.as_ref().and_then(|w| w.get(i..i + n)) {
            for x in w {
                x.store(writer + 1, Ordering::Relaxed);
            }
        }
    }

    fn clear_writers(&self, page: u32) {
        let n = self.geometry.n_layers * self.page_size;
        let s = page as usize * n;
        if let Some(w) = self.writers.as_ref().and_then(|w| w.get(s..s + n)) {
            for x in w {
                x.store(0, Ordering::Relaxed);
            }
        }
        self.set_publisher(page, 0, 0);
    }

    fn set_publisher(&self, page: u32, request: u64, tenant: u64) {
        let i = page as usize * 2;
        if let Some(p) = self.publishers.as_ref().and_then(|p| p.get(i..i + 2)) {
            p[0].store(request, Ordering::Relaxed);
            p[1].store(tenant, Ordering::Relaxed);
        }
    }

    /// Records, in the audit trail, who published `page` into the cache.
    pub(crate) fn record_publisher(&self, page: u32, request: RequestId, tenant: TenantId) {
        self.set_publisher(page, request.0 + 1, u64::from(tenant.0) + 1);
    }

    /// The recorded publisher of `page` (`RequestId + 1`, `TenantId + 1`;
    /// zeros for a page never published since its last scrub), or `None`
    /// with the audit trail off or a page out of range.
    pub(crate) fn publisher(&self, page: u32) -> Option<(u64, u64)> {
        let i = page as usize * 2;
        let p = self.publishers.as_ref()?.get(i..i + 2)?;
        Some((p[0].load(Ordering::Relaxed), p[1].load(Ordering::Relaxed)))
    }

    /// Scrubs a cached page that eviction has just taken out of the cache,
    /// per `fill` (zero, poison, or bytes left), and clears its audit trail.
    /// The caller holds the pool's bookkeeping lock and has seen the page
    /// cached with no reader: no sequence's page table holds it (a lease is
    /// a reader), and no lookup can lease it until the lock is released.
    pub(crate) fn scrub_evicted(&self, page: u32, fill: Option<bool>, _locked: &Meta) {
        if (page as usize) >= self.pages {
            return;
        }
        if let Some(poison) = fill {
            let stride = self.page_stride();
            self.track(page, true);
            // SAFETY: in range (checked); no handle can reach the page (see
            // above), so this is the only reference to its bytes.
            let bytes = unsafe { self.bytes_mut(page as usize * stride, stride) };
            fill_page(self.geometry.dtype, bytes, poison);
        }
        self.clear_writers(page);
    }

    /// A free page's elements as f32, for the pool's scrub audit. The
    /// caller holds the pool's bookkeeping lock and has seen the page free:
    /// no handle owns it, and none can until the lock is released.
    pub(crate) fn free_page_f32(&self, page: u32, _bookkeeping_locked: &Meta) -> Vec<f32> {
        let stride = self.page_stride();
        let mut out = vec![0f32; stride];
        if (page as usize) < self.pages {
            self.track(page, false);
            // SAFETY: in range (checked); the page is free and the pool's
            // bookkeeping lock is held, so nothing writes it meanwhile.
            let s = unsafe { self.slice(page as usize * stride, stride) };
            s.to_f32_into(&mut out);
        }
        out
    }

    /// True when no writer is recorded for any slot of `page` (always,
    /// with the audit trail off; never, for a page out of range).
    pub(crate) fn no_writers(&self, page: u32) -> bool {
        !self.audited()
            || (0..self.geometry.n_layers).all(|l| {
                self.writers(page, l, 0, self.page_size)
                    .is_some_and(|mut w| w.all(|x| x == 0))
            })
    }
}

/// Elements per page (K and V of every layer); the pool has checked with
/// [`checked_page_stride`] that it does not overflow.
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

/// Read access to the bytes of one sequence's pages, for as long as the
/// sequence is borrowed. Pages are addressed by their position in the
/// sequence: `pages[0]` is position `offset` (0 for a whole page table).
#[derive(Clone, Copy)]
pub(crate) struct PagesRead<'a> {
    st: &'a Storage,
    pages: &'a [PageId],
    offset: usize,
}

/// Write access to the bytes of one sequence's *private* pages, for as long
/// as the sequence is borrowed mutably. It holds only the pages after the
/// leased prefix, so a cached page cannot be reached through it.
pub(crate) struct PagesWrite<'a> {
    read: PagesRead<'a>,
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
        PagesWrite {
            read: PagesRead {
                st: &self.pool().shared.storage,
                pages: self.pages().get(shared..).unwrap_or(&[]),
                offset: shared,
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
        Some(unsafe { self.st.slice(off, len) })
    }

    /// Prefetches the K and V rows at `slot` of `layer` in the `i`-th page,
    /// where a decode step's next [`PagesWrite::store_kv_f32`] lands;
    /// nothing when out of range.
    #[inline]
    pub(crate) fn prefetch_kv(&self, i: usize, layer: usize, slot: usize) {
        let Some(page) = self.page(i) else {
            return;
        };
        let esz = self.st.geometry.dtype.size_bytes();
        for kv in 0..2 {
            if let Some(off) = self.st.offset(page, layer, kv, slot, 1) {
                prefetch(self.st.arena.ptr.as_ptr().wrapping_add(off * esz));
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
    /// sequence's `i`-th page as raw bytes, or `None` when out of range or
    /// the page is not private.
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
        let page = self.read.page(i)?;
        let off = st.offset(page, layer, kv, slot, n)?;
        st.track(page, true);
        // SAFETY: in range (offset checked); the page is one of the private
        // pages of the sequence borrowed mutably for this writer's life, and
        // `&mut self` makes the returned rows the only live reference into it.
        Some(unsafe { st.bytes_mut(off, n * st.geometry.kv_dim()) })
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
    /// written when out of range (the caller checked the reservation).
    pub(crate) fn store_kv_f32(
        &mut self,
        i: usize,
        layer: usize,
        slot: usize,
        k: &[f32],
        v: &[f32],
        writer: u64,
    ) {
        fn put<T: KvElem>(dst: &mut [u8], src: &[f32]) {
            // The arena is aligned for every dtype, so the typed view exists;
            // the byte loop only keeps this total.
            match bytemuck::try_cast_slice_mut::<u8, T>(dst) {
                Ok(d) => {
                    for (d, s) in d.iter_mut().zip(src) {
                        *d = T::from_f32(*s);
                    }
                }
                Err(_) => {
                    for (d, s) in dst.chunks_exact_mut(std::mem::size_of::<T>()).zip(src) {
                        d.copy_from_slice(bytemuck::bytes_of(&T::from_f32(*s)));
                    }
                }
            }
        }
        let st = self.read.st;
        let kvd = st.geometry.kv_dim();
        let n = k.len() / kvd.max(1);
        if v.len() != k.len() {
            return;
        }
        let Some(page) = self.read.page(i) else {
            return;
        };
        let (Some(ko), Some(vo)) = (
            st.offset(page, layer, 0, slot, n),
            st.offset(page, layer, 1, slot, n),
        ) else {
            return;
        };
        st.track(page, true);
        for (off, src) in [(ko, k), (vo, v)] {
            // SAFETY: in range (both offsets checked for `n` rows); the page
            // is a private page of the sequence borrowed mutably for this
            // writer's life, and `&mut self` makes these rows the only live
            // reference into it.
            let dst = unsafe { st.bytes_mut(off, src.len()) };
            match st.geometry.dtype {
                KvDtype::F32 => dst.copy_from_slice(bytemuck::cast_slice(src)),
                KvDtype::F16 => put::<f16>(dst, src),
                KvDtype::BF16 => put::<bf16>(dst, src),
            }
        }
        st.record_writers(page, layer, slot, n, writer);
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

    /// Overwrites every private page with `fill` (zero or poison) and clears
    /// its audit trail: the scrub before the pages go back to the pool.
    pub(crate) fn scrub(&mut self, poison: Option<bool>) {
        let PagesRead { st, pages, .. } = self.read;
        let stride = st.page_stride();
        for p in pages {
            if (p.index as usize) >= st.pages {
                continue;
            }
            if let Some(poison) = poison {
                st.track(p.index, true);
                // SAFETY: in range (checked); the page is a private page of
                // the sequence borrowed mutably for this writer's life.
                let bytes = unsafe { st.bytes_mut(p.index as usize * stride, stride) };
                fill_page(st.geometry.dtype, bytes, poison);
            }
            st.clear_writers(p.index);
        }
    }
}

/// Fills a page's bytes with zeros or the dtype's poison.
fn fill_page(dtype: KvDtype, bytes: &mut [u8], poison: bool) {
    fn fill<T: KvElem>(bytes: &mut [u8], poison: bool) {
        if !poison {
            bytes.fill(0);
            return;
        }
        let v = T::POISON;
        for d in bytes.chunks_exact_mut(std::mem::size_of::<T>()) {
            d.copy_from_slice(bytemuck::bytes_of(&v));
        }
    }
    match dtype {
        KvDtype::F32 => fill::<f32>(bytes, poison),
        KvDtype::F16 => fill::<f16>(bytes, poison),
        KvDtype::BF16 => fill::<bf16>(bytes, poison),
    }
}
