//! The tenant-scoped prefix cache: full pages of a finished prefill, shared
//! read-only with later sequences of the same tenant whose prompts begin
//! with the same tokens.
//!
//! # A cached page, by type
//!
//! A page enters the cache when the sequence that wrote it *publishes* it
//! ([`PrefixCache::publish`]): only complete pages (every layer written
//! past their last slot) of the prompt's keyed range, after the last write.
//! The page's state becomes `Cached` and it moves from the sequence's
//! private pages into its [`SharedPrefix`], a lease: the page table is
//! unchanged, but writes reach only private pages (the storage layer builds
//! its writer from the private slice alone), so no `&mut` path reaches a
//! cached page. A later sequence of the tenant gets a lease on the longest
//! cached run of its prompt's keys ([`PrefixCache::reserve`]); the lease
//! counts as a reader of each page. A page's generation changes only when
//! it is handed out, which needs it free, which needs eviction, which takes
//! only pages with no reader: so the generation cannot change under a
//! lease. Eviction is LRU over idle pages, inside allocation when the free
//! list runs short (idle cached pages count as available), and scrubs per
//! the pool's [`crate::ScrubPolicy`] before the page is free.
//!
//! # Reads go through the same validated views
//!
//! A sequence with a lease is an ordinary [`KvSeq`] whose page table starts
//! with the leased pages and whose every layer counts their positions as
//! written; [`crate::kv::KvReader::seq`] checks each leased page cached at
//! its generation with a reader, each private page in use, and
//! [`crate::kv::SeqView::layer`] audits each slot: private slots written by
//! the owner, cached slots by the page's recorded publisher, who must be of
//! the reader's tenant (else [`KvError::IsolationViolation`]).
//!
//! # The last page is private
//!
//! Only full pages are keyed, and a lookup reuses only the full pages
//! before the prompt's last token ([`PrefixKeys::reusable_pages`]): the
//! sequence computes at least that token (its logits give the first output)
//! and every position after it in private pages.
//!
//! # Accounting
//!
//! `free + in_use + held + cached == capacity`; cached pages with no reader
//! are `cached_idle` and count as available to allocation and admission.

use crate::ids::{RequestId, TenantId};
use crate::kv::cache_index::CacheCounters;
use crate::kv::page::PageState;
use crate::kv::pool::Meta;
use crate::kv::prefix_key::{CacheSecret, PrefixKeys};
use crate::kv::seq::{Filling, KvSeq, Readable, Writable};
use crate::kv::{KvError, KvPool, PageId};

/// A lease on a run of cached pages: shared, read-only, one reader of each
/// page while it lives; dropping it returns the lease (deepest page first,
/// so that page is evicted first). It lives inside the [`KvSeq`] that reads
/// the pages and is never written through.
pub(crate) struct SharedPrefix {
    pool: KvPool,
    pages: Vec<PageId>,
    tenant: Option<TenantId>,
}

impl SharedPrefix {
    /// No lease.
    pub(crate) fn none(pool: KvPool) -> Self {
        SharedPrefix {
            pool,
            pages: Vec::new(),
            tenant: None,
        }
    }
    pub(crate) fn pool(&self) -> &KvPool {
        &self.pool
    }
    pub(crate) fn pages(&self) -> &[PageId] {
        &self.pages
    }
    pub(crate) fn len(&self) -> usize {
        self.pages.len()
    }
    pub(crate) fn tenant(&self) -> Option<TenantId> {
        self.tenant
    }
}

impl Drop for SharedPrefix {
    fn drop(&mut self) {
        if !self.pages.is_empty() {
            self.pool.release_leases(&self.pages);
        }
    }
}

/// Reserves `tokens` tokens in `pool` for `owner`'s `prompt`: through
/// `cache` when one is given (the keys of `prompt` for `tenant`, leasing the
/// run of them it holds; see [`PrefixCache::reserve`]), else all private.
/// Returns the sequence and the keys to publish its pages under once they
/// are computed. The one reservation path of every server that prefills.
pub(crate) fn reserve_prompt(
    pool: &KvPool,
    cache: Option<&PrefixCache>,
    owner: RequestId,
    tenant: TenantId,
    prompt: &[u32],
    tokens: usize,
) -> Result<(KvSeq<Filling>, Option<PrefixKeys>), KvError> {
    match cache {
        Some(cache) => {
            let keys = cache.keys(tenant, prompt);
            Ok((cache.reserve(owner, &keys, tokens)?, Some(keys)))
        }
        None => Ok((pool.reserve(owner, tokens)?, None)),
    }
}

