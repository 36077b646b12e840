//! The device copy of a host pool's KV pages ([`KvMirror`]), the pages of
//! a device-resident pool, the page tables and slot maps built for either,
//! and the appends into them.

use std::ops::Range;
use std::sync::Arc;

use crate::backend::cuda::{
    AttnKv, CudaDevice, CudaError, CudaPages, DeviceKvArena, PageTables, SeqPages, SlotMap,
};
use crate::backend::{AttnShape, BackendError, SeqSpan, rows_of, shape_err};
use crate::kv::{
    DevicePages, KvPool, KvSeq, LayerView, PageId, PoolId, Residence, ScrubPolicy, Writable,
};

use super::{CudaBackend, CudaBuf, TablesKey, dev_err};

/// The device copy of one pool's pages, and what of it is current.
pub(super) struct KvMirror {
    pub(super) pool: PoolId,
    pub(super) scrub: ScrubPolicy,
    pub(super) arena: DeviceKvArena,
    pub(super) n_layers: usize,
    /// Generation each page was last seen at (0: never).
    pub(super) generation: Vec<u64>,
    /// Per (page, layer): slots `0..synced` hold the page's current bytes.
    pub(super) synced: Vec<u32>,
}

impl KvMirror {
    pub(super) fn new(dev: &CudaDevice, pool: &KvPool) -> Result<Self, CudaError> {
        let cfg = pool.config();
        let g = cfg.geometry();
        Ok(KvMirror {
            pool: pool.shared.id,
            scrub: cfg.scrub_policy(),
            arena: DeviceKvArena::new(dev, g, cfg.page_size(), cfg.pages())?,
            n_layers: g.n_layers,
            generation: vec![0; cfg.pages()],
            synced: vec![0; cfg.pages() * g.n_layers],
        })
    }

    /// Brings the mirror's knowledge of `page` to its current generation:
    /// a page that changed hands is scrubbed on the device and unsynced.
    pub(super) fn refresh(&mut self, dev: &CudaDevice, page: PageId) -> Result<(), CudaError> {
        let i = page.index() as usize;
        if i >= self.generation.len() {
            return Err(CudaError::PageOutOfRange {
                page: page.index(),
                pages: self.generation.len(),
            });
        }
        if self.generation[i] != page.generation() {
            match self.scrub {
                ScrubPolicy::Zero => dev.scrub_pages(&mut self.arena, &[page.index()], false)?,
                ScrubPolicy::Poison => dev.scrub_pages(&mut self.arena, &[page.index()], true)?,
                ScrubPolicy::AcceptStaleBytes => {}
            }
            self.generation[i] = page.generation();
            self.synced[i * self.n_layers..(i + 1) * self.n_layers].fill(0);
        }
        Ok(())
    }

    /// Makes every written slot of `view` below `upto` current on the device.
    pub(super) fn sync_view(
        &mut self,
        dev: &CudaDevice,
        view: &LayerView<'_>,
        upto: usize,
    ) -> Result<(), CudaError> {
        let ps = self.arena.page_size();
        let layer = view.layer_index();
        for (i, &page) in view.page_ids().iter().enumerate() {
            if i * ps >= upto {
                break;
            }
            self.refresh(dev, page)?;
            let have = view.tokens_in_page(i);
            let s = page.index() as usize * self.n_layers + layer;
            if (self.synced[s] as usize) < have.min(upto - i * ps) {
                self.arena
                    .write_rows(dev, page.index(), layer, 0, 0, view.keys(i).as_bytes())?;
                self.arena
                    .write_rows(dev, page.index(), layer, 1, 0, view.values(i).as_bytes())?;
                self.synced[s] = have as u32;
            }
        }
        Ok(())
    }
}

