//! The page pool: fixed capacity, O(1) allocation and release, generations,
//! and the accounting invariant `free + in_use + held + cached == capacity`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::kv::pages_for;
use crate::sync::{Arc, Mutex};

use crate::ids::RequestId;
use crate::kv::cache_index::CacheIndex;
use crate::kv::device::{DevicePages, Residence};
use crate::kv::page::{PageEntry, PageState, PoolId};
use crate::kv::seq::{Filling, KvSeq, Received, SeqState};
use crate::kv::storage::{Storage, prefetch};
use crate::kv::{KvError, KvGeometry, KvReader, PageId, PoolError};

/// What happens to a page's bytes when it returns to the pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ScrubPolicy {
    /// Zero the page (default).
    #[default]
    Zero,
    /// Fill with a poison pattern (NaN) so that any stale read is loud.
    /// For debugging and for GPU backends that cannot audit every read.
    Poison,
    /// Leave the bytes. Reads are still limited to written positions, so this
    /// is safe by construction, but loses the defence in depth: choose it only
    /// when the scrub's cost (see benches/kv_pool.rs) matters more.
    AcceptStaleBytes,
}

/// Shape and size of a pool. Usually obtained from
/// `EngineConfig::pool_config` (the config layer above), which has checked it against the
/// context window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    geometry: KvGeometry,
    page_size: usize,
    pages: usize,
    scrub: ScrubPolicy,
    audit: bool,
}

impl PoolConfig {
    /// A pool of `pages` pages of `page_size` token slots each.
    pub fn new(geometry: KvGeometry, page_size: usize, pages: usize) -> Self {
        PoolConfig {
            geometry,
            page_size,
            pages,
            scrub: ScrubPolicy::default(),
            audit: cfg!(any(debug_assertions, feature = "audit")),
        }
    }
    /// Turns the audit trail on or off. Default: on in debug builds (so in
    /// `cargo test`) and with the `audit` feature, off otherwise. When on,
    /// every slot records its writer and every read checks it.
    #[must_use]
    pub fn audit(mut self, on: bool) -> Self {
        self.audit = on;
        self
    }
    /// True when the audit trail is on.
    pub fn audit_enabled(&self) -> bool {
        self.audit
    }
    /// Sets the scrub policy for released pages.
    #[must_use]
    pub fn scrub(mut self, policy: ScrubPolicy) -> Self {
        self.scrub = policy;
        self
    }
    pub fn geometry(&self) -> KvGeometry {
        self.geometry
    }
    pub fn page_size(&self) -> usize {
        self.page_size
    }
    pub fn pages(&self) -> usize {
        self.pages
    }
    pub fn scrub_policy(&self) -> ScrubPolicy {
        self.scrub
    }
    /// Bytes of page storage this pool holds (what
    /// [`KvPool::with_device_pages`] needs of a device), or `None` when
    /// that overflows.
    pub fn storage_bytes(&self) -> Option<usize> {
        crate::kv::storage::checked_page_stride(&self.geometry, self.page_size)?
            .checked_mul(self.pages)?
            .checked_mul(self.geometry.dtype.size_bytes())
    }
}

/// A snapshot of pool accounting.
/// `free + in_use + held + cached == capacity` always.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolStats {
    pub capacity: usize,
    pub free: usize,
    pub in_use: usize,
    /// Pages out of use that a write may still land in (deferred release).
    pub held: usize,
    /// Pages in the prefix cache (shared, read-only), with or without readers.
    pub cached: usize,
    /// Cached pages no sequence reads: reclaimable, evicted (scrubbed) when
    /// an allocation needs them, so admission counts them as available.
    pub cached_idle: usize,
    /// Isolation violations detected by the audit trail (always 0 without
    /// the `audit` feature, which does not check).
    pub isolation_violations: u64,
}

impl PoolStats {
    /// True when every page is back: nothing in use, nothing held, and each
    /// page free or cached with no reader (reclaimable). Without a prefix
    /// cache that is every page free; [`PoolStats::all_free`] also asks
    /// that the cache be empty.
    pub fn is_full(&self) -> bool {
        self.in_use == 0
            && self.held == 0
            && self.cached == self.cached_idle
            && self.free + self.cached_idle == self.capacity
    }
    /// True when every page is on the free list (no cached page either).
    pub fn all_free(&self) -> bool {
        self.is_full() && self.free == self.capacity
    }
    /// Pages an allocation can have now: free plus idle cached pages.
    pub fn available(&self) -> usize {
        self.free + self.cached_idle
    }
    /// True when the accounting invariant holds.
    pub fn balanced(&self) -> bool {
        self.cached_idle <= self.cached
            && self.free + self.in_use + self.held + self.cached == self.capacity
    }
}

