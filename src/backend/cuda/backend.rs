//! [`CudaBackend`]: the [`Backend`] trait on the GPU.
//!
//! KV ownership stays where it is: the host [`crate::KvPool`] keeps page
//! accounting, generations, the audit trail and a full copy of every byte
//! (so the transfer layer and the CPU-side checks keep working unchanged).
//! The backend mirrors page bytes in a [`DeviceKvArena`] of the same shape
//! and treats it as a cache keyed by (page, generation, layer, slots):
//!
//! - `kv_append` writes through: host first (`KvSeq::append`, which checks
//!   the reservation and records the writer), then the device, from rows
//!   already on the device.
//! - A page seen at a new generation changed hands: its device copy is
//!   scrubbed per the pool's policy (poison: NaN) before anything else, and
//!   nothing of it counts as synced.
//! - Attention takes the host's validated [`LayerView`]s; any written slot
//!   the device has not seen at the page's current generation (KV that
//!   arrived by transfer, for example) is uploaded from the view first. The
//!   page tables uploaded per step come from those views and are validated
//!   against the arena again before launch. The views are checked for
//!   every layer; when they give the same pages and lengths as the last
//!   tables built (the other layers of a step), those tables are used
//!   again, as are the step's RoPE positions and append slots (`memo.rs`).
//!
//! A pool built on [`CudaPages`] (device-resident, #15) needs no mirror: its
//! bytes are already here. `kv_append` checks the reservation on the host
//! ([`KvSeq::device_append`]), writes the rows with the append kernel
//! straight into the pool's pages and then counts them written; attention
//! builds its page tables from the views against the pool's own arena. The
//! pool scrubs (or poisons) a page on the device when it is released.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};

use super::memo::Memo;
use super::table::{LGEMM_BM, LMMA_GROUPS, NORM_CARRY_ROWS};
use super::{
    CudaDevice, CudaError, CudaPages, DECODE_GROUPS, DecodeKernel, DecodeWorkspace, DeviceKvArena,
    HEAD_DIMS, HalfWeights, PREFILL_MAX_GROUP, PageTables, QuantWeights, SeqPages, SlotMap, Split,
};
use crate::backend::{
    AttnShape, Backend, BackendError, Norm, QuantMatrix, Rope, SeqSpan, check_rope_rows,
    check_view, cpu, rows_of, shape_err,
};
use crate::kv::{
    DeviceError, DevicePages, KvPool, KvSeq, LayerView, PageId, PoolConfig, PoolError, PoolId,
    Residence, ScrubPolicy, Writable,
};

/// An activation buffer in device memory (grow-only).
#[derive(Default)]
pub struct CudaBuf {
    data: Option<CudaSlice<f32>>,
    len: usize,
}

impl std::fmt::Debug for CudaBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBuf").field("len", &self.len).finish()
    }
}

impl CudaBuf {
    /// Sets the length to `len`, reallocating (contents lost) when it grows
    /// past the capacity.
    fn ensure(&mut self, dev: &CudaDevice, len: usize) -> Result<(), BackendError> {
        if self.data.as_ref().is_none_or(|d| d.len() < len.max(1))
            && let Some(old) = self.data.replace(dev.zeros(len.max(1)).map_err(dev_err)?)
        {
            // A recorded launch may still use it (see graph.rs).
            dev.retire(old);
        }
        self.len = len;
        Ok(())
    }
    fn view(&self) -> Result<CudaView<'_, f32>, BackendError> {
        self.data
            .as_ref()
            .map(|d| d.slice(0..self.len))
            .ok_or_else(|| shape_err("buffer", "an initialised buffer", 1, 0))
    }
    fn view_mut(&mut self) -> Result<CudaViewMut<'_, f32>, BackendError> {
        let len = self.len;
        self.data
            .as_mut()
            .map(|d| d.slice_mut(0..len))
            .ok_or_else(|| shape_err("buffer", "an initialised buffer", 1, 0))
    }
}

/// A weight tensor in device memory.
pub struct CudaMat {
    data: MatData,
    rows: usize,
    cols: usize,
}

/// A weight tensor's elements: f32, or 16 bits (raw bits of bf16 or f16)
/// for a matrix whose every element is exactly such a value (a bf16 or f16
/// checkpoint's), which then runs on tensor cores at half the bytes.
///
/// Or ggml blocks (raw bytes) for a GGUF checkpoint's quantized matrices
/// (every ggml type this crate computes with), read as stored and widened
/// as they load.
enum MatData {
    F32(CudaSlice<f32>),
    Half(HalfWeights, CudaSlice<u16>),
    Quant(QuantWeights, CudaSlice<u8>),
}

impl CudaMat {
    /// The f32 elements of a vector (norm weights, biases: never bf16).
    fn f32s(&self, op: &'static str) -> Result<&CudaSlice<f32>, BackendError> {
        match &self.data {
            MatData::F32(d) => Ok(d),
            MatData::Half(h, _) => Err(BackendError::Unsupported {
                what: op,
                detail: format!("a {h:?} weight where f32 is required"),
            }),
            MatData::Quant(q, _) => Err(BackendError::Unsupported {
                what: op,
                detail: format!("a {q:?} weight where f32 is required"),
            }),
        }
    }

    fn len(&self) -> usize {
        self.rows * self.cols
    }
}