impl CudaBackend {
    pub(super) fn mirror(
        &self,
    ) -> Result<std::sync::MutexGuard<'_, Option<KvMirror>>, BackendError> {
        self.kv
            .lock()
            .map_err(|_| BackendError::Device("KV mirror lock poisoned by a panic".into()))
    }

    /// Checks the views against the mirrored pool, syncs what they need,
    /// and builds validated page tables.
    pub(super) fn tables(
        &self,
        mirror: &mut KvMirror,
        kv: &[LayerView<'_>],
        lens: &[(usize, usize)],
        shape: AttnShape,
    ) -> Result<Arc<PageTables>, BackendError> {
        for (view, &(kv_len, _)) in kv.iter().zip(lens) {
            if view.page_ids().iter().any(|p| p.pool != mirror.pool) {
                return Err(BackendError::Device(
                    "attention over a KV pool this backend has not appended to: append first"
                        .into(),
                ));
            }
            mirror.sync_view(&self.dev, view, kv_len).map_err(dev_err)?;
        }
        self.page_tables(&mirror.arena, kv, lens, shape)
    }

    /// Runs `f` on the KV of the views' layer: the arena their pages are
    /// in, with validated page tables (a device-resident pool's own arena,
    /// or the mirror, synced first, of a pool in host memory), for
    /// `shape`'s query heads.
    pub(super) fn with_arena<R>(
        &self,
        kv: &[LayerView<'_>],
        lens: &[(usize, usize)],
        shape: AttnShape,
        f: impl FnOnce(AttnKv<'_>) -> Result<R, BackendError>,
    ) -> Result<R, BackendError> {
        let layer = kv.first().map_or(0, LayerView::layer_index);
        let n_heads = shape.n_heads;
        if let Some(cuda) = self.views_pages(kv)? {
            let arena = cuda.arena();
            let tables = self.page_tables(&arena, kv, lens, shape)?;
            let (arena, tables) = (&*arena, &tables);
            return f(AttnKv {
                arena,
                tables,
                layer,
                n_heads,
            });
        }
        let mut guard = self.mirror()?;
        let mirror = guard.as_mut().ok_or_else(|| {
            BackendError::Device("attention before any KV append on this backend".into())
        })?;
        let tables = self.tables(mirror, kv, lens, shape)?;
        let (arena, tables) = (&mirror.arena, &tables);
        f(AttnKv {
            arena,
            tables,
            layer,
            n_heads,
        })
    }

    /// The pool's own pages, when they are [`CudaPages`] on this device.
    pub(super) fn own_pages<'a>(
        &self,
        pages: Option<&'a dyn DevicePages>,
    ) -> Result<&'a CudaPages, BackendError> {
        let cuda = pages
            .and_then(|p| p.as_any().downcast_ref::<CudaPages>())
            .ok_or_else(|| {
                BackendError::Device(
                    "a device-resident pool whose pages are not CUDA memory: build it with CudaPages::for_pool"
                        .into(),
                )
            })?;
        if !cuda.device().same(&self.dev) {
            return Err(BackendError::Device(
                "a pool on another device (or context): build it with this backend's device".into(),
            ));
        }
        Ok(cuda)
    }

    /// The device-resident pool the views read, when they read one: each
    /// view must be of that same pool.
    pub(super) fn views_pages<'a>(
        &self,
        kv: &[LayerView<'a>],
    ) -> Result<Option<&'a CudaPages>, BackendError> {
        let Some(first) = kv.first().and_then(|v| v.device_pages()) else {
            if kv.iter().any(|v| v.residence() == Residence::Device) {
                return Err(BackendError::Device(
                    "views of pools in host and device memory in one batch".into(),
                ));
            }
            return Ok(None);
        };
        let same = |v: &LayerView<'_>| {
            v.device_pages().is_some_and(|p| {
                std::ptr::addr_eq(p as *const dyn DevicePages, first as *const dyn DevicePages)
            })
        };
        if !kv.iter().all(same) {
            return Err(BackendError::Device(
                "views of more than one pool in one batch".into(),
            ));
        }
        self.own_pages(Some(first)).map(Some)
    }

    /// Validated page tables of the views' pages in `arena`: the last ones
    /// built when the views give the same pages and lengths (every layer of
    /// a step), else new ones.
    pub(super) fn page_tables(
        &self,
        arena: &DeviceKvArena,
        kv: &[LayerView<'_>],
        lens: &[(usize, usize)],
        shape: AttnShape,
    ) -> Result<Arc<PageTables>, BackendError> {
        let g = arena.geometry();
        if shape.n_kv_heads != g.n_kv_heads || shape.head_dim != g.head_dim {
            return Err(shape_err(
                "attention",
                "KV heads x head_dim of the pool",
                g.kv_dim(),
                shape.kv_dim(),
            ));
        }
        let mut key = TablesKey {
            arena: arena.id,
            pages: Vec::new(),
            seqs: Vec::with_capacity(kv.len()),
        };
        for (v, &(kv_len, q_len)) in kv.iter().zip(lens) {
            let before = key.pages.len();
            key.pages.extend(v.page_table());
            key.seqs.push((key.pages.len() - before, kv_len, q_len));
        }
        let retire = |old| self.dev.retire(old);
        self.tables_memo
            .get_or_refill(
                key,
                || self.dev.moment(),
                |key, reuse| {
                    let mut at = 0;
                    let seqs: Vec<SeqPages<'_>> = key
                        .seqs
                        .iter()
                        .map(|&(n, kv_len, q_len)| {
                            at += n;
                            SeqPages {
                                pages: &key.pages[at - n..at],
                                kv_len,
                                q_len,
                            }
                        })
                        .collect();
                    PageTables::refill(&self.dev, arena, &seqs, reuse)
                },
                retire,
            )
            .map_err(dev_err)
    }

    /// The batched append of a pass (see [`CudaBackend::kv_append_each`]):
    /// when every sequence is in this device's one device-resident pool and
    /// the spans' rows follow each other, reserves every sequence's slots,
    /// runs `launch` once with the arena, the pass's slot map and its rows,
    /// and counts the rows as written once it is enqueued. `Ok(None)`: the
    /// pass is not one for a single launch, or has no sequence (nothing
    /// was reserved or run).
    pub(super) fn append_batched<S: Writable>(
        &self,
        seqs: &mut [&mut KvSeq<S>],
        layer: usize,
        k_len: usize,
        v_len: usize,
        spans: &[SeqSpan],
        launch: impl FnOnce(&mut DeviceKvArena, &SlotMap, Range<usize>) -> Result<(), BackendError>,
    ) -> Result<Option<()>, (usize, BackendError)> {
        let Some(pool) = seqs.first().map(|s| s.pool().clone()) else {
            return Ok(None); // nothing to append: the caller's plain path
        };
        let back_to_back = spans.len() == seqs.len()
            && spans
                .windows(2)
                .all(|w| w[1].first_row == w[0].first_row + w[0].rows);
        let one_pool = seqs.iter().all(|s| s.pool().shared.id == pool.shared.id);
        if pool.residence() != Residence::Device || !back_to_back || !one_pool {
            return Ok(None);
        }
        let kvd = pool.config().geometry().kv_dim();
        let n = rows_of("kv_append", k_len, kvd).map_err(|e| (0, e))?;
        if v_len != k_len {
            let e = shape_err("kv_append", "V length (= K length)", k_len, v_len);
            return Err((0, e));
        }
        let first_row = spans.first().map_or(0, |s| s.first_row);
        let end_row = spans.last().map_or(0, |s| s.first_row + s.rows);
        if end_row > n {
            return Err((
                seqs.len() - 1,
                shape_err("kv_append", "row range within", n, end_row),
            ));
        }
        let cuda = self.own_pages(pool.device_pages()).map_err(|e| (0, e))?;
        let mut appends = Vec::with_capacity(seqs.len());
        let mut slots = Vec::with_capacity(end_row - first_row);
        for (i, (seq, span)) in seqs.iter_mut().zip(spans).enumerate() {
            let append = seq
                .device_append(layer, span.rows)
                .map_err(|e| (i, BackendError::Kv(e)))?;
            slots.extend_from_slice(append.slots());
            appends.push(append);
        }
        if slots.is_empty() {
            return Ok(Some(()));
        }
        let mut arena = cuda.arena();
        // Every layer of a step appends to the same slots.
        let map = self
            .slots_memo
            .get_or_refill(
                (arena.id, slots),
                || self.dev.moment(),
                |(_, slots), reuse| SlotMap::refill(&self.dev, &arena, slots, reuse),
                |old| self.dev.retire(old),
            )
            .map_err(|e| (0, dev_err(e)))?;
        launch(&mut arena, &map, first_row..end_row).map_err(|e| (0, e))?;
        for append in appends {
            append.commit();
        }
        Ok(Some(()))
    }

    /// The append of `rows` of `k` and `v` to layer `layer` of `seq`
    /// ([`Backend::kv_append`](crate::backend::Backend::kv_append)): into a device-resident pool's own pages,
    /// or the host pool first and then its device mirror.
    pub(super) fn append_rows<S: Writable>(
        &self,
        seq: &mut KvSeq<S>,
        layer: usize,
        k: &CudaBuf,
        v: &CudaBuf,
        rows: Range<usize>,
    ) -> Result<(), BackendError> {
        let pool = seq.pool().clone();
        let kvd = pool.config().geometry().kv_dim();
        let n = rows_of("kv_append", k.len, kvd)?;
        if v.len != k.len {
            return Err(shape_err(
                "kv_append",
                "V length (= K length)",
                k.len,
                v.len,
            ));
        }
        if rows.start > rows.end || rows.end > n {
            return Err(shape_err("kv_append", "row range within", n, rows.end));
        }
        if rows.is_empty() {
            return Ok(());
        }
        let elems = rows.start * kvd..rows.end * kvd;
        let k_rows = k.view()?.slice(elems.clone());
        let v_rows = v.view()?.slice(elems);
        if pool.residence() == Residence::Device {
            // The reservation on the host, the rows by the kernel into the
            // pool's own pages, then the count: nothing is readable before
            // the launch that writes it is enqueued.
            let cuda = self.own_pages(pool.device_pages())?;
            let append = seq.device_append(layer, rows.len())?;
            let mut arena = cuda.arena();
            let map = SlotMap::new(&self.dev, &arena, append.slots()).map_err(dev_err)?;
            self.dev
                .kv_append(&mut arena, layer, &map, &k_rows, &v_rows)
                .map_err(dev_err)?;
            append.commit();
            self.dev.retire(map);
            return Ok(());
        }
        // Host first: reservation check, accounting, audit trail, host bytes.
        let k_host = self.dev.download(&k_rows).map_err(dev_err)?;
        let v_host = self.dev.download(&v_rows).map_err(dev_err)?;
        let w0 = seq.written(layer);
        seq.append(layer, &k_host, &v_host)?;
        let w1 = w0 + rows.len();

        // Then the device mirror.
        let mut guard = self.mirror()?;
        if guard.as_ref().is_none_or(|m| m.pool != pool.shared.id) {
            *guard = Some(KvMirror::new(&self.dev, &pool).map_err(dev_err)?);
        }
        let Some(mirror) = guard.as_mut() else {
            return Err(BackendError::Device("KV mirror missing".into()));
        };
        let ps = mirror.arena.page_size();
        let pages = seq.pages();
        let mut slots = Vec::with_capacity(rows.len());
        for pos in w0..w1 {
            let page = pages[pos / ps];
            if pos % ps == 0 || pos == w0 {
                mirror.refresh(&self.dev, page).map_err(dev_err)?;
            }
            slots.push((page.index(), (pos % ps) as u32));
        }
        let map = SlotMap::new(&self.dev, &mirror.arena, &slots).map_err(dev_err)?;
        self.dev
            .kv_append(&mut mirror.arena, layer, &map, &k_rows, &v_rows)
            .map_err(dev_err)?;
        self.dev.retire(map);
        // Slots 0..synced of a page stay contiguous: extend only from the end.
        let touched = pages
            .iter()
            .enumerate()
            .take((w1 - 1) / ps + 1)
            .skip(w0 / ps);
        for (pi, page) in touched {
            let s = page.index() as usize * mirror.n_layers + layer;
            let lo = w0.saturating_sub(pi * ps);
            let hi = (w1 - pi * ps).min(ps);
            if mirror.synced[s] as usize >= lo {
                mirror.synced[s] = mirror.synced[s].max(hi as u32);
            }
        }
        Ok(())
    }
}