pub(crate) struct Meta {
    pub(super) free: Vec<u32>,
    /// Each page's generation and state.
    pub(super) pages: Vec<PageEntry>,
    pub(super) in_use: usize,
    pub(super) held: usize,
    /// The prefix cache's index (pages in state `Cached`).
    pub(super) cache: CacheIndex,
}

pub(crate) struct Shared {
    pub(crate) id: PoolId,
    pub(crate) cfg: PoolConfig,
    pub(crate) meta: Mutex<Meta>,
    pub(crate) storage: Storage,
    pub(crate) violations: AtomicU64,
    /// Set once a worker took this pool as its own (see [`KvPool::claim`]).
    claimed: AtomicBool,
}

/// A fixed-capacity pool of KV pages. Cheap to clone (a shared handle).
///
/// Pages are handed out inside a [`KvSeq`], which owns them until it is
/// dropped or released; no other API gives access to page bytes.
#[derive(Clone)]
pub struct KvPool {
    pub(crate) shared: Arc<Shared>,
}

impl std::fmt::Debug for KvPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvPool")
            .field("config", &self.shared.cfg)
            .field("stats", &self.stats())
            .finish()
    }
}

impl KvPool {
    /// Builds a pool in host memory. Storage is allocated lazily by the OS
    /// (zeroed pages).
    pub fn new(cfg: PoolConfig) -> Result<Self, PoolError> {
        Self::validate(&cfg)?;
        let storage = Storage::new(cfg.geometry, cfg.page_size, cfg.pages, cfg.audit)
            .map_err(|bytes| PoolError::OutOfMemory { bytes })?;
        Ok(Self::with_storage(cfg, storage))
    }

    /// Builds a pool whose page bytes live in `pages`, a backend's device
    /// memory ([`DevicePages`]); ownership, generations, written counts and
    /// the audit trail stay on the host. The memory is zeroed before any
    /// page is handed out. Views of such a pool give page tables for the
    /// backend's kernels and no rows in place
    /// ([`crate::kv::LayerView::copy_key_f32`] stages a copy).
    pub fn with_device_pages(
        cfg: PoolConfig,
        pages: Box<dyn DevicePages>,
    ) -> Result<Self, PoolError> {
        Self::validate(&cfg)?;
        let need = Storage::bytes_for(&cfg.geometry, cfg.page_size, cfg.pages);
        if pages.len() < need {
            return Err(PoolError::DeviceTooSmall {
                have: pages.len(),
                need,
            });
        }
        let storage = Storage::on_device(cfg.geometry, cfg.page_size, cfg.pages, cfg.audit, pages)?;
        Ok(Self::with_storage(cfg, storage))
    }

    /// Where this pool's page bytes live.
    pub fn residence(&self) -> Residence {
        self.shared.storage.residence()
    }