/// The prefix cache of one pool, for one model, under one server secret.
/// Cheap to clone. Every operation takes the pool's bookkeeping lock once.
#[derive(Clone, Debug)]
pub struct PrefixCache {
    pool: KvPool,
    secret: CacheSecret,
    model_fingerprint: u64,
}

impl PrefixCache {
    /// A cache over `pool` for the model whose fingerprint is
    /// `model_fingerprint` (`ModelFingerprint::to_u64`): KV of other weights
    /// never matches. `secret` salts every tenant's keys.
    pub fn new(pool: &KvPool, model_fingerprint: u64, secret: CacheSecret) -> Self {
        PrefixCache {
            pool: pool.clone(),
            secret,
            model_fingerprint,
        }
    }

    /// The pool the cache lives in.
    pub fn pool(&self) -> &KvPool {
        &self.pool
    }

    /// The keys of `prompt`'s full pages for `tenant`, salted with the
    /// tenant's server-derived salt.
    pub fn keys(&self, tenant: TenantId, prompt: &[u32]) -> PrefixKeys {
        PrefixKeys::chain(
            self.pool.shared.id,
            &self.secret.salt(tenant),
            tenant,
            self.model_fingerprint,
            self.pool.page_size(),
            prompt,
        )
    }

    /// Reusable pages of `keys` the cache holds now (the run a
    /// [`PrefixCache::reserve`] would lease), for a planner sizing a start:
    /// it leases nothing, so eviction may still take them before the
    /// reserve, which then computes more and never reads less.
    pub fn probe(&self, keys: &PrefixKeys) -> usize {
        if self.check_keys(keys).is_err() {
            return 0;
        }
        let want = keys.reusable_pages().min(keys.keys.len());
        let m = self.pool.shared.meta.lock();
        keys.keys[..want]
            .iter()
            .take_while(|k| m.cache.find(k).is_some())
            .count()
    }

    /// Reserves room for `tokens` tokens for `owner`, starting from the
    /// longest run of the prompt's reusable pages that the tenant has
    /// cached: those are leased (see [`KvSeq::reused_tokens`]), the rest is
    /// private. Errors as [`KvPool::reserve`]; nothing is leased or
    /// allocated then.
    pub fn reserve(
        &self,
        owner: RequestId,
        keys: &PrefixKeys,
        tokens: usize,
    ) -> Result<KvSeq<Filling>, KvError> {
        self.check_keys(keys)?;
        if tokens < keys.prompt_len {
            return Err(KvError::PrefixMismatch {
                reason: "the reservation is shorter than the prompt",
            });
        }
        let (prefix, looked_up) = self.pool.lease(keys);
        let reused = prefix.len() * self.pool.page_size();
        let private = self
            .pool
            .alloc_pages(self.pool.pages_for(tokens - reused))?;
        self.pool
            .count_lookup(prefix.len(), looked_up - prefix.len());
        Ok(KvSeq::with_prefix(prefix, owner, private))
    }

