//! The prefix cache's bookkeeping: which page holds which key, how many
//! readers each cached page has, and the LRU order of the idle ones. It
//! lives inside the pool's bookkeeping (one mutex), so allocation can evict
//! an idle page in the same critical section that hands it out again, and
//! no lookup can lease a page while it is being evicted. No bytes here.

use std::collections::{BTreeMap, HashMap};

use crate::kv::prefix_key::PageKey;

/// Counters of the cache since the pool was built.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheCounters {
    /// Lookups made (one per request that asked the cache).
    pub lookups: u64,
    /// Reusable pages found cached (each saves one page of prefill).
    pub hit_pages: u64,
    /// Reusable pages looked up and not found.
    pub missed_pages: u64,
    /// Pages published into the cache.
    pub published: u64,
    /// Idle cached pages evicted (scrubbed and freed) to make room.
    pub evictions: u64,
}

pub(crate) struct CacheIndex {
    by_key: HashMap<PageKey, u32>,
    /// Per page: its key while cached.
    key: Vec<Option<PageKey>>,
    /// Per page: leases held on it while cached.
    readers: Vec<u32>,
    /// Per page: its place in `idle` while cached with no reader.
    tick: Vec<u64>,
    /// Idle cached pages, least recently released first.
    idle: BTreeMap<u64, u32>,
    next_tick: u64,
    pub(crate) counters: CacheCounters,
}

impl CacheIndex {
    pub(crate) fn new(pages: usize) -> Self {
        CacheIndex {
            by_key: HashMap::new(),
            key: vec![None; pages],
            readers: vec![0; pages],
            tick: vec![0; pages],
            idle: BTreeMap::new(),
            next_tick: 0,
            counters: CacheCounters::default(),
        }
    }

    /// Cached pages, with or without readers.
    pub(crate) fn cached(&self) -> usize {
        self.by_key.len()
    }

    /// Cached pages with no reader: reclaimable by eviction.
    pub(crate) fn idle(&self) -> usize {
        self.idle.len()
    }

    /// The page cached under `key`.
    pub(crate) fn find(&self, key: &PageKey) -> Option<u32> {
        self.by_key.get(key).copied()
    }

    /// Leases held on `page` (0 for a page not cached).
    pub(crate) fn readers(&self, page: u32) -> u32 {
        self.readers.get(page as usize).copied().unwrap_or(0)
    }

    /// True when `page` is cached.
    pub(crate) fn is_cached(&self, page: u32) -> bool {
        self.key.get(page as usize).is_some_and(Option::is_some)
    }

    /// Caches `page` under `key` with one reader (its publisher). False,
    /// and nothing changes, when the key is already cached (another
    /// sequence published the same prefix first) or the page already is.
    pub(crate) fn insert(&mut self, page: u32, key: PageKey) -> bool {
        let i = page as usize;
        if self.by_key.contains_key(&key) || self.key.get(i).is_none_or(Option::is_some) {
            return false;
        }
        self.by_key.insert(key, page);
        self.key[i] = Some(key);
        self.readers[i] = 1;
        self.counters.published += 1;
        true
    }

    /// One more lease on a cached page (taking it off the idle list).
    pub(crate) fn add_reader(&mut self, page: u32) {
        let i = page as usize;
        if !self.is_cached(page) {
            return;
        }
        if self.readers[i] == 0 {
            self.idle.remove(&self.tick[i]);
        }
        self.readers[i] += 1;
    }

    /// One lease fewer; the last one puts the page at the young end of the
    /// idle list. A caller releasing a run of pages releases the deepest
    /// first, so that the deepest is evicted first: an evicted ancestor
    /// makes every later key of its chain unreachable.
    pub(crate) fn remove_reader(&mut self, page: u32) {
        let i = page as usize;
        if !self.is_cached(page) || self.readers[i] == 0 {
            return;
        }
        self.readers[i] -= 1;
        if self.readers[i] == 0 {
            self.tick[i] = self.next_tick;
            self.idle.insert(self.next_tick, page);
            self.next_tick += 1;
        }
    }

    /// Takes the least recently released idle page out of the cache; the
    /// caller scrubs and frees it. Never a page with a reader: only idle
    /// pages are on the list.
    pub(crate) fn evict_lru(&mut self) -> Option<u32> {
        let (_, page) = self.idle.pop_first()?;
        let i = page as usize;
        debug_assert_eq!(self.readers[i], 0);
        if let Some(key) = self.key[i].take() {
            self.by_key.remove(&key);
        }
        self.counters.evictions += 1;
        Some(page)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: u8) -> PageKey {
        PageKey::test_key(b)
    }

    #[test]
    fn eviction_takes_only_idle_pages_oldest_first() {
        let mut c = CacheIndex::new(4);
        for p in 0..3u32 {
            assert!(c.insert(p, key(p as u8)));
        }
        assert_eq!(c.evict_lru(), None, "every page has its publisher reading");
        // Released deepest first: 2, then 1; page 0 keeps its reader.
        c.remove_reader(2);
        c.remove_reader(1);
        assert_eq!((c.cached(), c.idle()), (3, 2));
        c.add_reader(2); // a lookup leases page 2 again
        assert_eq!(c.evict_lru(), Some(1));
        assert_eq!(c.evict_lru(), None);
        assert_eq!(c.find(&key(1)), None);
        assert_eq!(c.find(&key(2)), Some(2));
        assert_eq!(c.counters.evictions, 1);
    }

    #[test]
    fn a_key_or_page_already_cached_is_not_inserted_twice() {
        let mut c = CacheIndex::new(2);
        assert!(c.insert(0, key(7)));
        assert!(!c.insert(1, key(7)), "same key, another page");
        assert!(!c.insert(0, key(8)), "same page, another key");
        assert!(!c.insert(9, key(9)), "page out of range");
        assert_eq!(c.cached(), 1);
    }
}
