//! Which worker holds which cached page, keyed by the workers' own page keys.
//!
//! A [`PageKey`] is a BLAKE3 hash chained over the tenant's salt, the model,
//! the page size and every token up to the end of its page (see
//! `handoff::kv::CacheSecret::page_keys`). Because each key already names
//! its whole prefix, a flat map from key to the workers holding that page
//! answers the longest-prefix question without a tree: walk the request's
//! keys from the first and stop where no worker holds the page. Because the
//! keys are salted per tenant, one tenant's keys never meet another's pages,
//! so a tenant's traffic can neither steer nor reveal another's.
//!
//! Workers sit in up to 64 slots, a page's holders in one `u64`, so the walk
//! narrows all workers at once, one map probe per page.

use std::collections::{HashMap, HashSet};

use handoff::kv::PageKey;

use crate::{ClusterError, WorkerId};

/// Most workers one index tracks.
pub const MAX_WORKERS: usize = 64;

/// The prefix index: cached pages by key, and the workers that hold each.
#[derive(Clone, Debug, Default)]
pub struct PrefixIndex {
    slot_of: HashMap<WorkerId, usize>,
    /// Per slot: the worker in it and the pages it holds (to forget them).
    slots: Vec<Option<(WorkerId, HashSet<PageKey>)>>,
    holders: HashMap<PageKey, u64>,
}

impl PrefixIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    fn slot(&mut self, worker: &WorkerId) -> Result<usize, ClusterError> {
        if let Some(&s) = self.slot_of.get(worker) {
            return Ok(s);
        }
        let s = match self.slots.iter().position(Option::is_none) {
            Some(s) => s,
            None if self.slots.len() < MAX_WORKERS => {
                self.slots.push(None);
                self.slots.len() - 1
            }
            None => return Err(ClusterError::IndexFull),
        };
        self.slots[s] = Some((worker.clone(), HashSet::new()));
        self.slot_of.insert(worker.clone(), s);
        Ok(s)
    }

    /// `worker` published `keys` to its prefix cache.
    pub fn stored(&mut self, worker: &WorkerId, keys: &[PageKey]) -> Result<(), ClusterError> {
        let s = self.slot(worker)?;
        for k in keys {
            *self.holders.entry(*k).or_default() |= 1 << s;
            if let Some((_, held)) = &mut self.slots[s] {
                held.insert(*k);
            }
        }
        Ok(())
    }

    /// `worker` evicted `keys`.
    pub fn evicted(&mut self, worker: &WorkerId, keys: &[PageKey]) {
        let Some(&s) = self.slot_of.get(worker) else {
            return;
        };
        for k in keys {
            self.drop_holder(k, s);
            if let Some((_, held)) = &mut self.slots[s] {
                held.remove(k);
            }
        }
    }

    /// `worker` left the live set: none of its pages steer requests now.
    pub fn forget(&mut self, worker: &WorkerId) {
        let Some(s) = self.slot_of.remove(worker) else {
            return;
        };
        if let Some((_, held)) = self.slots[s].take() {
            for k in &held {
                self.drop_holder(k, s);
            }
        }
    }

    fn drop_holder(&mut self, key: &PageKey, slot: usize) {
        if let Some(mask) = self.holders.get_mut(key) {
            *mask &= !(1 << slot);
            if *mask == 0 {
                self.holders.remove(key);
            }
        }
    }

    /// Distinct cached pages indexed.
    pub fn pages(&self) -> usize {
        self.holders.len()
    }

    /// The index's slot of `worker`, if it holds any pages.
    pub(crate) fn slot_of(&self, worker: &WorkerId) -> Option<usize> {
        self.slot_of.get(worker).copied()
    }

    /// For every slot, how many of `keys`, from the first, its worker holds.
    pub(crate) fn runs(&self, keys: &[PageKey]) -> [u32; MAX_WORKERS] {
        let mut runs = [0u32; MAX_WORKERS];
        let mut alive = u64::MAX >> (MAX_WORKERS - self.slots.len().min(MAX_WORKERS)).min(63);
        if self.slots.is_empty() {
            return runs;
        }
        for (i, k) in keys.iter().enumerate() {
            let holds = self.holders.get(k).copied().unwrap_or(0) & alive;
            let mut stopped = alive & !holds;
            while stopped != 0 {
                runs[stopped.trailing_zeros() as usize] = i as u32;
                stopped &= stopped - 1;
            }
            alive = holds;
            if alive == 0 {
                return runs;
            }
        }
        while alive != 0 {
            runs[alive.trailing_zeros() as usize] = keys.len() as u32;
            alive &= alive - 1;
        }
        runs
    }

    /// How many of `keys`, from the first, `worker` holds.
    pub fn cached_run(&self, worker: &WorkerId, keys: &[PageKey]) -> usize {
        self.slot_of(worker)
            .map_or(0, |s| self.runs(keys)[s] as usize)
    }
}