impl std::fmt::Debug for CudaMat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaMat")
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish()
    }
}

/// The device copy of one pool's pages, and what of it is current.
struct KvMirror {
    pool: PoolId,
    scrub: ScrubPolicy,
    arena: DeviceKvArena,
    n_layers: usize,
    /// Generation each page was last seen at (0: never).
    generation: Vec<u64>,
    /// Per (page, layer): slots `0..synced` hold the page's current bytes.
    synced: Vec<u32>,
}

impl KvMirror {
    fn new(dev: &CudaDevice, pool: &KvPool) -> Result<Self, CudaError> {
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
    fn refresh(&mut self, dev: &CudaDevice, page: PageId) -> Result<(), CudaError> {
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
    fn sync_view(
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

/// The CUDA backend: activations and weights in device memory, KV mirrored
/// from the host pool (see the module docs).
pub struct CudaBackend {
    dev: CudaDevice,
    kv: Mutex<Option<KvMirror>>,
    workspace: Mutex<DecodeWorkspace>,
    /// Whether [`Backend::new_pool`] gives device-resident pools.
    device_kv: bool,
    bf16_weights: bool,
    /// Whether RMSNorm and SwiGLU ride in the bf16 matmuls' launches
    /// ([`CudaBackend::set_carried_stages`]).
    carry: std::sync::atomic::AtomicBool,
    /// The decode attention kernel ([`CudaBackend::set_decode_kernel`]).
    decode_kernel: parking_lot::Mutex<DecodeKernel>,
    /// The last upload of each per-layer input, reused while the host-side
    /// content is equal (every layer of a step asks for the same).
    positions: Memo<Vec<u32>, CudaSlice<u32>>,
    tables_memo: Memo<TablesKey, PageTables>,
    slots_memo: Memo<(u64, Vec<(u32, u32)>), SlotMap>,
}

/// What a set of page tables is built from: the arena, and per sequence
/// its pages, KV length and query length.
#[derive(PartialEq)]
struct TablesKey {
    arena: u64,
    pages: Vec<u32>,
    seqs: Vec<(usize, usize, usize)>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("device", &self.dev)
            .finish()
    }
}

impl CudaBackend {
    /// `positions` on the device (the last upload, while they are equal:
    /// every layer of a step rotates by the same positions).
    fn device_positions(&self, positions: &[usize]) -> Result<Arc<CudaSlice<u32>>, BackendError> {
        let pos: Vec<u32> = positions
            .iter()
            .map(|&p| u32::try_from(p).map_err(|_| shape_err("rope", "position below 2^32", 0, p)))
            .collect::<Result<_, _>>()?;
        self.positions
            .get_or_refill(
                pos,
                || self.dev.moment(),
                |pos, reuse| match reuse {
                    // Same length (a steady batch): same address.
                    Some(mut buf) if buf.len() == pos.len() => {
                        self.dev.overwrite(pos, &mut buf).map(|()| buf)
                    }
                    _ => self.dev.upload(pos),
                },
                |old| self.dev.retire(old),
            )
            .map_err(dev_err)
    }

    /// A backend on an opened device.
    pub fn new(dev: CudaDevice) -> Self {
        CudaBackend {
            dev,
            kv: Mutex::new(None),
            workspace: Mutex::new(DecodeWorkspace::default()),
            device_kv: false,
            bf16_weights: true,
            carry: std::sync::atomic::AtomicBool::new(true),
            decode_kernel: parking_lot::Mutex::new(DecodeKernel::Auto),
            positions: Memo::default(),
            tables_memo: Memo::default(),
            slots_memo: Memo::default(),
        }
    }

    /// Whether a weight matrix whose every element is exactly a bf16 value
    /// (a bf16 checkpoint's), or else exactly an f16 value (an f16
    /// checkpoint's), stays 16-bit on the device and runs on tensor cores
    /// (default: on), or is widened to f32 (the f32 kernels, closest to the
    /// CPU backend's numbers).
    #[must_use]
    pub fn bf16_weights(mut self, on: bool) -> Self {
        self.bf16_weights = on;
        self
    }

    /// Whether engines and workers built with `new` over this backend get
    /// KV pools whose pages live in this device's memory ([`CudaPages`]:
    /// the append kernel writes them and attention reads them in place, no
    /// row crosses to the host) instead of host pools mirrored to the
    /// device (default: off, until the device-resident path has run on a
    /// GPU in CI). Out of device memory for the pool is a typed
    /// `PoolError::Device` (503) at construction.
    #[must_use]
    pub fn device_kv(mut self, on: bool) -> Self {
        self.device_kv = on;
        self
    }

    /// Whether, with bf16 weights, the feed-forward's SwiGLU rides in the
    /// launch of gate and up (below 128 rows), and the attention and
    /// feed-forward RMSNorms in the launch of the matmul that reads their
    /// output (up to `NORM_CARRY_ROWS` rows). Default: on; a decode layer
    /// at batch 1 then makes 6 launches instead of 9. The bits are those
    /// of the separate kernels either way (a GPU test requires it); off is
    /// for side-by-side timings.
    pub fn set_carried_stages(&self, on: bool) {
        self.carry.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the stages ride in the matmuls' launches
    /// ([`CudaBackend::set_carried_stages`]).
    pub fn carries_stages(&self) -> bool {
        self.carry.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Which decode attention kernel runs (default [`DecodeKernel::Auto`]):
    /// [`DecodeKernel::TensorCoreWide`] for long contexts at small batches,
    /// where it halves each block's walk (see the bench's
    /// `decode_wide_*` lines). The choice holds for every sequence and
    /// step until changed, so outputs stay batch-invariant; a kernel not
    /// compiled for the model's KV (or without its shared memory on this
    /// device) fails the attention with a typed error, never silently
    /// another kernel.
    pub fn set_decode_kernel(&self, kernel: DecodeKernel) {
        *self.decode_kernel.lock() = kernel;
    }

    /// The decode attention kernel asked for
    /// ([`CudaBackend::set_decode_kernel`]).
    pub fn decode_kernel(&self) -> DecodeKernel {
        *self.decode_kernel.lock()
    }

    /// Opens device `ordinal` (see [`CudaDevice::open`]).
    pub fn open(ordinal: usize) -> Result<Self, CudaError> {
        CudaDevice::open(ordinal).map(Self::new)
    }

    /// The bytes a device-resident KV pool may take now: free device memory
    /// (after the weights already placed) less `reserve` for activations
    /// and workspaces, 0 when less is free. Plan the pool from it with
    /// [`crate::EngineConfigBuilder::pool_memory`], whose build refuses a
    /// budget that cannot hold the context window; a pool that then does
    /// not fit the device is a typed `PoolError::Device` (503) at
    /// construction, never a panic.
    pub fn kv_budget(&self, reserve: u64) -> Result<u64, CudaError> {
        let (free, _) = self.dev.memory_info()?;
        Ok((free as u64).saturating_sub(reserve))
    }

    /// The device.
    pub fn device(&self) -> &CudaDevice {
        &self.dev
    }

    fn mirror(&self) -> Result<std::sync::MutexGuard<'_, Option<KvMirror>>, BackendError> {
        self.kv
            .lock()
            .map_err(|_| BackendError::Device("KV mirror lock poisoned by a panic".into()))
    }

    /// Checks the views against the mirrored pool, syncs what they need,
    /// and builds validated page tables.
    fn tables(
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

    /// Runs `f` on the arena the views' pages are in, with validated page
    /// tables: a device-resident pool's own arena, or the mirror (synced
    /// first) of a pool in host memory.
    fn with_arena<R>(
        &self,
        kv: &[LayerView<'_>],
        lens: &[(usize, usize)],
        shape: AttnShape,
        f: impl FnOnce(&DeviceKvArena, &PageTables) -> Result<R, BackendError>,
    ) -> Result<R, BackendError> {
        if let Some(cuda) = self.views_pages(kv)? {
            let arena = cuda.arena();
            let tables = self.page_tables(&arena, kv, lens, shape)?;
            return f(&arena, &tables);
        }
        let mut guard = self.mirror()?;
        let mirror = guard.as_mut().ok_or_else(|| {
            BackendError::Device("attention before any KV append on this backend".into())
        })?;
        let tables = self.tables(mirror, kv, lens, shape)?;
        f(&mirror.arena, &tables)
    }

    /// The pool's own pages, when they are [`CudaPages`] on this device.
    fn own_pages<'a>(
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
    fn views_pages<'a>(&self, kv: &[LayerView<'a>]) -> Result<Option<&'a CudaPages>, BackendError> {
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
    fn page_tables(
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
}

impl CudaBackend {
    /// The products `ws` (their 16-bit elements `bits`, all of type `h`)
    /// of the `m` rows of `x`, or of their RMSNorm, in one group launch.
    fn half_group<const N: usize>(
        &self,
        x: &CudaBuf,
        m: usize,
        norm: Option<Norm<'_, CudaMat>>,
        (h, bits): (HalfWeights, [&CudaSlice<u16>; N]),
        ws: [&CudaMat; N],
        mut outs: [&mut CudaBuf; N],
    ) -> Result<(), BackendError> {
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            out.ensure(&self.dev, m * w.rows)?;
        }
        let ns = ws.map(|w| w.rows);
        let mut views = outs
            .iter_mut()
            .map(|o| o.view_mut())
            .collect::<Result<Vec<_>, _>>()?;
        let x = x.view()?;
        match norm {
            None => self.dev.linear_half_many(h, &x, &bits, &ns, &mut views),
            Some(n) => {
                let weight = n.weight.f32s("the RMSNorm a matmul carries")?;
                self.dev
                    .linear_half_many_normed(h, &x, weight, n.eps, &bits, &ns, &mut views)
            }
        }
        .map_err(dev_err)
    }

    /// The batched append of a pass (see [`CudaBackend::kv_append_each`]):
    /// when every sequence is in this device's one device-resident pool and
    /// the spans' rows follow each other, reserves every sequence's slots,
    /// runs `launch` once with the arena, the pass's slot map and its rows,
    /// and counts the rows as written once it is enqueued. `Ok(None)`: the
    /// pass is not one for a single launch, or has no sequence (nothing
    /// was reserved or run).
    fn append_batched<S: Writable>(
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
}

/// `data` as 16-bit values when that loses nothing, by the CPU backend's
/// rule ([`cpu::exact_in`]): bf16 when every value is one (a bf16
/// checkpoint's; looked for first, so a matrix exact in both stays bf16 as
/// before), else f16 when every value is one (an f16 checkpoint's, or an
/// unquantized GGUF's f16 tensor), else `None`: f32.
fn exact_half(data: &[f32]) -> Option<(HalfWeights, Vec<u16>)> {
    // The wrappers are one u16 each: the collects reuse their allocation.
    if let Some(h) = cpu::exact_in::<cpu::Bf16>(data) {
        return Some((HalfWeights::Bf16, h.into_iter().map(|b| b.0).collect()));
    }
    cpu::exact_in::<cpu::F16>(data)
        .map(|h| (HalfWeights::F16, h.into_iter().map(|b| b.0).collect()))
}

/// The 16-bit elements of each of `ws` when all are 16-bit of one type and
/// one depth (the weights one tensor-core launch can take together).
fn half_of_one_depth<'a, const N: usize>(
    ws: &[&'a CudaMat; N],
) -> Option<(HalfWeights, [&'a CudaSlice<u16>; N])> {
    let MatData::Half(h0, _) = ws.first()?.data else {
        return None;
    };
    let half = |w: &&'a CudaMat| match &w.data {
        MatData::Half(h, d) if *h == h0 && w.cols == ws[0].cols => Some(d),
        _ => None,
    };
    // Asked twice a layer: no allocation.
    let mut out = [half(ws.first()?)?; N];
    for (o, w) in out.iter_mut().zip(ws) {
        *o = half(w)?;
    }
    Some((h0, out))
}

fn dev_err(e: CudaError) -> BackendError {
    match e {
        CudaError::TokenOutOfRange { token, vocab } => {
            BackendError::TokenOutOfRange { token, vocab }
        }
        CudaError::Unsupported { what, detail } => BackendError::Unsupported { what, detail },
        other => BackendError::Device(other.to_string()),
    }
}

impl Backend for CudaBackend {
    type Buf = CudaBuf;
    type Mat = CudaMat;

    fn name(&self) -> &'static str {
        "cuda"
    }

    /// Host pools (mirrored) and device-resident pools on [`CudaPages`].
    /// Opens the pass on the device: with graphs on
    /// ([`CudaDevice::set_graphs`]), its launches are recorded and queued
    /// (or replayed as one graph) at its flushes, the last before this
    /// returns.
    fn run_pass<R: Send, F: FnOnce() -> R + Send>(&self, rows: usize, weights: usize, f: F) -> R {
        let _ = (rows, weights);
        let _pass = self.dev.begin_pass();
        f()
    }

    fn accepts_kv(&self, _r: Residence) -> bool {
        true
    }

    /// Device-resident ([`CudaPages`]) with [`CudaBackend::device_kv`],
    /// host memory otherwise.
    fn new_pool(&self, cfg: PoolConfig) -> Result<KvPool, PoolError> {
        if !self.device_kv {
            return KvPool::new(cfg);
        }
        let pages = CudaPages::for_pool(&self.dev, &cfg).map_err(|e| {
            PoolError::Device(DeviceError {
                device: self.dev.name().to_string(),
                what: format!(
                    "allocating {} bytes of KV pages",
                    cfg.storage_bytes().unwrap_or(usize::MAX)
                ),
                reason: e.to_string(),
            })
        })?;
        KvPool::with_device_pages(cfg, Box::new(pages))
    }

    fn supports_qk_norm(&self) -> Result<(), BackendError> {
        // The RMSNorm kernel takes any row length, but no GPU story has
        // checked it over head rows yet: refuse rather than serve unchecked.
        Err(BackendError::Unsupported {
            what: "per-head q/k RMS norm",
            detail: "(Qwen3) on the CUDA backend".into(),
        })
    }

    fn supports(&self, s: AttnShape) -> Result<(), BackendError> {
        s.check()?;
        let unsupported = |what, detail| Err(BackendError::Unsupported { what, detail });
        if !HEAD_DIMS.contains(&s.head_dim) {
            return unsupported(
                "head_dim",
                format!("{} (compiled: {HEAD_DIMS:?})", s.head_dim),
            );
        }
        // Decode serves ratios past the largest compiled group in head
        // slices of it (cuda/decode_attention.cuh): one grid row per slice.
        // Prefill's scalar kernel, which every dtype and head dim has, takes
        // at most PREFILL_MAX_GROUP.
        let group = s.n_heads / s.n_kv_heads;
        if group > PREFILL_MAX_GROUP {
            return unsupported(
                "query heads per KV head",
                format!("{group} (prefill takes at most {PREFILL_MAX_GROUP})"),
            );
        }
        let most = DECODE_GROUPS[DECODE_GROUPS.len() - 1];
        let rows = s.n_kv_heads.saturating_mul(group.div_ceil(most));
        if rows > 65_535 {
            return unsupported("KV heads x head slices", format!("{rows} (at most 65535)"));
        }
        Ok(())
    }

    fn upload(&self, data: Vec<f32>, rows: usize, cols: usize) -> Result<CudaMat, BackendError> {
        let want =
            rows.checked_mul(cols)
                .ok_or(shape_err("upload", "rows * cols overflows", 0, 0))?;
        if data.len() != want || want == 0 {
            return Err(shape_err(
                "upload",
                "rows * cols (non-zero)",
                want,
                data.len(),
            ));
        }
        // A matrix of exact bf16 (or f16) values stays 16-bit (vectors stay
        // f32).
        let half = (self.bf16_weights && rows > 1 && cols > 1)
            .then(|| exact_half(&data))
            .flatten();
        let data = match half {
            Some((h, bits)) => MatData::Half(h, self.dev.upload(&bits).map_err(dev_err)?),
            None => MatData::F32(self.dev.upload(&data).map_err(dev_err)?),
        };
        Ok(CudaMat { data, rows, cols })
    }

    /// Quantized matrices (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K;
    /// a [`QuantMatrix`] holds whole blocks per row) stay in their ggml
    /// blocks on the device; the kernels widen each value as
    /// [`QuantMatrix::dequantize`] does. A single row (a vector, which ops
    /// read as f32) is widened here, as [`Backend::upload`] keeps vectors.
    fn upload_quant(&self, q: QuantMatrix) -> Result<CudaMat, BackendError> {
        let (rows, cols) = (q.rows(), q.cols());
        match QuantWeights::of(q.ggml_type()) {
            Some(f) if rows > 1 => {
                let data = MatData::Quant(f, self.dev.upload(q.bytes()).map_err(dev_err)?);
                Ok(CudaMat { data, rows, cols })
            }
            _ => self.upload(q.dequantize(), rows, cols),
        }
    }

    fn shape(&self, m: &CudaMat) -> (usize, usize) {
        (m.rows, m.cols)
    }

    /// Bytes as placed: 2 per element of a 16-bit matrix, 4 otherwise.
    fn mat_bytes(&self, m: &CudaMat) -> usize {
        match m.data {
            MatData::F32(_) => m.len() * 4,
            MatData::Half(..) => m.len() * 2,
            MatData::Quant(q, _) => m.rows * (m.cols / q.block_values()) * q.block_bytes(),
        }
    }

    fn len(&self, buf: &CudaBuf) -> usize {
        buf.len
    }

    /// Samples on the device (cuda/sampling.cuh): the logits stay there and
    /// only the token ids (or a failed row's culprit) and the
    /// log-probabilities asked for come back, after one sync.
    fn sample(
        &self,
        logits: &CudaBuf,
        vocab: usize,
        draws: &[crate::sampling::Draw],
        out: &mut Vec<Result<u32, crate::sampling::SamplingError>>,
        logprobs: &mut Vec<Option<crate::sampling::TokenLogprobs>>,
    ) -> Result<(), BackendError> {
        out.clear();
        logprobs.clear();
        if draws.is_empty() {
            return Ok(());
        }
        // The pass up to its logits is queued (or replayed) apart from the
        // sampling, whose draws are new every step.
        self.dev.flush().map_err(dev_err)?;
        let (tokens, lps) = self
            .dev
            .sample_rows(&logits.view()?, vocab, draws)
            .map_err(dev_err)?;
        *out = tokens;
        *logprobs = lps;
        Ok(())
    }

    fn to_host(&self, buf: &CudaBuf, out: &mut Vec<f32>) -> Result<(), BackendError> {
        out.clear();
        if buf.len > 0 {
            out.extend(self.dev.download(&buf.view()?).map_err(dev_err)?);
        }
        Ok(())
    }

    fn embed(
        &self,
        table: &CudaMat,
        tokens: &[u32],
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        out.ensure(&self.dev, tokens.len() * table.cols)?;
        let out = &mut out.view_mut()?;
        match &table.data {
            MatData::F32(t) => self.dev.embedding(t, table.cols, tokens, out),
            MatData::Half(h, t) => self.dev.embedding_half(*h, t, table.cols, tokens, out),
            MatData::Quant(q, t) => self.dev.embedding_quant(*q, t, table.cols, tokens, out),
        }
        .map_err(dev_err)?;
        // Queued now: its token ids are new every step, and the rest of the
        // pass, recorded apart, can then replay as one graph.
        self.dev.flush().map_err(dev_err)
    }

    fn rms_norm(
        &self,
        x: &CudaBuf,
        weight: &CudaMat,
        eps: f32,
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        rows_of("rms_norm", x.len, weight.len())?;
        out.ensure(&self.dev, x.len)?;
        self.dev
            .rms_norm(
                &x.view()?,
                weight.f32s("rms_norm")?,
                &mut out.view_mut()?,
                eps,
            )
            .map_err(dev_err)
    }

    fn matmul(&self, x: &CudaBuf, w: &CudaMat, out: &mut CudaBuf) -> Result<(), BackendError> {
        let m = rows_of("matmul", x.len, w.cols)?;
        out.ensure(&self.dev, m * w.rows)?;
        let (x, out) = (&x.view()?, &mut out.view_mut()?);
        match &w.data {
            MatData::F32(d) => self.dev.linear(x, d, w.rows, out),
            MatData::Half(h, d) => self.dev.linear_half(*h, x, d, w.rows, out),
            MatData::Quant(q, d) => self.dev.linear_quant(*q, x, d, w.rows, w.cols, out),
        }
        .map_err(dev_err)
    }

    fn matmul_many<const N: usize>(
        &self,
        x: &CudaBuf,
        ws: [&CudaMat; N],
        outs: [&mut CudaBuf; N],
    ) -> Result<(), BackendError> {
        // 16-bit weights of one type and depth: one launch for all of them
        // (each product with the bits of its own). Anything else: one each.
        let Some(half) = half_of_one_depth(&ws).filter(|_| N >= 2 && N <= LMMA_GROUPS) else {
            for (w, out) in ws.into_iter().zip(outs) {
                self.matmul(x, w, out)?;
            }
            return Ok(());
        };
        let m = rows_of("matmul", x.len, ws[0].cols)?;
        self.half_group(x, m, None, half, ws, outs)
    }

    fn norm_matmul_many<const N: usize>(
        &self,
        x: &CudaBuf,
        norm: Norm<'_, CudaMat>,
        xn: &mut CudaBuf,
        ws: [&CudaMat; N],
        outs: [&mut CudaBuf; N],
    ) -> Result<(), BackendError> {
        let m = rows_of("norm_matmul_many", x.len, norm.weight.len())?;
        let half = half_of_one_depth(&ws);
        let Some(half) =
            half.filter(|_| m <= NORM_CARRY_ROWS && N <= LMMA_GROUPS && self.carries_stages())
        else {
            self.rms_norm(x, norm.weight, norm.eps, xn)?;
            return self.matmul_many(xn, ws, outs);
        };
        self.half_group(x, m, Some(norm), half, ws, outs)
    }

    fn norm_swiglu(
        &self,
        x: &CudaBuf,
        norm: Norm<'_, CudaMat>,
        xn: &mut CudaBuf,
        ws: [&CudaMat; 2],
        outs: [&mut CudaBuf; 2],
    ) -> Result<(), BackendError> {
        let m = rows_of("norm_swiglu", x.len, norm.weight.len())?;
        let [gate, up] = outs;
        let pair = half_of_one_depth(&ws).filter(|_| {
            m < LGEMM_BM && ws[0].rows == ws[1].rows && ws[0].cols == norm.weight.len()
        });
        let Some((h, [w_gate, w_up])) = pair.filter(|_| self.carries_stages()) else {
            self.norm_matmul_many(x, norm, xn, ws, [&mut *gate, &mut *up])?;
            return self.swiglu(gate, up);
        };
        gate.ensure(&self.dev, m * ws[0].rows)?;
        let weight = norm.weight.f32s("norm_swiglu")?;
        if m <= NORM_CARRY_ROWS {
            // The norm rides in the loads too.
            return self
                .dev
                .linear_half_swiglu(
                    h,
                    &x.view()?,
                    Some((weight, norm.eps)),
                    w_gate,
                    w_up,
                    ws[0].rows,
                    &mut gate.view_mut()?,
                )
                .map_err(dev_err);
        }
        self.rms_norm(x, norm.weight, norm.eps, xn)?;
        self.dev
            .linear_half_swiglu(
                h,
                &xn.view()?,
                None::<(&CudaSlice<f32>, f32)>,
                w_gate,
                w_up,
                ws[0].rows,
                &mut gate.view_mut()?,
            )
            .map_err(dev_err)
    }

    fn matmul_add(
        &self,
        a: &CudaBuf,
        w: &CudaMat,
        _tmp: &mut CudaBuf,
        x: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        // One launch that adds each product to x as it stores it: the bits
        // of matmul then add_assign, one launch and no round trip through
        // a buffer.
        let m = rows_of("matmul_add", a.len, w.cols)?;
        if x.len != m * w.rows {
            return Err(shape_err(
                "matmul_add",
                "residual length",
                m * w.rows,
                x.len,
            ));
        }
        let (a, x) = (&a.view()?, &mut x.view_mut()?);
        match &w.data {
            MatData::F32(d) => self.dev.linear_add(a, d, w.rows, x),
            MatData::Half(h, d) => self.dev.linear_half_add(*h, a, d, w.rows, x),
            MatData::Quant(q, d) => self.dev.linear_quant_add(*q, a, d, w.rows, w.cols, x),
        }
        .map_err(dev_err)
    }

    fn add_bias(&self, x: &mut CudaBuf, bias: &CudaMat) -> Result<(), BackendError> {
        rows_of("add_bias", x.len, bias.len())?;
        self.dev
            .add_assign(&mut x.view_mut()?, bias.f32s("add_bias")?)
            .map_err(dev_err)
    }

    fn add_assign(&self, x: &mut CudaBuf, y: &CudaBuf) -> Result<(), BackendError> {
        if x.len != y.len {
            return Err(shape_err("add_assign", "lengths", x.len, y.len));
        }
        self.dev
            .add_assign(&mut x.view_mut()?, &y.view()?)
            .map_err(dev_err)
    }

    fn rope(&self, x: &mut CudaBuf, positions: &[usize], rope: Rope) -> Result<(), BackendError> {
        check_rope_rows(x.len, positions, rope.n_heads * rope.head_dim)?;
        let pos = self.device_positions(positions)?;
        self.dev
            .rope(&mut x.view_mut()?, &*pos, rope)
            .map_err(dev_err)
    }

    fn rope_qk(
        &self,
        q: &mut CudaBuf,
        k: &mut CudaBuf,
        positions: &[usize],
        rope: Rope,
        k_heads: usize,
    ) -> Result<(), BackendError> {
        check_rope_rows(q.len, positions, rope.n_heads * rope.head_dim)?;
        check_rope_rows(k.len, positions, k_heads * rope.head_dim)?;
        let pos = self.device_positions(positions)?;
        self.dev
            .rope_pair(&mut q.view_mut()?, &mut k.view_mut()?, k_heads, &*pos, rope)
            .map_err(dev_err)
    }

    fn swiglu(&self, gate: &mut CudaBuf, up: &CudaBuf) -> Result<(), BackendError> {
        if gate.len != up.len {
            return Err(shape_err("swiglu", "lengths", gate.len, up.len));
        }
        self.dev
            .swiglu(&mut gate.view_mut()?, &up.view()?)
            .map_err(dev_err)
    }

    fn gather_rows(
        &self,
        x: &CudaBuf,
        cols: usize,
        rows: &[usize],
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        let n = rows_of("gather_rows", x.len, cols)?;
        let ids: Vec<u32> = rows
            .iter()
            .map(|&r| {
                u32::try_from(r)
                    .ok()
                    .filter(|&r| (r as usize) < n)
                    .ok_or(shape_err("gather_rows", "row index below", n, r))
            })
            .collect::<Result<_, _>>()?;
        out.ensure(&self.dev, rows.len() * cols)?;
        if rows.is_empty() {
            return Ok(());
        }
        self.dev
            .embedding(&x.view()?, cols, &ids, &mut out.view_mut()?)
            .map_err(dev_err)
    }

    fn kv_append<S: Writable>(
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

    /// One slot map and one launch for the whole pass when every sequence
    /// is in the same device-resident pool and the spans' rows follow each
    /// other, instead of an upload and a launch per sequence and layer: the
    /// host cost that grew with the batch (an H200 run measured 84 ms of
    /// host time per step at batch 256, 0.77 of the step, ~20 µs for each
    /// of its 4,096 per-sequence appends).
    /// Every reservation is checked before anything is launched, and no row
    /// counts as written before the launch is enqueued; on any error none
    /// of the pass's rows for this layer count. Otherwise, one
    /// [`Backend::kv_append`] per sequence.
    fn kv_append_each<S: Writable>(
        &self,
        seqs: &mut [&mut KvSeq<S>],
        layer: usize,
        k: &CudaBuf,
        v: &CudaBuf,
        spans: &[SeqSpan],
    ) -> Result<(), (usize, BackendError)> {
        let batched =
            self.append_batched(seqs, layer, k.len, v.len, spans, |arena, map, rows| {
                let kvd = arena.geometry().kv_dim();
                let elems = rows.start * kvd..rows.end * kvd;
                let k_rows = k.view()?.slice(elems.clone());
                let v_rows = v.view()?.slice(elems);
                self.dev
                    .kv_append(arena, layer, map, &k_rows, &v_rows)
                    .map_err(dev_err)
            })?;
        if batched.is_none() {
            for (i, (seq, span)) in seqs.iter_mut().zip(spans).enumerate() {
                self.kv_append(seq, layer, k, v, span.row_range())
                    .map_err(|e| (i, e))?;
            }
        }
        Ok(())
    }

    /// RoPE and the append in one launch where the append is batched (see
    /// [`CudaBackend::kv_append_each`]) and covers every row of the pass:
    /// one launch a layer fewer, with the bits of the two.
    fn rope_qk_append_each<S: Writable>(
        &self,
        q: &mut CudaBuf,
        k: &mut CudaBuf,
        v: &CudaBuf,
        positions: &[usize],
        rope: Rope,
        k_heads: usize,
        seqs: &mut [&mut KvSeq<S>],
        layer: usize,
        spans: &[SeqSpan],
    ) -> Result<(), (usize, BackendError)> {
        let every_row = !positions.is_empty()
            && spans.first().is_some_and(|s| s.first_row == 0)
            && spans.last().map(|s| s.first_row + s.rows) == Some(positions.len());
        if every_row {
            let checks = check_rope_rows(q.len, positions, rope.n_heads * rope.head_dim)
                .and_then(|()| check_rope_rows(k.len, positions, k_heads * rope.head_dim));
            checks.map_err(|e| (0, e))?;
            let pos = self.device_positions(positions).map_err(|e| (0, e))?;
            let k_len = k.len;
            let batched =
                self.append_batched(seqs, layer, k_len, v.len, spans, |arena, map, _| {
                    self.dev
                        .rope_pair_append(
                            &mut q.view_mut()?,
                            &mut k.view_mut()?,
                            k_heads,
                            &*pos,
                            rope,
                            arena,
                            layer,
                            map,
                            &v.view()?,
                        )
                        .map_err(dev_err)
                })?;
            if batched.is_some() {
                return Ok(());
            }
        }
        self.rope_qk(q, k, positions, rope, k_heads)
            .map_err(|e| (0, e))?;
        self.kv_append_each(seqs, layer, k, v, spans)
    }

    fn attention_prefill(
        &self,
        q: &CudaBuf,
        kv: &[LayerView<'_>],
        spans: &[SeqSpan],
        shape: AttnShape,
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        let rows = rows_of("attention_prefill", q.len, shape.q_dim())?;
        if kv.len() != spans.len() || spans.is_empty() {
            return Err(shape_err(
                "attention_prefill",
                "one KV view per span (at least one)",
                spans.len(),
                kv.len(),
            ));
        }
        if kv.iter().any(|v| v.layer_index() != kv[0].layer_index()) {
            return Err(shape_err(
                "attention_prefill",
                "views of one layer",
                kv[0].layer_index(),
                0,
            ));
        }
        let mut next_row = 0;
        let mut lens = Vec::with_capacity(spans.len());
        for (s, (span, view)) in spans.iter().zip(kv).enumerate() {
            if span.first_row != next_row || span.rows == 0 {
                return Err(shape_err(
                    "attention_prefill",
                    "non-empty spans contiguous from row 0",
                    next_row,
                    span.first_row,
                ));
            }
            next_row += span.rows;
            check_view(view, shape, s, span.end_pos())?;
            lens.push((span.end_pos(), span.rows));
        }
        if next_row != rows {
            return Err(shape_err(
                "attention_prefill",
                "rows covered by spans",
                rows,
                next_row,
            ));
        }
        out.ensure(&self.dev, q.len)?;
        self.with_arena(kv, &lens, shape, |arena, tables| {
            self.dev
                .prefill_attention(
                    arena,
                    kv[0].layer_index(),
                    tables,
                    shape.n_heads,
                    &q.view()?,
                    &mut out.view_mut()?,
                )
                .map_err(dev_err)
        })
    }

    fn attention_decode(
        &self,
        q: &CudaBuf,
        kv: &[LayerView<'_>],
        shape: AttnShape,
        out: &mut CudaBuf,
    ) -> Result<(), BackendError> {
        let rows = rows_of("attention_decode", q.len, shape.q_dim())?;
        if kv.len() != rows || rows == 0 {
            return Err(shape_err(
                "attention_decode",
                "one KV view per query row",
                rows,
                kv.len(),
            ));
        }
        let mut lens = Vec::with_capacity(rows);
        for (s, view) in kv.iter().enumerate() {
            check_view(view, shape, s, 1)?;
            lens.push((view.len(), 1));
        }
        if kv.iter().any(|v| v.layer_index() != kv[0].layer_index()) {
            return Err(shape_err(
                "attention_decode",
                "views of one layer",
                kv[0].layer_index(),
                0,
            ));
        }
        out.ensure(&self.dev, q.len)?;
        let mut ws = self
            .workspace
            .lock()
            .map_err(|_| BackendError::Device("decode workspace lock poisoned".into()))?;
        let kernel = self.decode_kernel();
        self.with_arena(kv, &lens, shape, |arena, tables| {
            self.dev
                .decode_attention_with(
                    arena,
                    kv[0].layer_index(),
                    tables,
                    shape.n_heads,
                    &q.view()?,
                    &mut out.view_mut()?,
                    &mut ws,
                    Split::Auto,
                    kernel,
                )
                .map(drop)
                .map_err(dev_err)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every quantized type the crate computes with is one the device reads
    /// in its blocks (none is widened when placed), with ggml's own block
    /// sizes; the float types are not.
    #[test]
    fn every_computable_quantized_type_stays_in_its_blocks_on_the_device() {
        use crate::backend::GgmlType;
        for ty in GgmlType::every() {
            let quantized = ty.computable() && ty.block_elems() > 1;
            let q = QuantWeights::of(ty);
            assert_eq!(q.is_some(), quantized, "{ty:?}");
            if let Some(q) = q {
                assert_eq!(q.ggml(), ty);
                assert_eq!(q.block_bytes() as u64, ty.block_bytes());
            }
        }
    }

    /// A matrix stays 16-bit only when no value changes: bf16 first (a
    /// bf16 checkpoint's), then f16 (an f16 checkpoint's), else f32; the
    /// bits kept are the values' own.
    #[test]
    fn weights_stay_16_bit_only_when_every_value_is_exact_and_bf16_comes_first() {
        // Exact in both (small integers, zero, a power of two): bf16.
        let both = [0.0f32, -0.0, 1.0, -3.0, 0.5, 1024.0];
        let (h, bits) = exact_half(&both).unwrap();
        assert_eq!(h, HalfWeights::Bf16);
        let back: Vec<f32> = bits
            .iter()
            .map(|&b| f32::from_bits(u32::from(b) << 16))
            .collect();
        assert_eq!(
            back.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            both.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        // f16 values that bf16 cannot hold (11 significant bits),
        // subnormal f16 values and f16's largest: f16, bit for bit.
        let f16s: Vec<f32> = [1.0 + 2f32.powi(-10), -1.0 / 3.0, 6.0e-8, 65504.0, -0.0]
            .iter()
            .map(|&x| half::f16::from_f32(x).to_f32())
            .collect();
        assert!(f16s.iter().any(|x| x.to_bits() & 0xffff != 0));
        let (h, bits) = exact_half(&f16s).unwrap();
        assert_eq!(h, HalfWeights::F16);
        for (b, x) in bits.iter().zip(&f16s) {
            assert_eq!(half::f16::from_bits(*b).to_f32().to_bits(), x.to_bits());
        }
        // One value that neither holds (an f32 checkpoint's, a quantized
        // GGUF's widened values, f16's range passed): f32.
        for odd in [0.1f32, 1.0 + f32::EPSILON, 70000.0, 1e-10] {
            let mut v = f16s.clone();
            v.push(odd);
            assert!(exact_half(&v).is_none(), "{odd}");
        }
    }
}
