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

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use half::{bf16, f16};

use crate::ids::{RequestId, TenantId};
use crate::kv::device::{DeviceError, DevicePages, Residence};
use crate::kv::pool::Meta;
use crate::kv::seq::{KvSeq, SeqState};
use crate::kv::{F8E4M3, PageId};
use crate::kv::{KvDtype, KvError, KvGeometry, PoolError};

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

impl KvElem for F8E4M3 {
    const DTYPE: KvDtype = KvDtype::F8E4M3;
    const ZERO: Self = F8E4M3::ZERO;
    const POISON: Self = F8E4M3::NAN;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        F8E4M3::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        F8E4M3::from_f32(x)
    }
}

impl<'a> KvSlice<'a> {
    /// The raw bytes, for as long as the elements are borrowed.
    pub fn into_bytes(self) -> &'a [u8] {
        match self {
            KvSlice::F32(s) => bytemuck::cast_slice(s),
            KvSlice::F16(s) => bytemuck::cast_slice(s),
            KvSlice::BF16(s) => bytemuck::cast_slice(s),
            KvSlice::F8E4M3(s) => bytemuck::cast_slice(s),
        }
    }
}

/// A borrowed run of stored elements, typed by the pool's dtype.
#[derive(Clone, Copy, Debug)]
pub enum KvSlice<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
    F8E4M3(&'a [F8E4M3]),
}

