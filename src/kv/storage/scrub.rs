//! Scrubbing: a page's bytes overwritten (zero or poison, per the pool's
//! policy) and its audit trail cleared before anyone else can hold it,
//! whether it leaves a sequence or is evicted from the prefix cache; and
//! the free-page read-back that the pool's scrub audit checks.

use crate::kv::pool::Meta;
use crate::kv::storage::{PagesRead, PagesWrite, Storage, bytes_to_f32};

impl Storage {
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
}

impl PagesWrite<'_> {
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
