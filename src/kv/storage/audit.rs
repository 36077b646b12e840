//! The audit trail, when a pool keeps one: who wrote each slot of each
//! layer of each page (`RequestId + 1`), and who published each cached
//! page (`RequestId + 1`, `TenantId + 1`). Bookkeeping beside the bytes, in
//! atomics: a wrong record can only make a read fail its audit.

use std::sync::atomic::Ordering;

use crate::ids::{RequestId, TenantId};
use crate::kv::storage::Storage;

impl Storage {
    #[inline]
    pub(super) fn writer_index(&self, page: u32, layer: usize, slot: usize) -> usize {
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

    /// Clears the writer of `n` consecutive slots of one page and layer.
    pub(crate) fn clear_writer_rows(&self, page: u32, layer: usize, slot: usize, n: usize) {
        let i = self.writer_index(page, layer, slot);
        if let Some(w) = self.writers.as_ref().and_then(|w| w.get(i..i + n)) {
            for x in w {
                x.store(0, Ordering::Relaxed);
            }
        }
    }

    pub(super) fn clear_writers(&self, page: u32) {
        let n = self.geometry.n_layers * self.page_size;
        let s = page as usize * n;
        if let Some(w) = self.writers.as_ref().and_then(|w| w.get(s..s + n)) {
            for x in w {
                x.store(0, Ordering::Relaxed);
            }
        }
        self.set_publisher(page, 0, 0);
    }

    pub(super) fn set_publisher(&self, page: u32, request: u64, tenant: u64) {
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