impl KvSlice<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            KvSlice::F32(s) => s.len(),
            KvSlice::F16(s) => s.len(),
            KvSlice::BF16(s) => s.len(),
            KvSlice::F8E4M3(s) => s.len(),
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
            KvSlice::F8E4M3(s) => bytemuck::cast_slice(s),
        }
    }
    /// Converts to f32 into `out` (same length).
    pub fn to_f32_into(&self, out: &mut [f32]) {
        fn conv<T: KvElem>(s: &[T], out: &mut [f32]) {
            for (o, x) in out.iter_mut().zip(s) {
                *o = x.to_f32();
            }
        }
        use half::slice::HalfFloatSliceExt;
        match self {
            KvSlice::F32(s) => out.copy_from_slice(s),
            // 8 at a time with F16C where the CPU has it (detected at run
            // time), instead of a detection and one conversion per value.
            KvSlice::F16(s) => s.convert_to_f32_slice(out),
            KvSlice::BF16(s) => conv(s, out),
            KvSlice::F8E4M3(s) => conv(s, out),
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

/// Where the bytes are.
enum Bytes {
    Host(Arena),
    Device(Box<dyn DevicePages>),
}

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

    /// Fills elements `[start, start + len)` with zeros or the poison, in
    /// range (checked by the caller).
    ///
    /// # Safety
    /// No one else may read or write these elements meanwhile.
    unsafe fn fill(&self, start: usize, len: usize, poison: bool) -> Result<(), KvError> {
        match &self.bytes {
            Bytes::Host(_) => {
                // SAFETY: in range and exclusive, per the contract.
                let bytes = unsafe { self.bytes_mut(start, len) };
                fill_page(self.geometry.dtype, bytes, poison);
                Ok(())
            }
            Bytes::Device(d) => {
                let esz = self.geometry.dtype.size_bytes();
                let element = element_bytes(self.geometry.dtype, poison);
                d.fill(start * esz, len * esz, &element)
                    .map_err(|e| self.device_failed(e))
            }
        }
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
    /// `None` for device storage (no host address).
    unsafe fn slice(&self, start: usize, len: usize) -> Option<KvSlice<'_>> {
        let Bytes::Host(arena) = &self.bytes else {
            return None;
        };
        let esz = self.geometry.dtype.size_bytes();
        // SAFETY: in range of the arena (the caller's offset was checked), and
        // aligned for the dtype (arena aligned to 16, offsets in elements).
        let p = unsafe { arena.ptr.as_ptr().add(start * esz) };
        // SAFETY: in range and aligned as above; no writer, per the contract.
        Some(unsafe {
            match self.geometry.dtype {
                KvDtype::F32 => KvSlice::F32(std::slice::from_raw_parts(p.cast(), len)),
                KvDtype::F16 => KvSlice::F16(std::slice::from_raw_parts(p.cast(), len)),
                KvDtype::BF16 => KvSlice::BF16(std::slice::from_raw_parts(p.cast(), len)),
                KvDtype::F8E4M3 => KvSlice::F8E4M3(std::slice::from_raw_parts(p.cast(), len)),
            }
        })
    }

    /// Elements `[start, start + len)` as bytes, in range (checked by
    /// `offset`), of host storage (empty for device storage, which callers
    /// have ruled out).
    ///
    /// # Safety
    /// No one else may read or write these elements while the returned slice
    /// lives.
    #[allow(clippy::mut_from_ref)]
    unsafe fn bytes_mut(&self, start: usize, len: usize) -> &mut [u8] {
        let Bytes::Host(arena) = &self.bytes else {
            return &mut [];
        };
        let esz = self.geometry.dtype.size_bytes();
        // SAFETY: in range of the arena; exclusive per the contract.
        unsafe { std::slice::from_raw_parts_mut(arena.ptr.as_ptr().add(start * esz), len * esz) }
    }

    /// Reads elements `[start, start + len)` into `dst` (`len` elements'
    /// bytes), in range (checked by `offset`).
    ///
    /// # Safety
    /// No one may write these elements meanwhile.
    unsafe fn read_into(&self, start: usize, dst: &mut [u8]) -> Result<(), KvError> {
        let esz = self.geometry.dtype.size_bytes();
        match &self.bytes {
            Bytes::Host(_) => {
                // SAFETY: per the contract.
                if let Some(s) = unsafe { self.slice(start, dst.len() / esz) } {
                    dst.copy_from_slice(s.as_bytes());
                }
                Ok(())
            }
            Bytes::Device(d) => d.read(start * esz, dst).map_err(|e| self.device_failed(e)),
        }
    }

    /// Writes `src` over elements from `start`, in range (checked by
    /// `offset`).
    ///
    /// # Safety
    /// No one else may read or write these elements meanwhile.
    unsafe fn write_from(&self, start: usize, src: &[u8]) -> Result<(), KvError> {
        let esz = self.geometry.dtype.size_bytes();
        match &self.bytes {
            Bytes::Host(_) => {
                // SAFETY: per the contract.
                unsafe { self.bytes_mut(start, src.len() / esz) }.copy_from_slice(src);
                Ok(())
            }
            Bytes::Device(d) => d.write(start * esz, src).map_err(|e| self.device_failed(e)),
        }
    }

    /// Writes runs of elements `(start, len)` (in range, checked by
    /// `offset`), each run's bytes given by `fill(run, dst)`: in place for
    /// host storage, as one staged pass for device storage.
    ///
    /// # Safety
    /// No one else may read or write these elements meanwhile.
    unsafe fn write_runs(
        &self,
        runs: &[(usize, usize)],
        fill: &mut dyn FnMut(usize, &mut [u8]),
    ) -> Result<(), KvError> {
        let esz = self.geometry.dtype.size_bytes();
        match &self.bytes {
            Bytes::Host(_) => {
                for (i, &(start, len)) in runs.iter().enumerate() {
                    // SAFETY: per the contract; one run's slice at a time.
                    fill(i, unsafe { self.bytes_mut(start, len) });
                }
                Ok(())
            }
            Bytes::Device(d) => {
                let bytes: Vec<_> = runs.iter().map(|&(s, n)| (s * esz, n * esz)).collect();
                d.write_runs(&bytes, fill)
                    .map_err(|e| self.device_failed(e))
            }
        }
    }

    /// Reads runs of elements `(start, len)` (in range, checked by
    /// `offset`) and hands each run's bytes to `take(run, bytes)`: in place
    /// for host storage, as one staged pass for device storage.
    ///
    /// # Safety
    /// No one may write these elements meanwhile.
    unsafe fn read_runs(
        &self,
        runs: &[(usize, usize)],
        take: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<(), KvError> {
        let esz = self.geometry.dtype.size_bytes();
        match &self.bytes {
            Bytes::Host(_) => {
                for (i, &(start, len)) in runs.iter().enumerate() {
                    // SAFETY: per the contract.
                    if let Some(s) = unsafe { self.slice(start, len) } {
                        take(i, s.as_bytes());
                    }
                }
                Ok(())
            }
            Bytes::Device(d) => {
                let bytes: Vec<_> = runs.iter().map(|&(s, n)| (s * esz, n * esz)).collect();
                d.read_runs(&bytes, take).map_err(|e| self.device_failed(e))
            }
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
            // above), so this is the only reference to its bytes. A device
            // failure marks the storage failed (no page is handed out).
            let _ = unsafe { self.fill(page as usize * stride, stride, poison) };
        }
        self.clear_writers(page);
    }

    /// A free page's elements as f32, for the pool's scrub audit. The
    /// caller holds the pool's bookkeeping lock and has seen the page free:
    /// no handle owns it, and none can until the lock is released.
    /// `None` when the page is out of range or its bytes cannot be read.
    pub(crate) fn free_page_f32(&self, page: u32, _bookkeeping_locked: &Meta) -> Option<Vec<f32>> {
        let stride = self.page_stride();
        if (page as usize) >= self.pages {
            return None;
        }
        self.track(page, false);
        let mut bytes = vec![0u8; stride * self.geometry.dtype.size_bytes()];
        // SAFETY: in range (checked); the page is free and the pool's
        // bookkeeping lock is held, so nothing writes it meanwhile.
        unsafe { self.read_into(page as usize * stride, &mut bytes) }.ok()?;
        let mut out = vec![0f32; stride];
        bytes_to_f32(self.geometry.dtype, &bytes, &mut out);
        Some(out)
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
                // the sequence borrowed mutably for this writer's life. A
                // device failure marks the storage failed, so the page is
                // never handed out unscrubbed.
                let _ = unsafe { st.fill(p.index as usize * stride, stride, poison) };
            }
            st.clear_writers(p.index);
        }
    }
}