    /// The device storage, for the backend that made it (`None` in host
    /// memory).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn device_pages(&self) -> Option<&dyn DevicePages> {
        self.shared.storage.device_pages()
    }

    fn validate(cfg: &PoolConfig) -> Result<(), PoolError> {
        cfg.geometry.validate()?;
        if cfg.page_size == 0 || !cfg.page_size.is_power_of_two() {
            return Err(PoolError::PageSizeNotPowerOfTwo {
                page_size: cfg.page_size,
            });
        }
        if cfg.pages == 0 {
            return Err(PoolError::Zero { field: "pages" });
        }
        if u32::try_from(cfg.pages).is_err() {
            return Err(PoolError::Overflow {
                what: "page count (at most u32::MAX pages)",
            });
        }
        crate::kv::storage::checked_page_stride(&cfg.geometry, cfg.page_size)
            .and_then(|n| n.checked_mul(cfg.pages))
            .and_then(|n| n.checked_mul(cfg.geometry.dtype.size_bytes()))
            .filter(|&bytes| bytes <= isize::MAX as usize)
            .ok_or(PoolError::Overflow { what: "pool size" })?;
        if cfg.audit {
            // One writer id (8 bytes) per slot of every layer.
            cfg.pages
                .checked_mul(cfg.geometry.n_layers)
                .and_then(|n| n.checked_mul(cfg.page_size))
                .and_then(|n| n.checked_mul(8))
                .filter(|&bytes| bytes <= isize::MAX as usize)
                .ok_or(PoolError::Overflow {
                    what: "audit trail size",
                })?;
        }
        Ok(())
    }

    fn with_storage(cfg: PoolConfig, storage: Storage) -> Self {
        // Free list popped from the end: hand out low indices first.
        let free: Vec<u32> = (0..cfg.pages as u32).rev().collect();
        KvPool {
            shared: Arc::new(Shared {
                id: PoolId::fresh(),
                meta: Mutex::new(Meta {
                    free,
                    pages: vec![PageEntry::default(); cfg.pages],
                    in_use: 0,
                    held: 0,
                    cache: CacheIndex::new(cfg.pages),
                }),
                storage,
                violations: AtomicU64::new(0),
                claimed: AtomicBool::new(false),
                cfg,
            }),
        }
    }

    /// Marks the pool as one worker's own; false if a worker already took
    /// it. A worker admits against the pages it sees free, so two workers
    /// (or a worker and a host reserving on a clone) on one pool would
    /// turn away each other's admitted requests.
    pub(crate) fn claim(&self) -> bool {
        !self.shared.claimed.swap(true, Ordering::AcqRel)
    }

    /// The pool's configuration.
    pub fn config(&self) -> &PoolConfig {
        &self.shared.cfg
    }

    /// Token slots per page.
    pub fn page_size(&self) -> usize {
        self.shared.cfg.page_size
    }

    /// Total pages.
    pub fn capacity(&self) -> usize {
        self.shared.cfg.pages
    }

    /// The page arena's address and length in bytes (see
    /// `Storage::span`).
    /// `None` for a device-resident pool.
    #[cfg(feature = "nixl")]
    pub(crate) fn arena_span(&self) -> Option<(usize, usize)> {
        self.shared.storage.span()
    }

    /// Pages a sequence of `tokens` tokens needs.
    pub fn pages_for(&self, tokens: usize) -> usize {
        pages_for(tokens, self.page_size())
    }

    /// A consistent snapshot of the accounting.
    pub fn stats(&self) -> PoolStats {
        let m = self.shared.meta.lock();
        PoolStats {
            capacity: self.shared.cfg.pages,
            free: m.free.len(),
            in_use: m.in_use,
            held: m.held,
            cached: m.cache.cached(),
            cached_idle: m.cache.idle(),
            isolation_violations: self.shared.violations.load(Ordering::Relaxed),
        }
    }

    /// The counters of the prefix cache over this pool (all zero when no
    /// [`crate::kv::PrefixCache`] uses it): a server's cache is reachable
    /// through its pool.
    pub fn cache_counters(&self) -> crate::kv::CacheCounters {
        self.shared.meta.lock().cache.counters
    }

    /// Reserves room for `tokens` tokens (all layers) for `owner`. Fails with
    /// [`KvError::NeverFits`] when the pool could never hold that many, and
    /// [`KvError::Exhausted`] when it cannot now; nothing is allocated then.
    pub fn reserve(&self, owner: RequestId, tokens: usize) -> Result<KvSeq<Filling>, KvError> {
        self.reserve_in_state(owner, tokens)
    }

    /// Reserves destination pages for KV that a peer will write. Only the
    /// transfer verifier can turn the result into readable KV.
    pub(crate) fn reserve_for_receive(
        &self,
        owner: RequestId,
        tokens: usize,
    ) -> Result<KvSeq<Received>, KvError> {
        self.reserve_in_state(owner, tokens)
    }

    fn reserve_in_state<S: SeqState>(
        &self,
        owner: RequestId,
        tokens: usize,
    ) -> Result<KvSeq<S>, KvError> {
        let pages = self.alloc_pages(self.pages_for(tokens))?;
        Ok(KvSeq::new(self.clone(), owner, pages))
    }

    /// Takes `n` pages off the free list, bumping each page's generation.
    pub(crate) fn alloc_pages(&self, n: usize) -> Result<Vec<PageId>, KvError> {
        let capacity = self.shared.cfg.pages;
        if n > capacity {
            return Err(KvError::NeverFits {
                tokens: n.saturating_mul(self.page_size()),
                capacity_tokens: capacity * self.page_size(),
            });
        }
        let mut m = self.shared.meta.lock();
        if let Some(e) = self.shared.storage.failure() {
            return Err(KvError::Device(e));
        }
        if n > m.free.len() + m.cache.idle() {
            return Err(KvError::Exhausted {
                requested: n,
                free: m.free.len() + m.cache.idle(),
                capacity,
            });
        }
        // Idle cached pages count as available: evict (and scrub) the least
        // recently used until the free list covers the request.
        while m.free.len() < n {
            if !self.evict_one(&mut m) {
                break;
            }
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            // Checked above: n <= free.len().
            let Some(index) = m.free.pop() else { break };
            let generation = m.pages[index as usize].hand_out();
            out.push(PageId {
                pool: self.shared.id,
                index,
                generation,
            });
        }
        m.in_use += out.len();
        Ok(out)
    }

    /// Frees pages that were in `from` state. The owning handle has
    /// scrubbed them (per [`KvPool::scrub_fill`]) before giving them up.
    pub(crate) fn free_pages(&self, pages: &[PageId], from: PageState) {
        if pages.is_empty() {
            return;
        }
        let mut m = self.shared.meta.lock();
        for p in pages {
            let e = &mut m.pages[p.index as usize];
            debug_assert!(e.is(p.generation, from));
            e.set_state(PageState::Free);
            m.free.push(p.index);
        }
        match from {
            PageState::InUse => m.in_use -= pages.len(),
            PageState::Held => m.held -= pages.len(),
            PageState::Free | PageState::Cached => {}
        }
    }

    /// What the scrub writes into released pages: `Some(false)` zeros,
    /// `Some(true)` poison, `None` nothing (the audit trail is cleared
    /// either way).
    pub(crate) fn scrub_fill(&self) -> Option<bool> {
        match self.shared.cfg.scrub {
            ScrubPolicy::Zero => Some(false),
            ScrubPolicy::Poison => Some(true),
            ScrubPolicy::AcceptStaleBytes => None,
        }
    }

    /// Moves pages between in-use and held.
    pub(crate) fn set_held(&self, pages: &[PageId], held: bool) {
        let mut m = self.shared.meta.lock();
        let (from, to) = if held {
            (PageState::InUse, PageState::Held)
        } else {
            (PageState::Held, PageState::InUse)
        };
        for p in pages {
            let e = &mut m.pages[p.index as usize];
            debug_assert_eq!(e.state(), from);
            e.set_state(to);
        }
        if held {
            m.in_use -= pages.len();
            m.held += pages.len();
        } else {
            m.held -= pages.len();
            m.in_use += pages.len();
        }
    }

    /// Checks that `page` belongs to this pool, is at its current generation
    /// and in the expected state.
    pub(crate) fn check_page(&self, page: PageId, held: bool) -> Result<(), KvError> {
        self.check_pages(std::slice::from_ref(&page), held)
    }

    /// [`KvPool::check_page`] for every page of `pages`, under one lock of
    /// the pool's bookkeeping (readers on several threads validate their
    /// sequences every layer; one lock per page made them queue).
    pub(crate) fn check_pages(&self, pages: &[PageId], held: bool) -> Result<(), KvError> {
        self.check_seq_pages(pages, 0, held)
    }

    /// [`KvPool::check_pages`] for a sequence's page table whose first
    /// `shared` pages are its leased prefix: those must be cached, at their
    /// generation, with a reader (the lease); the rest in use (or held).
    pub(crate) fn check_seq_pages(
        &self,
        pages: &[PageId],
        shared: usize,
        held: bool,
    ) -> Result<(), KvError> {
        self.check_many_seqs(&[(pages, shared)], |&t| t, held)
            .map_err(|(_, e)| e)
    }

    /// [`KvPool::check_seq_pages`] for every sequence of a batch, each
    /// giving `table` its page table and leased-prefix length, under one
    /// lock of the pool's bookkeeping (a pass over a thousand sequences
    /// took a thousand locks a layer). The error names the failing
    /// sequence's place in the batch.
    pub(crate) fn check_many_seqs<T>(
        &self,
        seqs: &[T],
        table: impl Fn(&T) -> (&[PageId], usize),
        held: bool,
    ) -> Result<(), (usize, KvError)> {
        // Each sequence's page table and bookkeeping sit apart in memory, so
        // a pass over a thousand sequences would wait on each in turn: the
        // table of the sequence `AHEAD` places on is fetched while this one
        // is checked, and its first pages' entries on the next loop.
        const AHEAD: usize = 8;
        let ahead = |i: usize| seqs.get(i + AHEAD).map(&table);
        for (i, (pages, _)) in seqs.iter().map(&table).enumerate() {
            if let Some((next, _)) = ahead(i) {
                prefetch(next.as_ptr());
            }
            if let Some(&page) = pages
                .iter()
                .find(|p| p.pool != self.shared.id || p.index as usize >= self.shared.cfg.pages)
            {
                return Err((i, KvError::ForeignPage { page }));
            }
        }
        let want = if held {
            PageState::Held
        } else {
            PageState::InUse
        };
        let m = self.shared.meta.lock();
        for (i, (pages, shared)) in seqs.iter().map(&table).enumerate() {
            if let Some(&first) = ahead(i).and_then(|(next, _)| next.first()) {
                // In range: the first loop checked every index.
                prefetch(m.pages.as_ptr().wrapping_add(first.index as usize));
            }
            for (j, &page) in pages.iter().enumerate() {
                let e = m.pages[page.index as usize];
                let ok = if j < shared {
                    e.is(page.generation, PageState::Cached) && m.cache.readers(page.index) > 0
                } else {
                    e.is(page.generation, want)
                };
                if !ok {
                    let error = if e.generation() != page.generation {
                        KvError::StalePage {
                            page,
                            current: e.generation(),
                        }
                    } else {
                        KvError::PageNotInUse { page }
                    };
                    return Err((i, error));
                }
            }
        }
        Ok(())
    }

    /// A reader for a batch of reads (validation happens per sequence, in
    /// [`KvReader::seq`]; it takes no lock on the page bytes).
    pub fn reader(&self) -> KvReader<'_> {
        KvReader::new(self)
    }

    /// True when both handles refer to the same pool.
    pub fn same_pool(&self, other: &KvPool) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }

    pub(crate) fn record_violation(&self) {
        self.shared.violations.fetch_add(1, Ordering::Relaxed);
    }

    /// Audit check for tests: true when free page `index` holds exactly what
    /// the scrub policy leaves (zeros, poison, or anything when unscrubbed)
    /// and no writer is recorded for any of its slots. A page never handed
    /// out is all zeros.
    #[doc(hidden)]
    pub fn audit_page_matches_scrub(&self, index: u32) -> bool {
        // The bookkeeping lock stays held while the page is read: a free
        // page cannot be handed out (and written) meanwhile.
        let m = self.shared.meta.lock();
        let generation = match m.pages.get(index as usize) {
            Some(e) if e.state() == PageState::Free => e.generation(),
            _ => return false,
        };
        let st = &self.shared.storage;
        let Some(vals) = st.free_page_f32(index, &m) else {
            return false;
        };
        let no_writers = st.no_writers(index);
        let bytes_ok = match (generation, self.shared.cfg.scrub) {
            (0, _) | (_, ScrubPolicy::Zero) => vals.iter().all(|&x| x == 0.0),
            (_, ScrubPolicy::Poison) => vals.iter().all(|x| x.is_nan()),
            (_, ScrubPolicy::AcceptStaleBytes) => true,
        };
        no_writers && bytes_ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool() -> KvPool {
        KvPool::new(PoolConfig::new(KvGeometry::tiny(1, 2), 2, 4)).unwrap()
    }

    #[test]
    fn a_kept_page_id_is_stale_after_reuse() {
        let pool = pool();
        let a = pool.reserve(RequestId(1), 8).unwrap();
        let kept = a.pages()[0];
        assert!(pool.check_page(kept, false).is_ok());
        a.release();
        assert!(matches!(
            pool.check_page(kept, false),
            Err(KvError::PageNotInUse { .. })
        ));
        let _b = pool.reserve(RequestId(2), 8).unwrap();
        assert!(matches!(
            pool.check_page(kept, false),
            Err(KvError::StalePage { current: 2, .. })
        ));
    }

    #[test]
    fn a_batch_check_names_the_sequence_at_fault() {
        let (p1, p2) = (pool(), pool());
        let a = p1.reserve(RequestId(1), 2).unwrap();
        let b = p1.reserve(RequestId(2), 2).unwrap();
        let foreign = p2.reserve(RequestId(3), 2).unwrap();
        let reader = p1.reader();
        assert_eq!(reader.seqs([&a, &b]).map(|v| v.len()).ok(), Some(2));
        let err = reader.seqs([&a, &foreign, &b]).err();
        assert!(matches!(err, Some((1, KvError::ForeignPage { .. }))));
        // A page table kept past its release is stale at its place.
        let kept = b.pages().to_vec();
        b.release();
        let _c = p1.reserve(RequestId(4), 2).unwrap();
        let tables = [(a.pages(), 0), (&kept[..], 0)];
        let err = p1.check_many_seqs(&tables, |&t| t, false).err();
        assert!(matches!(err, Some((1, KvError::StalePage { .. }))));
    }

    #[test]
    fn a_read_checks_only_the_pages_holding_written_positions() {
        let pool = pool();
        let mut a = pool.reserve(RequestId(1), 8).unwrap();
        assert!(a.readable_pages().is_empty());
        a.append(0, &[1.0; 6], &[2.0; 6]).unwrap();
        assert_eq!(a.readable_pages(), &a.pages()[..2]);
        let reader = pool.reader();
        let view = reader.seq(&a).unwrap().layer(0).unwrap();
        assert_eq!((view.len(), view.n_pages()), (3, 2));
    }

    #[test]
    fn a_pass_checked_once_reads_what_it_appended_and_rechecks_a_changed_table() {
        let pool = pool();
        let mut a = pool.reserve(RequestId(1), 2).unwrap();
        a.append(0, &[1.0; 2], &[2.0; 2]).unwrap();
        let reader = pool.reader();
        // Checked for one more token: the whole first page.
        let check = reader.check_pass(&[&a], |_| 1).unwrap();
        a.append(0, &[3.0; 2], &[4.0; 2]).unwrap();
        assert!(
            check.covers(&[&a], &pool),
            "what the pass appended was checked"
        );
        let views = reader.pass_views(&check, [&a]).unwrap();
        assert_eq!(views[0].layer(0).unwrap().len(), 2);
        // A table that grew past what was checked is checked again.
        a.ensure_capacity(4).unwrap();
        assert!(
            !check.covers(&[&a], &pool),
            "a changed table is not covered"
        );
        a.append(0, &[5.0; 2], &[6.0; 2]).unwrap();
        let views = reader.pass_views(&check, [&a]).unwrap();
        assert_eq!(views[0].layer(0).unwrap().n_pages(), 2);
        // Rows past what the pass said it would append are checked again,
        // even in a table that did not change.
        let mut b = pool.reserve(RequestId(3), 4).unwrap();
        let check_b = reader.check_pass(&[&b], |_| 0).unwrap();
        b.append(0, &[7.0; 2], &[8.0; 2]).unwrap();
        assert!(!check_b.covers(&[&b], &pool), "an unchecked page is read");
        assert_eq!(reader.pass_views(&check_b, [&b]).unwrap().len(), 1);
        // And one from another pool is refused, at its place.
        let other = super::tests::pool().reserve(RequestId(2), 2).unwrap();
        let err = reader.pass_views(&check, [&other]).err();
        assert!(matches!(err, Some((0, KvError::ForeignPage { .. }))));
        let err = reader.check_pass(&[&a, &other], |_| 0).err();
        assert!(matches!(err, Some((1, KvError::ForeignPage { .. }))));
    }

    #[test]
    fn a_page_id_from_another_pool_is_foreign() {
        let (p1, p2) = (pool(), pool());
        let a = p1.reserve(RequestId(1), 2).unwrap();
        assert!(matches!(
            p2.check_page(a.pages()[0], false),
            Err(KvError::ForeignPage { .. })
        ));
    }

    #[test]
    fn the_audit_trail_reports_a_slot_written_by_someone_else() {
        // The audit is on by default only in debug builds: ask for it, so
        // the story holds under `cargo test --release` too.
        let g = *pool().config();
        let pool = KvPool::new(g.audit(true)).unwrap();
        assert!(pool.config().audit_enabled());
        let mut a = pool.reserve(RequestId(1), 2).unwrap();
        a.append(0, &[1.0, 2.0], &[3.0, 4.0]).unwrap();
        // Simulate a bookkeeping bug: slot 0 claims another writer.
        pool.shared
            .storage
            .record_writers(a.pages()[0].index, 0, 0, 1, 99);
        let reader = pool.reader();
        let err = reader.seq(&a).unwrap().layer(0).err();
        assert!(matches!(
            err,
            Some(KvError::IsolationViolation {
                reader: RequestId(1),
                writer: Some(RequestId(99)),
                ..
            })
        ));
        assert_eq!(pool.stats().isolation_violations, 1);
    }

    #[test]
    fn generations_change_on_every_hand_out() {
        let pool = pool();
        let mut seen = std::collections::HashSet::new();
        for i in 0..10 {
            let s = pool.reserve(RequestId(i), 2).unwrap();
            assert!(seen.insert(s.pages()[0]), "an id was reissued");
        }
    }
}