    /// Publishes `seq`'s complete pages within the prompt's keys (the full
    /// pages of a finished prefill) into the cache, after any it leased;
    /// returns how many it published. Stops at the first page whose key is
    /// already cached (another sequence published the same prefix first)
    /// or whose layers are not all written past it. The published pages
    /// stay readable by `seq` (now through its lease) and are never written
    /// again. `keys` must be the keys of the prompt `seq` computed, for the
    /// tenant it leased under.
    pub fn publish<S: Writable + Readable>(
        &self,
        seq: &mut KvSeq<S>,
        keys: &PrefixKeys,
    ) -> Result<usize, KvError> {
        self.check_keys(keys)?;
        if !seq.pool().same_pool(&self.pool) {
            return Err(seq.foreign_pool());
        }
        if seq.tenant().is_some_and(|t| t != keys.tenant) {
            return Err(KvError::PrefixMismatch {
                reason: "the sequence leased its prefix under another tenant",
            });
        }
        let ps = self.pool.page_size();
        let complete = seq.written_per_layer().iter().min().copied().unwrap_or(0) / ps;
        let end = complete.min(keys.keys.len()).min(seq.pages().len());
        let start = seq.shared_pages();
        let published = {
            let mut m = self.pool.shared.meta.lock();
            // The lease must be this prompt's: each leased page cached
            // under the key the caller presents for it.
            let leased = &seq.pages()[..start];
            if leased
                .iter()
                .zip(&keys.keys)
                .any(|(p, k)| m.cache.find(k) != Some(p.index))
                || leased.len() > keys.keys.len()
            {
                return Err(KvError::PrefixMismatch {
                    reason: "the sequence's leased pages are not cached under these keys",
                });
            }
            let mut published = Vec::new();
            for (page, key) in seq.pages()[start.min(end)..end]
                .iter()
                .zip(&keys.keys[start.min(end)..end])
            {
                let i = page.index as usize;
                if m.pages[i].state() != PageState::InUse || !m.cache.insert(page.index, *key) {
                    break;
                }
                m.pages[i].set_state(PageState::Cached);
                m.in_use -= 1;
                self.pool
                    .shared
                    .storage
                    .record_publisher(page.index, seq.owner(), keys.tenant);
                published.push(*page);
            }
            published
        };
        let n = published.len();
        let lease = seq.prefix_mut();
        lease.tenant = Some(keys.tenant);
        lease.pages.extend(published);
        Ok(n)
    }

    /// The cache's counters since the pool was built.
    pub fn counters(&self) -> CacheCounters {
        self.pool.cache_counters()
    }

    /// Evicts (scrubs and frees) every cached page no sequence reads;
    /// returns how many. Pages under a lease stay.
    pub fn evict_idle(&self) -> usize {
        self.pool.evict_idle()
    }

    fn check_keys(&self, keys: &PrefixKeys) -> Result<(), KvError> {
        if keys.pool != self.pool.shared.id || keys.page_size != self.pool.page_size() {
            return Err(KvError::PrefixMismatch {
                reason: "the keys were derived for another pool",
            });
        }
        Ok(())
    }
}

impl KvPool {
    /// Leases the longest cached run of `keys`' reusable pages; returns
    /// the lease and how many pages were looked up.
    fn lease(&self, keys: &PrefixKeys) -> (SharedPrefix, usize) {
        let want = keys.reusable_pages().min(keys.keys.len());
        let mut pages = Vec::new();
        {
            let mut m = self.shared.meta.lock();
            for key in &keys.keys[..want] {
                let Some(index) = m.cache.find(key) else {
                    break;
                };
                let e = m.pages[index as usize];
                if e.state() != PageState::Cached {
                    break; // bookkeeping disagrees: recompute rather than read
                }
                m.cache.add_reader(index);
                pages.push(PageId {
                    pool: self.shared.id,
                    index,
                    generation: e.generation(),
                });
            }
        }
        let lease = SharedPrefix {
            pool: self.clone(),
            pages,
            tenant: Some(keys.tenant),
        };
        (lease, want)
    }

    fn count_lookup(&self, hit: usize, missed: usize) {
        let c = &mut self.shared.meta.lock().cache.counters;
        c.lookups += 1;
        c.hit_pages += hit as u64;
        c.missed_pages += missed as u64;
    }

    /// Returns one lease on each page, deepest first.
    fn release_leases(&self, pages: &[PageId]) {
        let mut m = self.shared.meta.lock();
        for p in pages.iter().rev() {
            let i = p.index as usize;
            if m.pages
                .get(i)
                .is_some_and(|e| e.is(p.generation, PageState::Cached))
            {
                m.cache.remove_reader(p.index);
            }
        }
    }