/// One element of zeros or of the dtype's poison, as bytes.
fn element_bytes(dtype: KvDtype, poison: bool) -> Vec<u8> {
    let mut out = vec![0u8; dtype.size_bytes()];
    if poison {
        fill_page(dtype, &mut out, true);
    }
    out
}

/// Converts stored elements' bytes to f32 (`out` has one per element).
pub(crate) fn bytes_to_f32(dtype: KvDtype, bytes: &[u8], out: &mut [f32]) {
    fn conv<T: KvElem>(bytes: &[u8], out: &mut [f32]) {
        let esz = std::mem::size_of::<T>();
        for (o, b) in out.iter_mut().zip(bytes.chunks_exact(esz)) {
            *o = bytemuck::pod_read_unaligned::<T>(b).to_f32();
        }
    }
    match dtype {
        KvDtype::F32 => conv::<f32>(bytes, out),
        KvDtype::F16 => conv::<f16>(bytes, out),
        KvDtype::BF16 => conv::<bf16>(bytes, out),
        KvDtype::F8E4M3 => conv::<F8E4M3>(bytes, out),
    }
}

/// Writes f32 values converted to the storage dtype into `dst` (one
/// element's bytes per value).
fn store_f32(dtype: KvDtype, dst: &mut [u8], src: &[f32]) {
    fn put<T: KvElem>(dst: &mut [u8], src: &[f32]) {
        // The arena is aligned for every dtype, so the typed view exists
        // there; a staging buffer may not be, hence the byte loop.
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
    match dtype {
        KvDtype::F32 => dst.copy_from_slice(bytemuck::cast_slice(src)),
        KvDtype::F16 => put::<f16>(dst, src),
        KvDtype::BF16 => put::<bf16>(dst, src),
        KvDtype::F8E4M3 => put::<F8E4M3>(dst, src),
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
        KvDtype::F8E4M3 => fill::<F8E4M3>(bytes, poison),
    }
}