    /// Evicts the least recently used idle cached page: scrubbed per the
    /// pool's policy, then free. False when no cached page is idle.
    pub(crate) fn evict_one(&self, m: &mut Meta) -> bool {
        let Some(index) = m.cache.evict_lru() else {
            return false;
        };
        self.shared
            .storage
            .scrub_evicted(index, self.scrub_fill(), m);
        m.pages[index as usize].set_state(PageState::Free);
        m.free.push(index);
        true
    }

    /// Evicts every idle cached page; returns how many.
    pub(crate) fn evict_idle(&self) -> usize {
        let mut m = self.shared.meta.lock();
        let mut n = 0;
        while self.evict_one(&mut m) {
            n += 1;
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvGeometry;
    use crate::kv::PoolConfig;

    fn cache() -> PrefixCache {
        let g = KvGeometry::tiny(1, 1);
        let pool = KvPool::new(PoolConfig::new(g, 2, 8).audit(true)).unwrap(); // the stories below read the audit trail, in release too
        PrefixCache::new(&pool, 1, CacheSecret::from_bytes([5; 32]))
    }

    /// Tenant 1 publishes two pages of `[1, 2, 3, 4, 5]`; a second request
    /// of tenant 1 leases them.
    fn leased(cache: &PrefixCache) -> (KvSeq<Filling>, KvSeq<Filling>) {
        let prompt = [1, 2, 3, 4, 5];
        let keys = cache.keys(TenantId(1), &prompt);
        let mut first = cache.reserve(RequestId(1), &keys, 5).unwrap();
        first.append(0, &[1.0; 5], &[1.0; 5]).unwrap();
        assert_eq!(cache.publish(&mut first, &keys).unwrap(), 2);
        let second = cache.reserve(RequestId(2), &keys, 6).unwrap();
        assert_eq!(second.shared_pages(), 2);
        (first, second)
    }

    #[test]
    fn a_cached_page_recorded_for_another_tenant_fails_the_readers_audit() {
        let cache = cache();
        let pool = cache.pool().clone();
        let (_first, second) = leased(&cache);
        assert!(pool.reader().seq(&second).unwrap().layer(0).is_ok());
        // Simulate a bookkeeping bug: the index hands tenant 1 a page that
        // tenant 9's request 7 published.
        let page = second.pages()[1].index;
        pool.shared
            .storage
            .record_publisher(page, RequestId(7), TenantId(9));
        let reader = pool.reader();
        let err = reader.seq(&second).unwrap().layer(0).err();
        assert!(
            matches!(
                err,
                Some(KvError::IsolationViolation {
                    reader: RequestId(2),
                    page: p,
                    ..
                }) if p == page
            ),
            "{err:?}"
        );
        assert_eq!(pool.stats().isolation_violations, 1);
    }

    #[test]
    fn a_cached_slot_written_by_someone_other_than_its_publisher_fails_the_audit() {
        let cache = cache();
        let pool = cache.pool().clone();
        let (_first, second) = leased(&cache);
        pool.shared
            .storage
            .record_writers(second.pages()[0].index, 0, 1, 1, 7);
        let err = pool.reader().seq(&second).unwrap().layer(0).err();
        assert!(
            matches!(
                err,
                Some(KvError::IsolationViolation {
                    writer: Some(RequestId(7)),
                    slot: 1,
                    ..
                })
            ),
            "{err:?}"
        );
    }

    #[test]
    fn no_write_reaches_a_cached_page() {
        let cache = cache();
        let (mut first, mut second) = leased(&cache);
        // The publisher's positions 0..4 are cached now; only its private
        // page (position 4) and its reservation's end are writable.
        let mut w = first.pages_write();
        assert!(w.rows_mut(0, 0, 0, 0, 1).is_none());
        assert!(w.rows_mut(1, 0, 0, 1, 1).is_none());
        assert!(w.rows_mut(2, 0, 0, 0, 1).is_some());
        // The reader appends after its prefix, into its private page.
        second.append(0, &[2.0], &[2.0]).unwrap();
        assert_eq!(second.written(0), 5);
        let pool = cache.pool();
        let r = pool.reader();
        let lv = r.seq(&second).unwrap().layer(0).unwrap();
        let mut v = [0f32; 2];
        lv.keys(0).to_f32_into(&mut v);
        assert_eq!(v, [1.0, 1.0], "the shared page is as published");
    }
}
