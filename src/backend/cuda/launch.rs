//! Every kernel launch (queued now, recorded for a flush, or captured into
//! a CUDA graph), and every other `unsafe` of the CUDA backend but the
//! params structs' `DeviceRepr` (params.rs) and the graph and stream
//! handles' ownership (graph.rs).
//!
//! Each public operation checks, before it launches, everything the kernel
//! relies on for memory safety: buffer lengths against the shapes in the
//! params struct, page tables and slot maps built for this arena (their
//! page indices were checked when they were built), and shapes with a
//! compiled instantiation (attention: through its plan, `plan.rs`). Then it
//! binds its buffers ([`Args`]) and calls [`CudaDevice::launch`], the one
//! launch, with the kernel the table pairs with its params struct. All work
//! runs on the device's one stream, in call order, so a buffer dropped after
//! a call is freed (stream-ordered) only after the kernels that use it.

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, SyncOnDrop};

use super::arena::{DeviceKvArena, Packed, PageTables, SlotMap};
use super::graph;
use super::kernels::{self, Kernel, KernelId};
use super::params::*;
use super::plan::{
    self, Attn, Batch, DecodeKernel, DecodePlan, Grid, PrefillKernel, Split, Step, grid,
    grid_stride, shape, to_u32,
};
use super::table::{
    CHECKSUM_WARPS, LGEMM_BM, LGEMM_BN, LIN_COLS, LIN_ROWS_FEW, LIN_ROWS_MANY, LIN_ROWS_ONE,
    LMMA_BM, LMMA_BN, LMMA_GROUPS, LMMA_WIDE_BM, LMMA_WIDE_BN, LOGPROB_STRIDE,
};
use super::{CudaDevice, CudaError};
use crate::backend::Rope;
use crate::backend::{RopeScaling, RopeStyle};
use crate::kv::KvDtype;
use crate::sampling::{Draw, MAX_TOP_LOGPROBS, MAX_VOCAB, SamplingError, TokenLogprobs};

/// True when libcuda can be loaded (checked before any driver call, since
/// cudarc's context creation panics without it).
pub(super) fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library and drops the handle.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// `(m, k)` of `x · wᵀ` for `x_len` inputs, `w_len` weights of `n` rows and
/// `out_len` outputs, or `None` for an empty batch; a typed error for any
/// inconsistency.
fn matmul_shape(
    x_len: usize,
    w_len: usize,
    n: usize,
    out_len: usize,
) -> Result<Option<(usize, usize)>, CudaError> {
    if n == 0 || !w_len.is_multiple_of(n) || w_len == 0 {
        return Err(CudaError::Shape {
            what: "weight (a non-empty multiple of its output rows)",
            expected: n,
            got: w_len,
        });
    }
    let k = w_len / n;
    if !x_len.is_multiple_of(k) {
        return Err(CudaError::Shape {
            what: "matmul input (a multiple of the weight's columns)",
            expected: k,
            got: x_len,
        });
    }
    let m = x_len / k;
    shape("matmul output elements", m * n, out_len)?;
    Ok((m > 0).then_some((m, k)))
}

/// How a weight matrix kept in 16 bits (as its checkpoint stored it) is
/// stored on the device: the tensor-core matmuls (cuda/linear_mma.cuh)
/// and the embedding gather are compiled for both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HalfWeights {
    /// bf16 (raw bits): meets x's bf16 parts in two mma a k-step.
    Bf16,
    /// f16 (raw bits): split into exact bf16 parts in registers, four mma
    /// a k-step.
    F16,
}

impl HalfWeights {
    /// The element type the kernel table lists it under.
    fn dtype(self) -> KvDtype {
        match self {
            HalfWeights::Bf16 => KvDtype::BF16,
            HalfWeights::F16 => KvDtype::F16,
        }
    }
}

/// A weight matrix kept in the ggml block format its GGUF checkpoint stored
/// it in: the f32 matmul's shapes read it as stored (cuda/linear_f32.cuh),
/// widening each value as the CPU backend does, so a product has the bits
/// of the f32 matmul on the widened weights at 0.56 to 1.06 bytes a weight
/// instead of 4. Rows are whole blocks of 32 values (256 for the K types).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantWeights {
    /// `[f16 d][32 x i8]`, 34 bytes a block: `d * q`.
    Q8_0,
    /// `[f16 d][16 bytes of nibbles]`, 18 bytes: `d * (q - 8)`.
    Q4_0,
    /// `[f16 d][f16 m][16 bytes of nibbles]`, 20 bytes: `q * d + m` fused.
    Q4_1,
    /// `[f16 d][u32 fifth bits][16 bytes of nibbles]`, 22 bytes:
    /// `d * (q - 16)`.
    Q5_0,
    /// `[f16 d][f16 m][u32 fifth bits][16 bytes of nibbles]`, 24 bytes:
    /// `q * d + m` fused.
    Q5_1,
    /// 256 values in 144 bytes: 8 sub-blocks with 6-bit scales and mins.
    Q4K,
    /// Q4_K with a fifth bit a value: 176 bytes.
    Q5K,
    /// 256 values in 210 bytes: 6 bits a value, 16 signed 8-bit scales.
    Q6K,
}

impl QuantWeights {
    /// The format of a GGUF quantized tensor type (every one this crate
    /// computes with; `None` for the float types).
    pub fn of(ty: crate::backend::GgmlType) -> Option<Self> {
        use crate::backend::GgmlType;
        match ty {
            GgmlType::Q8_0 => Some(QuantWeights::Q8_0),
            GgmlType::Q4_0 => Some(QuantWeights::Q4_0),
            GgmlType::Q4_1 => Some(QuantWeights::Q4_1),
            GgmlType::Q5_0 => Some(QuantWeights::Q5_0),
            GgmlType::Q5_1 => Some(QuantWeights::Q5_1),
            GgmlType::Q4K => Some(QuantWeights::Q4K),
            GgmlType::Q5K => Some(QuantWeights::Q5K),
            GgmlType::Q6K => Some(QuantWeights::Q6K),
            _ => None,
        }
    }

    /// The GGUF tensor type it is ([`QuantWeights::of`]'s inverse).
    pub fn ggml(self) -> crate::backend::GgmlType {
        use crate::backend::GgmlType;
        match self {
            QuantWeights::Q8_0 => GgmlType::Q8_0,
            QuantWeights::Q4_0 => GgmlType::Q4_0,
            QuantWeights::Q4_1 => GgmlType::Q4_1,
            QuantWeights::Q5_0 => GgmlType::Q5_0,
            QuantWeights::Q5_1 => GgmlType::Q5_1,
            QuantWeights::Q4K => GgmlType::Q4K,
            QuantWeights::Q5K => GgmlType::Q5K,
            QuantWeights::Q6K => GgmlType::Q6K,
        }
    }

    /// Bytes of one block (ggml's table, [`GgmlType::block_bytes`]).
    ///
    /// [`GgmlType::block_bytes`]: crate::backend::GgmlType::block_bytes
    pub fn block_bytes(self) -> usize {
        self.ggml().block_bytes() as usize
    }

    /// Values in one block (ggml's table).
    pub fn block_values(self) -> usize {
        self.ggml().block_elems() as usize
    }

    /// `QFMT_*` in params.cuh.
    fn code(self) -> u32 {
        match self {
            QuantWeights::Q8_0 => QFMT_Q8_0,
            QuantWeights::Q4_0 => QFMT_Q4_0,
            QuantWeights::Q4_1 => QFMT_Q4_1,
            QuantWeights::Q5_0 => QFMT_Q5_0,
            QuantWeights::Q5_1 => QFMT_Q5_1,
            QuantWeights::Q4K => QFMT_Q4_K,
            QuantWeights::Q5K => QFMT_Q5_K,
            QuantWeights::Q6K => QFMT_Q6_K,
        }
    }

    /// Checks that `len` bytes are `rows` rows of `cols` values in this
    /// format (`cols` a multiple of a block's values).
    fn check(
        self,
        what: &'static str,
        len: usize,
        rows: usize,
        cols: usize,
    ) -> Result<(), CudaError> {
        let per = self.block_values();
        if cols == 0 || !cols.is_multiple_of(per) {
            return Err(CudaError::Shape {
                what: "ggml-block columns (a non-zero multiple of a block's values)",
                expected: cols.next_multiple_of(per).max(per),
                got: cols,
            });
        }
        let want = rows
            .checked_mul(cols / per)
            .and_then(|b| b.checked_mul(self.block_bytes()))
            .unwrap_or(usize::MAX);
        shape(what, want, len)
    }
}

/// The block shapes of the f32 and ggml-block matmuls (cuda/linear_f32.cuh):
/// one row of x, a few or many per block, by m. Every output gets the same
/// bits from each; the small ones waste fewer loads and products.
#[derive(Clone, Copy, Debug)]
enum LinShape {
    One,
    Few,
    Many,
}

impl LinShape {
    /// The shape for `m` rows and the 1-D grid of its (row tile, block of
    /// `LIN_COLS` columns) pairs for `n` columns; `None` when there is
    /// nothing to launch.
    fn for_launch(m: usize, n: usize) -> Result<Option<(Self, Grid)>, CudaError> {
        let (shape, rows) = match m {
            1 => (LinShape::One, LIN_ROWS_ONE),
            2..=LIN_ROWS_FEW => (LinShape::Few, LIN_ROWS_FEW),
            _ => (LinShape::Many, LIN_ROWS_MANY),
        };
        let blocks = m.div_ceil(rows).saturating_mul(n.div_ceil(LIN_COLS));
        Ok(grid("matmul blocks (row tiles x column blocks)", blocks, 1, 1)?.map(|g| (shape, g)))
    }
}

/// The tensor-core matmul's tiles (cuda/linear_mma.cuh), chosen by the
/// rows of x; each gives the others' bits.
#[derive(Clone, Copy, Debug)]
enum Bf16Tile {
    /// 16 x 16, below 32 rows.
    Decode,
    /// 32 x 32, from 32 rows.
    Wide,
    /// 128 x 64 with a cp.async pipeline, from 128 rows.
    Prefill,
}

impl Bf16Tile {
    fn for_rows(m: usize) -> Self {
        if m >= LGEMM_BM {
            Bf16Tile::Prefill
        } else if m >= LMMA_WIDE_BM {
            Bf16Tile::Wide
        } else {
            Bf16Tile::Decode
        }
    }

    /// Rows of x per block.
    fn rows(self) -> usize {
        match self {
            Bf16Tile::Decode => LMMA_BM,
            Bf16Tile::Wide => LMMA_WIDE_BM,
            Bf16Tile::Prefill => LGEMM_BM,
        }
    }

    /// Output columns per block.
    fn cols(self) -> usize {
        match self {
            Bf16Tile::Decode => LMMA_BN,
            Bf16Tile::Wide => LMMA_WIDE_BN,
            Bf16Tile::Prefill => LGEMM_BN,
        }
    }

    /// Ok when `tile` carries `stage` in its loads or stores: the tiles up
    /// to `widest` do (decode, then wide), the prefill tile none.
    fn carries(stage: &'static str, tile: Self, widest: Self) -> Result<(), CudaError> {
        if tile.rows() <= widest.rows() {
            return Ok(());
        }
        Err(CudaError::Unsupported {
            what: "a stage carried into the tensor-core matmul",
            detail: format!("{stage} on the {tile:?} tile (it rides up to the {widest:?} tile)"),
        })
    }

    /// This tile's kernel as the lookup found it, or which is missing.
    fn kernel<P>(self, h: HalfWeights, found: Option<Kernel<P>>) -> Result<Kernel<P>, CudaError> {
        found.ok_or_else(|| CudaError::MissingKernel {
            name: format!("the {self:?} tile of the tensor-core matmul for {h:?} weights"),
        })
    }
}

/// Most buffers one launch binds.
const MAX_ARGS: usize = 8;

/// The buffers one launch reads and writes: each one's device address for
/// the params struct, and the stream guard that orders it, held until the
/// launch is queued (see [`CudaDevice::launch`]).
struct Args<'a> {
    stream: &'a CudaStream,
    guards: [Option<SyncOnDrop<'a>>; MAX_ARGS],
    bound: usize,
}

impl<'a> Args<'a> {
    fn new(stream: &'a CudaStream) -> Self {
        Args {
            stream,
            guards: [const { None }; MAX_ARGS],
            bound: 0,
        }
    }

    /// The address of a buffer the kernel reads.
    fn read<T>(&mut self, buf: &'a impl DevicePtr<T>) -> u64 {
        let (ptr, guard) = buf.device_ptr(self.stream);
        self.hold(guard);
        ptr
    }

    /// The address of a buffer the kernel writes.
    fn write<T>(&mut self, buf: &'a mut impl DevicePtrMut<T>) -> u64 {
        let (ptr, guard) = buf.device_ptr_mut(self.stream);
        self.hold(guard);
        ptr
    }

    /// The addresses of the arrays of a packed buffer, which the kernel
    /// reads.
    fn read_arrays<const N: usize>(&mut self, packed: &'a Packed<N>) -> [u64; N] {
        let base = self.read(&packed.data);
        packed.at.map(|at| base + 4 * at as u64)
    }

    fn hold(&mut self, guard: SyncOnDrop<'a>) {
        if let Some(slot) = self.guards.get_mut(self.bound) {
            *slot = Some(guard);
        }
        // Past MAX_ARGS the guard is dropped here and the launch refused.
        self.bound += 1;
    }
}

/// The append a RoPE launch also carries out ([`CudaDevice::rope_pair_append`]).
struct Append<'a, V> {
    arena: &'a mut DeviceKvArena,
    layer: usize,
    slots: &'a SlotMap,
    v: &'a V,
}

/// Scratch buffers of split-KV decode, grown on demand and reused.
#[derive(Default)]
pub struct DecodeWorkspace {
    part_o: Option<CudaSlice<f32>>,
    part_lse: Option<CudaSlice<f32>>,
}

impl DecodeWorkspace {
    fn ensure(
        &mut self,
        dev: &CudaDevice,
        size: plan::Workspace,
    ) -> Result<(&mut CudaSlice<f32>, &mut CudaSlice<f32>), CudaError> {
        // A recorded launch may still use a buffer replaced here.
        if self.part_o.as_ref().is_none_or(|b| b.len() < size.part_o)
            && let Some(old) = self.part_o.replace(dev.zeros(size.part_o)?)
        {
            dev.retire(old);
        }
        if self
            .part_lse
            .as_ref()
            .is_none_or(|b| b.len() < size.part_lse)
            && let Some(old) = self.part_lse.replace(dev.zeros(size.part_lse)?)
        {
            dev.retire(old);
        }
        match (self.part_o.as_mut(), self.part_lse.as_mut()) {
            (Some(o), Some(l)) => Ok((o, l)),
            _ => Err(CudaError::Shape {
                what: "decode workspace",
                expected: size.part_o,
                got: 0,
            }),
        }
    }
}

/// Transfer checksums of KV pages computed on the device (see
/// [`CudaDevice::page_checksums`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use]
pub struct PageChecksums {
    /// Region hashes as `[page][layer][K, V]`, pages in the order given.
    pub regions: Vec<u64>,
    /// One checksum per page given, in that order.
    pub pages: Vec<u64>,
}

fn batch_of(tables: &PageTables) -> Batch {
    Batch {
        batch: tables.batch,
        total_q: tables.total_q,
        max_q_len: tables.max_q_len,
        max_kv_len: tables.max_kv_len,
    }
}

/// Binds what both decode launches read: q, the arena and the page tables.
fn bind_decode<'a>(
    args: &mut Args<'a>,
    p: &mut DecodeParams,
    q: &'a impl DevicePtr<f32>,
    arena: &'a DeviceKvArena,
    tables: &'a PageTables,
) {
    p.q = args.read(q);
    p.kv = args.read(&arena.data);
    let [page_table, page_indptr, _, kv_len] = args.read_arrays(&tables.arrays);
    (p.page_table, p.page_indptr, p.kv_len) = (page_table, page_indptr, kv_len);
}

/// Ok when there is no RMSNorm to carry, or `tile` carries it (the decode
/// tile) and its weight has the matmul's depth `k`.
fn check_norm<N: DevicePtr<f32>>(
    norm: Option<(&N, f32)>,
    tile: Bf16Tile,
    k: usize,
) -> Result<(), CudaError> {
    let Some((w, _)) = norm else {
        return Ok(());
    };
    Bf16Tile::carries("RMSNorm", tile, Bf16Tile::Decode)?;
    shape("RMSNorm weight (the matmul depth)", k, w.len())
}

/// The geometry of `arena` when `slots` were built for it and it has a
/// layer `layer`: what every append checks before it writes.
fn append_target(
    arena: &DeviceKvArena,
    layer: usize,
    slots: &SlotMap,
) -> Result<crate::kv::KvGeometry, CudaError> {
    if slots.arena_id != arena.id {
        return Err(CudaError::ForeignArena);
    }
    let g = arena.geometry();
    if layer >= g.n_layers {
        return Err(CudaError::Shape {
            what: "layer (below n_layers)",
            expected: g.n_layers,
            got: layer,
        });
    }
    Ok(g)
}

impl CudaDevice {
    /// Queues `kernel` over `grid` blocks on the device's stream, with the
    /// block size and dynamic shared memory the table gives it; `args` are
    /// the guards of the buffers whose addresses `params` holds, released
    /// once the launch is queued. The crate's one kernel launch.
    fn launch<P: DeviceRepr + bytemuck::NoUninit>(
        &self,
        kernel: Kernel<P>,
        params: &P,
        grid: Grid,
        args: Args<'_>,
    ) -> Result<(), CudaError> {
        self.launch_with(kernel, params, grid, args, false)
    }

    /// [`CudaDevice::launch`], or with `overlap` for a kernel whose first
    /// instruction is `pdl_wait()` (cuda/common.cuh) and that reads nothing
    /// but what the launch before it on the stream wrote or what was there
    /// before it: queued with programmatic stream serialization, its blocks
    /// may be scheduled once every block of the launch before it has
    /// started (the decode kernels signal at their start), and wait there
    /// until that launch has completed and its writes are visible. Ask for
    /// it only where [`CudaDevice::launch_overlap`] says so; where the
    /// driver refuses the attribute, the kernel is launched as usual and
    /// overlap stays off.
    fn launch_with<P: DeviceRepr + bytemuck::NoUninit>(
        &self,
        kernel: Kernel<P>,
        params: &P,
        grid: Grid,
        args: Args<'_>,
        overlap: bool,
    ) -> Result<(), CudaError> {
        if args.bound > MAX_ARGS {
            return Err(CudaError::Unsupported {
                what: "buffers bound to one launch",
                detail: format!("{} (at most {MAX_ARGS})", args.bound),
            });
        }
        // Refused now (not at the flush) when this device cannot run it.
        self.function(kernel.id())?;
        self.inner
            .launches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // SAFETY (the launch here, or the recorded one at the flush):
        // `Kernel<P>` exists only for a compiled kernel whose parameter is
        // `P` (the table pairs them; the layout of `P` is asserted against
        // cuda/params.cuh on both sides), launched with the block size its
        // code assumes and the dynamic shared memory it was allowed at
        // load. Every caller fills `params` only from buffers it bound in
        // `args` after checking their lengths, and their indices and sizes
        // against the shapes the kernel reads (its "Launch contract"
        // comment), with `grid` the blocks the kernel indexes; the guards in
        // `args` live until the launch is queued, and a recorded launch's
        // buffers until its flush (`CudaDevice::retire`).
        let recorded =
            self.record(|| graph::Op::new(kernel.id(), grid, overlap, bytemuck::bytes_of(params)));
        let queued = if recorded {
            Ok(())
        } else {
            let params = params as *const P as *mut std::ffi::c_void;
            self.enqueue(kernel.id(), grid, params, overlap)
        };
        drop(args);
        queued
    }

    /// Queues `kernel` on the device's stream with the params struct at
    /// `params`; with `overlap`, with programmatic stream serialization,
    /// falling back to a plain launch (and overlap off from then on) where
    /// the driver refuses it.
    fn enqueue(
        &self,
        kernel: KernelId,
        grid: Grid,
        params: *mut std::ffi::c_void,
        overlap: bool,
    ) -> Result<(), CudaError> {
        let stream = self.inner.stream.cu_stream();
        if overlap {
            if self.enqueue_on(stream, kernel, grid, params, true).is_ok() {
                return Ok(());
            }
            // Refused (nothing was queued): launch as usual from now on.
            self.inner
                .overlap_ok
                .store(false, std::sync::atomic::Ordering::Relaxed);
        }
        self.enqueue_on(stream, kernel, grid, params, false)
    }

    /// The crate's one kernel launch: `kernel` over `grid` blocks on
    /// `stream` (the device's, or the capture stream), with the block size
    /// and dynamic shared memory the table gives it and the params struct
    /// at `params`. With `overlap` it is queued with programmatic stream
    /// serialization: its blocks may be scheduled once every block of the
    /// launch before it has started, and wait (its first instruction is
    /// `pdl_wait()`) until that launch has completed and its writes are
    /// visible. Callers ask for it only where
    /// [`CudaDevice::launch_overlap`] says so.
    fn enqueue_on(
        &self,
        stream: cudarc::driver::sys::CUstream,
        kernel: KernelId,
        grid: Grid,
        params: *mut std::ffi::c_void,
        overlap: bool,
    ) -> Result<(), CudaError> {
        use cudarc::driver::sys;
        let spec = kernel.spec();
        let func = self.function(kernel)?;
        self.inner
            .stream
            .context()
            .bind_to_thread()
            .map_err(CudaError::driver(spec.during))?;
        // SAFETY: CUlaunchAttribute is a plain C struct (an id and a union
        // of plain values); all zeros is a valid value of it.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: spec.threads,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: spec.dynamic_smem,
            hStream: stream,
            attrs: if overlap {
                &mut attr
            } else {
                std::ptr::null_mut()
            },
            numAttrs: u32::from(overlap),
        };
        // The kernel's one parameter, by address (as cuLaunchKernel takes
        // it).
        let mut arg = [params];
        // SAFETY: the caller's (`launch_with`'s contract, or a recorded
        // launch's, made under it); `cfg`, `attr` and `arg` outlive the
        // call, which copies them. The overlap cannot expose a partial
        // write: it is asked for only for a kernel that waits
        // (griddepcontrol.wait, compiled for every device where overlap is
        // on) before its first read.
        unsafe {
            sys::cuLaunchKernelEx(
                &cfg,
                func.cu_function(),
                arg.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(CudaError::driver(spec.during))
    }

    /// Queues a flushed list: as the graph captured from an equal list, or
    /// launch by launch (then captured when it was seen before).
    pub(super) fn run_recorded(&self, ops: Vec<graph::Op>) -> Result<(), CudaError> {
        use std::sync::atomic::Ordering::Relaxed;
        if ops.is_empty() {
            return Ok(());
        }
        let hash = graph::hash_ops(&ops);
        let mut graphs = self.inner.graphs.lock();
        let capture = match graphs.plan(&ops, hash) {
            graph::Plan::Replay(exec) => {
                let stream = self.inner.stream.cu_stream();
                let launched = self.inner.stream.context().bind_to_thread().is_ok()
                    // SAFETY: `exec` is a graph instantiated from launches
                    // equal to these in every byte (so under their
                    // contract), alive while `graphs` is locked.
                    && unsafe { cudarc::driver::result::graph::launch(exec, stream) }.is_ok();
                if launched {
                    self.inner.graph_launches.fetch_add(1, Relaxed);
                    return Ok(());
                }
                // Nothing was queued: launch by launch, and no graphs again.
                graphs.broken = true;
                false
            }
            graph::Plan::EagerThenCapture => true,
            graph::Plan::Eager => false,
        };
        for op in &ops {
            self.enqueue(op.kernel, op.grid, op.params_ptr(), op.overlap)?;
        }
        if capture {
            match self.capture(&mut graphs, &ops) {
                Ok(exec) => {
                    graphs.keep(ops, hash, exec);
                    self.inner.graph_captures.fetch_add(1, Relaxed);
                }
                Err(_) => graphs.broken = true,
            }
        }
        Ok(())
    }

    /// A graph of `ops`, captured on the capture stream (nothing runs).
    fn capture(
        &self,
        graphs: &mut graph::Graphs,
        ops: &[graph::Op],
    ) -> Result<graph::Exec, CudaError> {
        use cudarc::driver::{result, sys};
        let during = "capturing a CUDA graph";
        self.inner
            .stream
            .context()
            .bind_to_thread()
            .map_err(CudaError::driver(during))?;
        let stream = match &graphs.capture {
            Some(s) => s.handle(),
            None => {
                let s = graph::CaptureStream::new().map_err(CudaError::driver(during))?;
                graphs.capture.insert(s).handle()
            }
        };
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: `stream` is the live capture stream, used by nothing else.
        unsafe { result::stream::begin_capture(stream, mode) }
            .map_err(CudaError::driver(during))?;
        // Overlap as recorded: captured as a programmatic edge.
        let queued = ops.iter().try_for_each(|op| {
            self.enqueue_on(stream, op.kernel, op.grid, op.params_ptr(), op.overlap)
        });
        // SAFETY: as above; capture is ended whatever was queued.
        let graph = unsafe { result::stream::end_capture(stream) };
        let graph = match (queued, graph) {
            (Ok(()), Ok(g)) if !g.is_null() => g,
            (queued, graph) => {
                if let Ok(g) = graph
                    && !g.is_null()
                {
                    // SAFETY: the graph the capture made, destroyed once.
                    let _ = unsafe { result::graph::destroy(g) };
                }
                queued?;
                return Err(CudaError::Driver {
                    during,
                    detail: "the capture made no graph".into(),
                });
            }
        };
        // SAFETY: `graph` is the captured graph, valid until destroyed below.
        let exec = unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) };
        // SAFETY: the exec does not depend on the graph it was made from,
        // which is destroyed once, here.
        let _ = unsafe { result::graph::destroy(graph) };
        exec.map(graph::Exec::new)
            .map_err(CudaError::driver(during))
    }

    /// The attention shape of `n_heads` query heads over layer `layer` of
    /// `arena`, with `tables` built for that arena.
    fn attn(
        &self,
        arena: &DeviceKvArena,
        tables: &PageTables,
        layer: usize,
        n_heads: usize,
    ) -> Result<Attn, CudaError> {
        if tables.arena_id != arena.id {
            return Err(CudaError::ForeignArena);
        }
        Attn::new(
            &arena.geometry(),
            arena.page_size(),
            arena.page_elems(),
            layer,
            n_heads,
        )
    }

    /// Paged decode attention for layer `layer`: one query per sequence.
    ///
    /// `q` is `[batch, n_heads, head_dim]`, `out` the same; every sequence of
    /// `tables` must have `q_len == 1`. Returns the number of KV chunks
    /// launched per sequence, an upper bound on what each one used (1: no
    /// merge pass).
    #[allow(clippy::too_many_arguments)]
    pub fn decode_attention(
        &self,
        arena: &DeviceKvArena,
        layer: usize,
        tables: &PageTables,
        n_heads: usize,
        q: &impl DevicePtr<f32>,
        out: &mut impl DevicePtrMut<f32>,
        ws: &mut DecodeWorkspace,
        split: Split,
    ) -> Result<usize, CudaError> {
        let (splits, _) = self.decode_attention_with(
            arena,
            layer,
            tables,
            n_heads,
            q,
            out,
            ws,
            split,
            DecodeKernel::Auto,
        )?;
        Ok(splits)
    }

    /// [`CudaDevice::decode_attention`] with the kernel chosen by `kernel`;
    /// returns the KV chunks launched per sequence and the kernel that ran
    /// (never [`DecodeKernel::Auto`]).
    #[allow(clippy::too_many_arguments)]
    pub fn decode_attention_with(
        &self,
        arena: &DeviceKvArena,
        layer: usize,
        tables: &PageTables,
        n_heads: usize,
        q: &impl DevicePtr<f32>,
        out: &mut impl DevicePtrMut<f32>,
        ws: &mut DecodeWorkspace,
        split: Split,
        kernel: DecodeKernel,
    ) -> Result<(usize, DecodeKernel), CudaError> {
        let a = self.attn(arena, tables, layer, n_heads)?;
        let (chosen, plan) =
            plan::decode(&a, &batch_of(tables), q.len(), out.len(), split, kernel)?;
        let splits = plan.splits();
        // Launch contract (both launches): q and out hold
        // batch*n_heads*head_dim f32 (checked by the plan); the page tables
        // were built for this arena (id checked) with every page index
        // inside it and kv_len covered by each sequence's pages; the kernel
        // matches dtype and head_dim and its group is at least p.group, or
        // it runs in grid.y / n_kv_heads slices of its group; grid
        // (num_splits, n_kv_heads x slices, batch) as the kernel indexes,
        // and num_splits chunks cover every sequence's kv_len (fixed chunks
        // cover max_kv_len; auto chunks are at most num_splits per
        // sequence). The tensor-core kernel's 16-byte copies need pages on
        // 16 bytes (the plan checked page_stride; the arena's base is
        // allocation-aligned).
        let stream = &self.inner.stream;
        match plan {
            DecodePlan::Empty => {}
            DecodePlan::Whole(Step {
                kernel,
                mut params,
                grid,
            }) => {
                let mut args = Args::new(stream);
                bind_decode(&mut args, &mut params, q, arena, tables);
                params.out = args.write(out);
                self.launch(kernel, &params, grid, args)?;
            }
            DecodePlan::Split {
                attn,
                merge,
                workspace,
            } => {
                let (part_o, part_lse) = ws.ensure(self, workspace)?;
                let mut p = attn.params;
                let mut args = Args::new(stream);
                bind_decode(&mut args, &mut p, q, arena, tables);
                // part_o and part_lse hold at least the plan's workspace.
                p.part_o = args.write(part_o);
                p.part_lse = args.write(part_lse);
                self.launch(attn.kernel, &p, attn.grid, args)?;
                // Launch contract (merge): part_o/part_lse were sized for
                // (batch, n_heads, num_splits) and written by the launch
                // before on the same stream; out holds
                // batch*n_heads*head_dim f32; grid (n_heads, batch).
                let mut m = merge.params;
                let mut args = Args::new(stream);
                m.part_o = args.read(part_o);
                m.part_lse = args.read(part_lse);
                m.out = args.write(out);
                // The merge waits for the split launch on the device.
                let overlap = self.launch_overlap();
                self.launch_with(merge.kernel, &m, merge.grid, args, overlap)?;
            }
        }
        Ok((splits, chosen))
    }

    /// Paged causal prefill attention for layer `layer`, on tensor cores
    /// where compiled (see [`PrefillKernel::Auto`]).
    ///
    /// `q` and `out` are `[total_q, n_heads, head_dim]`, the rows of each
    /// sequence's `q_len` new positions in batch order; their K/V must
    /// already be appended (they are the last `q_len` of `kv_len`).
    #[allow(clippy::too_many_arguments)]
    pub fn prefill_attention(
        &self,
        arena: &DeviceKvArena,
        layer: usize,
        tables: &PageTables,
        n_heads: usize,
        q: &impl DevicePtr<f32>,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), CudaError> {
        self.prefill_attention_with(arena, layer, tables, n_heads, q, out, PrefillKernel::Auto)
            .map(drop)
    }

    /// [`CudaDevice::prefill_attention`] with the kernel chosen by `kernel`;
    /// returns the one that ran (never [`PrefillKernel::Auto`]).
    #[allow(clippy::too_many_arguments)]
    pub fn prefill_attention_with(
        &self,
        arena: &DeviceKvArena,
        layer: usize,
        tables: &PageTables,
        n_heads: usize,
        q: &impl DevicePtr<f32>,
        out: &mut impl DevicePtrMut<f32>,
        kernel: PrefillKernel,
    ) -> Result<PrefillKernel, CudaError> {
        let a = self.attn(arena, tables, layer, n_heads)?;
        let plan = plan::prefill(&a, &batch_of(tables), q.len(), out.len(), kernel)?;
        let Some(Step {
            kernel,
            mut params,
            grid,
        }) = plan.step
        else {
            return Ok(plan.chosen);
        };
        let mut args = Args::new(&self.inner.stream);
        params.q = args.read(q);
        params.kv = args.read(&arena.data);
        [
            params.page_table,
            params.page_indptr,
            params.q_indptr,
            params.kv_len,
        ] = args.read_arrays(&tables.arrays);
        params.out = args.write(out);
        if plan.needs_aligned_rows && (params.q % 8 != 0 || params.out % 8 != 0) {
            return Err(CudaError::Unsupported {
                what: "tensor-core prefill buffers",
                detail: "q and out must be 8-byte aligned (views at an odd element)".into(),
            });
        }
        // Launch contract: q and out hold total_q*n_heads*head_dim f32
        // (checked by the plan); the page tables were built for this arena
        // with every page inside it, each sequence's kv_len covered by its
        // pages and q_len <= kv_len; the kernel matches dtype and head_dim.
        // Scalar: group <= 32 rows per tile. Tensor cores: group <= 64 rows
        // per block (128 for the wide kernel); q and out 8-byte aligned
        // (checked) for their float2 accesses; KV rows are 16-byte
        // multiples (arena invariant) for their 16-byte loads.
        self.launch(kernel, &params, grid, args)?;
        Ok(plan.chosen)
    }

    /// Writes K/V rows `[slots.len(), kv_dim]` (f32, converted to the arena's
    /// dtype with round-to-nearest-even) into `slots` of layer `layer`.
    pub fn kv_append(
        &self,
        arena: &mut DeviceKvArena,
        layer: usize,
        slots: &SlotMap,
        k: &impl DevicePtr<f32>,
        v: &impl DevicePtr<f32>,
    ) -> Result<(), CudaError> {
        let g = append_target(arena, layer, slots)?;
        let total = slots.n_tokens * g.kv_dim();
        shape("appended K elements", total, k.len())?;
        shape("appended V elements", total, v.len())?;
        let kernel = kernels::kv_append(g.dtype).ok_or_else(|| CudaError::MissingKernel {
            name: format!("kv_append for {:?}", g.dtype),
        })?;
        let page_stride = arena.page_elems() as u64;
        let page_size_log2 = arena.page_size().trailing_zeros();
        let mut args = Args::new(&self.inner.stream);
        let [dst_page, dst_slot] = args.read_arrays(&slots.arrays);
        let p = KvAppendParams {
            k: args.read(k),
            v: args.read(v),
            dst_page,
            dst_slot,
            kv: args.write(&mut arena.data),
            page_stride,
            n_tokens: to_u32("append rows", slots.n_tokens)?,
            kv_dim: to_u32("kv_dim", g.kv_dim())?,
            layer: to_u32("layer", layer)?,
            page_size_log2,
        };
        // Launch contract: k and v hold n_tokens*kv_dim f32 (checked); the
        // slot map was built for this arena (id checked) with every page
        // inside it and every slot below page_size; layer < n_layers; the
        // kernel matches the dtype.
        self.launch(kernel, &p, grid_stride(total), args)
    }

    /// Fills whole pages with zeros, or with the dtype's NaN when `poison`
    /// (bit-identical to the host pool's scrub).
    pub fn scrub_pages(
        &self,
        arena: &mut DeviceKvArena,
        pages: &[u32],
        poison: bool,
    ) -> Result<(), CudaError> {
        if pages.is_empty() {
            return Ok(());
        }
        for &p in pages {
            if p as usize >= arena.pages() {
                return Err(CudaError::PageOutOfRange {
                    page: p,
                    pages: arena.pages(),
                });
            }
        }
        let fill = match (poison, arena.geometry().dtype) {
            (false, _) => 0,
            (true, KvDtype::F32) => f32::NAN.to_bits(),
            (true, KvDtype::F16) => u32::from(half::f16::NAN.to_bits()) * 0x1_0001,
            (true, KvDtype::BF16) => u32::from(half::bf16::NAN.to_bits()) * 0x1_0001,
            (true, KvDtype::F8E4M3) => u32::from(crate::kv::F8E4M3::NAN.0) * 0x0101_0101,
        };
        let n_pages = to_u32("pages to scrub", pages.len())?;
        let list = self.upload(pages)?;
        let page_vec16 = (arena.page_bytes() / 16) as u64;
        let mut args = Args::new(&self.inner.stream);
        let p = ScrubParams {
            kv: args.write(&mut arena.data),
            pages: args.read(&list),
            page_vec16,
            n_pages,
            fill,
        };
        // Launch contract: every listed page is inside the arena (checked);
        // page bytes are a multiple of 16 (checked when the arena was
        // built), so the kernel's 16-byte stores stay inside each page; one
        // block per listed page.
        self.launch(kernels::scrub_pages(), &p, (n_pages, 1, 1), args)?;
        self.retire(list);
        Ok(())
    }

    /// `out = x / sqrt(mean(x^2) + eps) * w` for each row of `dim` elements.
    pub fn rms_norm(
        &self,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<f32>,
        out: &mut impl DevicePtrMut<f32>,
        eps: f32,
    ) -> Result<(), CudaError> {
        let dim = w.len();
        if dim == 0 || !x.len().is_multiple_of(dim) {
            return Err(CudaError::Shape {
                what: "RMSNorm input (a multiple of the weight's length)",
                expected: dim,
                got: x.len(),
            });
        }
        shape("RMSNorm output elements", x.len(), out.len())?;
        let Some(grid) = grid("RMSNorm rows", x.len() / dim, 1, 1)? else {
            return Ok(());
        };
        let mut args = Args::new(&self.inner.stream);
        let p = RmsNormParams {
            x: args.read(x),
            w: args.read(w),
            out: args.write(out),
            n_rows: grid.0,
            dim: to_u32("RMSNorm dim", dim)?,
            eps,
            pad0: 0,
        };
        // Launch contract: x and out hold n_rows*dim f32 and w holds dim
        // (checked); one block of 256 threads per row, as the kernel's block
        // reduction expects.
        self.launch(kernels::rms_norm(), &p, grid, args)
    }

    /// Rotary embedding in place on `x` `[positions.len(), rope.n_heads,
    /// rope.head_dim]`.
    pub fn rope(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        positions: &impl DevicePtr<u32>,
        rope: Rope,
    ) -> Result<(), CudaError> {
        self.rope_launch(
            x,
            None::<(&mut CudaSlice<f32>, usize)>,
            positions,
            rope,
            None::<Append<'_, CudaSlice<f32>>>,
        )
    }

    /// [`CudaDevice::rope`] of `q` (`rope.n_heads` heads) and of `k`
    /// (`k_heads` heads) in one launch: each head gets the bits a launch of
    /// its own gives.
    pub fn rope_pair(
        &self,
        q: &mut impl DevicePtrMut<f32>,
        k: &mut impl DevicePtrMut<f32>,
        k_heads: usize,
        positions: &impl DevicePtr<u32>,
        rope: Rope,
    ) -> Result<(), CudaError> {
        self.rope_launch(
            q,
            Some((k, k_heads)),
            positions,
            rope,
            None::<Append<'_, CudaSlice<f32>>>,
        )
    }

    /// [`CudaDevice::rope_pair`], then [`CudaDevice::kv_append`] of the
    /// rotated `k` and of `v` to `slots` of `layer`, in one launch: `q`, `k`
    /// and the pages get the bits of the two launches. `k` must be the
    /// arena's K rows (`k_heads * head_dim == kv_dim`).
    #[allow(clippy::too_many_arguments)]
    pub fn rope_pair_append(
        &self,
        q: &mut impl DevicePtrMut<f32>,
        k: &mut impl DevicePtrMut<f32>,
        k_heads: usize,
        positions: &impl DevicePtr<u32>,
        rope: Rope,
        arena: &mut DeviceKvArena,
        layer: usize,
        slots: &SlotMap,
        v: &impl DevicePtr<f32>,
    ) -> Result<(), CudaError> {
        let append = Append {
            arena,
            layer,
            slots,
            v,
        };
        self.rope_launch(q, Some((k, k_heads)), positions, rope, Some(append))
    }

    fn rope_launch<X2: DevicePtrMut<f32>, V: DevicePtr<f32>>(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        x2: Option<(&mut X2, usize)>,
        positions: &impl DevicePtr<u32>,
        rope: Rope,
        append: Option<Append<'_, V>>,
    ) -> Result<(), CudaError> {
        let Rope {
            n_heads,
            head_dim,
            theta,
            style,
            scaling,
        } = rope;
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(CudaError::Unsupported {
                what: "RoPE head_dim",
                detail: format!("{head_dim} (even)"),
            });
        }
        let elements = |heads: usize| {
            positions
                .len()
                .checked_mul(heads)
                .and_then(|n| n.checked_mul(head_dim))
                .unwrap_or(usize::MAX)
        };
        shape("RoPE elements", elements(n_heads), x.len())?;
        let k_heads = x2.as_ref().map_or(0, |(_, h)| *h);
        if let Some((x2, heads)) = &x2 {
            shape(
                "RoPE elements of the second buffer",
                elements(*heads),
                x2.len(),
            )?;
        }
        let total = elements(n_heads).saturating_add(elements(k_heads));
        let mut args = Args::new(&self.inner.stream);
        let mut p = RopeParams {
            x: args.write(x),
            positions: args.read(positions),
            theta: f64::from(theta),
            n_tokens: to_u32("RoPE tokens", positions.len())?,
            n_heads: to_u32("RoPE heads", n_heads)?,
            head_dim: to_u32("RoPE head_dim", head_dim)?,
            style: match style {
                RopeStyle::Interleaved => 0,
                RopeStyle::Half => 1,
            },
            n_heads2: to_u32("RoPE heads of the second buffer", k_heads)?,
            x2: match x2 {
                Some((x2, _)) => args.write(x2),
                None => 0,
            },
            ..RopeParams::default()
        };
        match scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => {
                p.scaling = 1;
                p.factor = f64::from(factor);
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            } => {
                p.scaling = 2;
                p.factor = f64::from(factor);
                p.low_freq_factor = f64::from(low_freq_factor);
                p.high_freq_factor = f64::from(high_freq_factor);
                p.original_max_position = f64::from(original_max_position);
            }
        }
        // RoPE alone runs the f32 instantiation (it stores nothing in an
        // arena); the append, the one of the arena's dtype, with one more
        // item per V element.
        let (dtype, extra) = match append {
            None => (KvDtype::F32, 0),
            Some(Append {
                arena,
                layer,
                slots,
                v,
            }) => {
                let g = append_target(arena, layer, slots)?;
                shape(
                    "appended tokens (one per rotated row)",
                    positions.len(),
                    slots.n_tokens,
                )?;
                shape(
                    "appended K row (k_heads * head_dim)",
                    g.kv_dim(),
                    k_heads * head_dim,
                )?;
                shape("appended V elements", elements(k_heads), v.len())?;
                p.page_stride = arena.page_elems() as u64;
                p.kv_dim = to_u32("kv_dim", g.kv_dim())?;
                p.layer = to_u32("layer", layer)?;
                p.page_size_log2 = arena.page_size().trailing_zeros();
                p.v = args.read(v);
                [p.dst_page, p.dst_slot] = args.read_arrays(&slots.arrays);
                p.kv = args.write(&mut arena.data);
                (g.dtype, elements(k_heads))
            }
        };
        let kernel = kernels::rope(dtype).ok_or_else(|| CudaError::MissingKernel {
            name: format!("rope for {dtype:?}"),
        })?;
        // Launch contract: x holds n_tokens*n_heads*head_dim f32, x2 (when
        // n_heads2 > 0) n_tokens*n_heads2*head_dim, and positions n_tokens
        // u32 (checked); head_dim is even; the kernel grid-strides over the
        // pairs of both. With kv set: the slot map was built for this arena
        // (id checked) with every page inside it and every slot below
        // page_size, one slot per token; layer < n_layers; x2's rows and v's
        // are kv_dim wide (checked); the kernel matches the dtype and
        // grid-strides over the v elements after the pairs.
        self.launch(
            kernel,
            &p,
            grid_stride((total / 2).saturating_add(extra)),
            args,
        )
    }

    /// `gate = silu(gate) * up`, elementwise, in place.
    pub fn swiglu(
        &self,
        gate: &mut impl DevicePtrMut<f32>,
        up: &impl DevicePtr<f32>,
    ) -> Result<(), CudaError> {
        shape("SwiGLU up elements", gate.len(), up.len())?;
        let n = gate.len();
        let mut args = Args::new(&self.inner.stream);
        let up = args.read(up);
        let gate = args.write(gate);
        let p = SwigluParams {
            gate,
            up,
            out: gate,
            n: n as u64,
        };
        // Launch contract: gate and up hold n f32 each (checked); out is
        // gate, which the kernel reads and writes at the same index only.
        self.launch(kernels::swiglu(), &p, grid_stride(n), args)
    }

    /// `out = x · wᵀ` for `x` `[m, k]` and `w` `[n, k]`; `out` is `[m, n]`.
    pub fn linear(
        &self,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<f32>,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), CudaError> {
        self.linear_into(x, w, n, out, false)
    }

    /// `out += x · wᵀ` (a projection added to the residual stream): the
    /// bits of [`CudaDevice::linear`] into a buffer then
    /// [`CudaDevice::add_assign`], in one launch.
    pub fn linear_add(
        &self,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<f32>,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), CudaError> {
        self.linear_into(x, w, n, out, true)
    }

    fn linear_into(
        &self,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<f32>,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        let Some((m, k)) = matmul_shape(x.len(), w.len(), n, out.len())? else {
            return Ok(());
        };
        let mut args = Args::new(&self.inner.stream);
        let p = LinearParams {
            x: args.read(x),
            w: args.read(w),
            out: args.write(out),
            m: to_u32("matmul rows", m)?,
            n: to_u32("matmul columns", n)?,
            k: to_u32("matmul depth", k)?,
            accumulate: u32::from(accumulate),
        };
        let Some((shape, grid)) = LinShape::for_launch(m, n)? else {
            return Ok(());
        };
        let kernel = match shape {
            LinShape::One => kernels::linear(),
            LinShape::Few => kernels::linear_few(),
            LinShape::Many => kernels::linear_many(),
        };
        // Launch contract: x holds m*k, w n*k and out m*n f32 (checked); the
        // 1-D grid covers every (row tile of the shape's rows, block of
        // LIN_COLS columns) pair, as the kernel decodes its block index, and
        // the kernel bounds every access by m, n, k.
        self.launch(kernel, &p, grid, args)
    }

    /// `out = x · wᵀ` with weights `w` `[n, k]` kept in ggml blocks of `q`
    /// (raw bytes, `k` a multiple of a block's values): each weight widened
    /// as the CPU backend widens it, so the bits of [`CudaDevice::linear`]
    /// on the widened weights, reading a quarter of the bytes or less
    /// (Q8_0: about half).
    pub fn linear_quant(
        &self,
        q: QuantWeights,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<u8>,
        n: usize,
        k: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), CudaError> {
        self.linear_quant_into(q, x, w, n, k, out, false)
    }

    /// `out += x · wᵀ` with ggml-block weights: the bits of
    /// [`CudaDevice::linear_quant`] into a buffer then
    /// [`CudaDevice::add_assign`], in one launch.
    pub fn linear_quant_add(
        &self,
        q: QuantWeights,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<u8>,
        n: usize,
        k: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), CudaError> {
        self.linear_quant_into(q, x, w, n, k, out, true)
    }

    #[allow(clippy::too_many_arguments)]
    fn linear_quant_into(
        &self,
        q: QuantWeights,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<u8>,
        n: usize,
        k: usize,
        out: &mut impl DevicePtrMut<f32>,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        q.check("ggml-block weight bytes", w.len(), n, k)?;
        let Some((m, k)) = matmul_shape(x.len(), n * k, n, out.len())? else {
            return Ok(());
        };
        let mut args = Args::new(&self.inner.stream);
        let p = LinearQParams {
            x: args.read(x),
            w: args.read(w),
            out: args.write(out),
            m: to_u32("matmul rows", m)?,
            n: to_u32("matmul columns", n)?,
            k: to_u32("matmul depth", k)?,
            accumulate: u32::from(accumulate),
            format: q.code(),
            pad0: 0,
        };
        let Some((shape, grid)) = LinShape::for_launch(m, n)? else {
            return Ok(());
        };
        let kernel = match shape {
            LinShape::One => kernels::linear_q(),
            LinShape::Few => kernels::linear_q_few(),
            LinShape::Many => kernels::linear_q_many(),
        };
        // Launch contract: x holds m*k f32, out m*n f32, w n rows of whole
        // blocks of the format (checked; k a multiple of a block's values,
        // so no block is cut); the 1-D grid covers every (row tile, column
        // block) pair as the kernel decodes it, and the kernel bounds every
        // access by m, n, k.
        self.launch(kernel, &p, grid, args)
    }

    /// `out = x · wᵀ` with bf16 weights `w` `[n, k]` (raw bits) on tensor
    /// cores: [`CudaDevice::linear_half`] with [`HalfWeights::Bf16`].
    pub fn linear_bf16(
        &self,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<u16>,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), CudaError> {
        self.linear_half_into(HalfWeights::Bf16, x, w, n, out, false)
    }

    /// `out += x · wᵀ` with bf16 weights: the bits of
    /// [`CudaDevice::linear_bf16`] into a buffer then
    /// [`CudaDevice::add_assign`], in one launch.
    pub fn linear_bf16_add(
        &self,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<u16>,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), CudaError> {
        self.linear_half_into(HalfWeights::Bf16, x, w, n, out, true)
    }

    /// `out = x · wᵀ` with 16-bit weights `w` `[n, k]` (raw bits of `h`)
    /// on tensor cores (cuda/linear_mma.cuh): about 16 bits of each
    /// activation meet the weights (all of an f16 weight's bits, split in
    /// registers), summed in f32 in k order (batch-invariant). From 32
    /// rows of x on, the wide tile (32 x 32) runs, and from 128 the
    /// prefill tile (128 x 64, operands staged in shared memory by a
    /// cp.async pipeline): the same sums in the same order, so the same
    /// bits, with less traffic per product.
    pub fn linear_half(
        &self,
        h: HalfWeights,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<u16>,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), CudaError> {
        self.linear_half_into(h, x, w, n, out, false)
    }

    /// `out += x · wᵀ` with 16-bit weights: the bits of
    /// [`CudaDevice::linear_half`] into a buffer then
    /// [`CudaDevice::add_assign`], in one launch.
    pub fn linear_half_add(
        &self,
        h: HalfWeights,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<u16>,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), CudaError> {
        self.linear_half_into(h, x, w, n, out, true)
    }

    fn linear_half_into(
        &self,
        h: HalfWeights,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<u16>,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        self.linear_half_tile(
            h,
            x,
            w,
            n,
            out,
            accumulate,
            None::<(&CudaSlice<f32>, f32)>,
            None::<&CudaSlice<u16>>,
        )
    }

    /// The one launch of a single 16-bit product, on the tile its rows pick,
    /// with the stages it carries: RMSNorm of x (`norm`: weight and
    /// epsilon; the decode tile) and SwiGLU with `w_up` (decode and wide
    /// tiles).
    #[allow(clippy::too_many_arguments)]
    fn linear_half_tile<N: DevicePtr<f32>, U: DevicePtr<u16>>(
        &self,
        h: HalfWeights,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<u16>,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
        accumulate: bool,
        norm: Option<(&N, f32)>,
        w_up: Option<&U>,
    ) -> Result<(), CudaError> {
        let Some((m, k)) = matmul_shape(x.len(), w.len(), n, out.len())? else {
            return Ok(());
        };
        let tile = Bf16Tile::for_rows(m);
        check_norm(norm, tile, k)?;
        if let Some(up) = w_up {
            Bf16Tile::carries("SwiGLU", tile, Bf16Tile::Wide)?;
            shape("SwiGLU up weight (the gate's size)", w.len(), up.len())?;
        }
        // A SwiGLU pair's column block holds half the tile's columns of
        // each product.
        let (bm, bn) = (
            tile.rows(),
            tile.cols() / if w_up.is_some() { 2 } else { 1 },
        );
        let kernel = tile.kernel(
            h,
            match tile {
                Bf16Tile::Decode => kernels::linear_mma(h.dtype()),
                Bf16Tile::Wide => kernels::linear_mma_wide(h.dtype()),
                Bf16Tile::Prefill => kernels::linear_mma_gemm(h.dtype()),
            },
        )?;
        let mut args = Args::new(&self.inner.stream);
        let mut p = LinearMmaParams {
            x: args.read(x),
            w: args.read(w),
            out: args.write(out),
            m: to_u32("matmul rows", m)?,
            n: to_u32("matmul columns", n)?,
            k: to_u32("matmul depth", k)?,
            accumulate: u32::from(accumulate),
            ..Default::default()
        };
        if let Some(up) = w_up {
            p.w_up = args.read(up);
        }
        if let Some((nw, eps)) = norm {
            (p.norm_w, p.norm_eps) = (args.read(nw), eps);
        }
        let Some(grid) = grid(
            "tensor-core matmul blocks (columns, rows)",
            n.div_ceil(bn),
            m.div_ceil(bm),
            1,
        )?
        else {
            return Ok(());
        };
        // Launch contract: x holds m*k f32, w (and w_up) n*k bf16, out m*n
        // f32, norm_w k f32 (checked); stages are carried only by the
        // tiles that have them (checked: the prefill tile none); the grid
        // covers n columns in blocks of bn and m rows in tiles of bm, the
        // tile of the kernel chosen, and the kernel bounds every access by
        // m, n, k.
        self.launch(kernel, &p, grid, args)
    }

    /// `outs[i] = x · ws[i]ᵀ`, `ws[i]` bf16 `[ns[i], k]`, for up to three
    /// (`LMMA_GROUPS`) products of one input (q, k and v; gate and up) in
    /// one launch: each block computes a tile of one product with the code
    /// of [`CudaDevice::linear_bf16`] on the tile its row count picks, so
    /// each product has the bits of its own launch.
    pub fn linear_bf16_many<W: DevicePtr<u16>, O: DevicePtrMut<f32>>(
        &self,
        x: &impl DevicePtr<f32>,
        ws: &[&W],
        ns: &[usize],
        outs: &mut [O],
    ) -> Result<(), CudaError> {
        self.linear_half_many(HalfWeights::Bf16, x, ws, ns, outs)
    }

    /// [`CudaDevice::linear_bf16_many`] for weights of either 16-bit type
    /// (all of `h`).
    pub fn linear_half_many<W: DevicePtr<u16>, O: DevicePtrMut<f32>>(
        &self,
        h: HalfWeights,
        x: &impl DevicePtr<f32>,
        ws: &[&W],
        ns: &[usize],
        outs: &mut [O],
    ) -> Result<(), CudaError> {
        self.linear_half_group(h, x, None::<(&CudaSlice<f32>, f32)>, ws, ns, outs)
    }

    /// [`CudaDevice::rms_norm`] of `x` with `norm_w` and `eps`, then
    /// [`CudaDevice::linear_bf16_many`] of its output, in one launch: each
    /// block sums its rows' squares in rms_norm's order and normalises x as
    /// it loads it, so the outputs have the bits of the two launches.
    /// Decode-sized batches only (fewer than `LMMA_WIDE_BM` rows: the
    /// decode tile), where a block re-reading its rows costs less than a
    /// launch; more rows are a typed `Unsupported`.
    pub fn linear_bf16_many_normed<W: DevicePtr<u16>, O: DevicePtrMut<f32>>(
        &self,
        x: &impl DevicePtr<f32>,
        norm_w: &impl DevicePtr<f32>,
        eps: f32,
        ws: &[&W],
        ns: &[usize],
        outs: &mut [O],
    ) -> Result<(), CudaError> {
        self.linear_half_many_normed(HalfWeights::Bf16, x, norm_w, eps, ws, ns, outs)
    }

    /// [`CudaDevice::linear_bf16_many_normed`] for weights of either 16-bit
    /// type (all of `h`).
    #[allow(clippy::too_many_arguments)]
    pub fn linear_half_many_normed<W: DevicePtr<u16>, O: DevicePtrMut<f32>>(
        &self,
        h: HalfWeights,
        x: &impl DevicePtr<f32>,
        norm_w: &impl DevicePtr<f32>,
        eps: f32,
        ws: &[&W],
        ns: &[usize],
        outs: &mut [O],
    ) -> Result<(), CudaError> {
        self.linear_half_group(h, x, Some((norm_w, eps)), ws, ns, outs)
    }

    fn linear_half_group<N: DevicePtr<f32>, W: DevicePtr<u16>, O: DevicePtrMut<f32>>(
        &self,
        h: HalfWeights,
        x: &impl DevicePtr<f32>,
        norm: Option<(&N, f32)>,
        ws: &[&W],
        ns: &[usize],
        outs: &mut [O],
    ) -> Result<(), CudaError> {
        let count = ws.len();
        if count == 0 || count > LMMA_GROUPS || ns.len() != count || outs.len() != count {
            return Err(CudaError::Unsupported {
                what: "products in one grouped matmul",
                detail: format!(
                    "{count} weights, {} widths, {} outputs (1 to {LMMA_GROUPS} of each, as many)",
                    ns.len(),
                    outs.len()
                ),
            });
        }
        let mut shape = None;
        for i in 0..count {
            let Some(mk) = matmul_shape(x.len(), ws[i].len(), ns[i], outs[i].len())? else {
                return Ok(()); // no rows
            };
            if shape.is_some_and(|s| s != mk) {
                return Err(CudaError::Shape {
                    what: "grouped matmul depth (every weight's columns)",
                    expected: shape.map_or(0, |(_, k)| k),
                    got: mk.1,
                });
            }
            shape = Some(mk);
        }
        let Some((m, k)) = shape else {
            return Ok(());
        };
        let tile = Bf16Tile::for_rows(m);
        check_norm(norm, tile, k)?;
        let (bm, bn) = (tile.rows(), tile.cols());
        let kernel = tile.kernel(
            h,
            match tile {
                Bf16Tile::Decode => kernels::linear_mma_group(h.dtype()),
                Bf16Tile::Wide => kernels::linear_mma_wide_group(h.dtype()),
                Bf16Tile::Prefill => kernels::linear_mma_gemm_group(h.dtype()),
            },
        )?;
        // Column blocks of product i (0 past the last).
        let blocks = |i: usize| ns.get(i).map_or(0, |n| n.div_ceil(bn));
        let mut args = Args::new(&self.inner.stream);
        let mut p = LinearMmaGroupParams {
            x: args.read(x),
            m: to_u32("matmul rows", m)?,
            k: to_u32("matmul depth", k)?,
            n_groups: count as u32,
            ..Default::default()
        };
        if let Some((w, eps)) = norm {
            (p.norm_w, p.norm_eps) = (args.read(w), eps);
        }
        for (i, (w, out)) in ws.iter().zip(outs.iter_mut()).enumerate() {
            let (w, out, n) = (
                args.read(*w),
                args.write(out),
                to_u32("matmul columns", ns[i])?,
            );
            match i {
                0 => (p.w0, p.out0, p.n0) = (w, out, n),
                1 => (p.w1, p.out1, p.n1) = (w, out, n),
                _ => (p.w2, p.out2, p.n2) = (w, out, n),
            }
        }
        p.blocks0 = to_u32("matmul column blocks", blocks(0))?;
        p.blocks1 = to_u32("matmul column blocks", blocks(1))?;
        let Some(grid) = grid(
            "grouped tensor-core matmul blocks (columns, rows)",
            (0..count).map(blocks).sum(),
            m.div_ceil(bm),
            1,
        )?
        else {
            return Ok(());
        };
        // Launch contract: x holds m*k f32, each w n_i*k bf16 and each out
        // m*n_i f32 (checked, every product of the same depth k), norm_w
        // (when set, on the decode tile only: checked) k f32; grid.x is the
        // products' column blocks of the chosen tile back to back (blocks0
        // and blocks1 tell the kernel where products 1 and 2 start), grid.y
        // the row tiles, and the kernel bounds every access by m, its
        // product's n, and k.
        self.launch(kernel, &p, grid, args)
    }

    /// `out = SwiGLU(x' · w_gateᵀ, x' · w_upᵀ)`, both weights bf16 `[n, k]`,
    /// with `x' = RMSNorm(x)` (`norm`: its weight and epsilon) or `x`, in
    /// one launch: a block computes the same columns of both products (the
    /// code of [`CudaDevice::linear_bf16`], so the same sums) and stores
    /// SwiGLU of each pair as [`CudaDevice::swiglu`] computes it: the bits
    /// of rms_norm, the two matmuls and swiglu. Fewer than `LGEMM_BM` rows
    /// (the decode and wide tiles), and with `norm` fewer than
    /// `LMMA_WIDE_BM` (the decode tile); more are a typed `Unsupported`.
    pub fn linear_bf16_swiglu(
        &self,
        x: &impl DevicePtr<f32>,
        norm: Option<(&impl DevicePtr<f32>, f32)>,
        w_gate: &impl DevicePtr<u16>,
        w_up: &impl DevicePtr<u16>,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), CudaError> {
        self.linear_half_swiglu(HalfWeights::Bf16, x, norm, w_gate, w_up, n, out)
    }

    /// [`CudaDevice::linear_bf16_swiglu`] for weights of either 16-bit type
    /// (both of `h`).
    #[allow(clippy::too_many_arguments)]
    pub fn linear_half_swiglu(
        &self,
        h: HalfWeights,
        x: &impl DevicePtr<f32>,
        norm: Option<(&impl DevicePtr<f32>, f32)>,
        w_gate: &impl DevicePtr<u16>,
        w_up: &impl DevicePtr<u16>,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), CudaError> {
        self.linear_half_tile(h, x, w_gate, n, out, false, norm, Some(w_up))
    }

    /// `x[i] += y[i % y.len()]`: a residual add when the lengths match, a
    /// per-row bias when `y` is one row.
    pub fn add_assign(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        y: &impl DevicePtr<f32>,
    ) -> Result<(), CudaError> {
        if y.is_empty() || !x.len().is_multiple_of(y.len()) {
            return Err(CudaError::Shape {
                what: "addend (a divisor of the destination's length)",
                expected: x.len(),
                got: y.len(),
            });
        }
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        let mut args = Args::new(&self.inner.stream);
        let p = AddParams {
            y: args.read(y),
            x: args.write(x),
            n: n as u64,
            period: y.len() as u64,
        };
        // Launch contract: x holds n f32 and y holds period f32, period > 0
        // (checked).
        self.launch(kernels::add_periodic(), &p, grid_stride(n), args)
    }

    /// Gathers rows of `table` `[vocab, dim]` for `tokens` into `out`
    /// `[tokens.len(), dim]`. Tokens outside the vocabulary are refused.
    pub fn embedding(
        &self,
        table: &impl DevicePtr<f32>,
        dim: usize,
        tokens: &[u32],
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), CudaError> {
        self.embedding_of(KvDtype::F32, table, dim, tokens, out)
    }

    /// [`CudaDevice::embedding`] from a bf16 table (raw bits).
    pub fn embedding_bf16(
        &self,
        table: &impl DevicePtr<u16>,
        dim: usize,
        tokens: &[u32],
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), CudaError> {
        self.embedding_half(HalfWeights::Bf16, table, dim, tokens, out)
    }

    /// [`CudaDevice::embedding`] from a 16-bit table (raw bits of `h`).
    pub fn embedding_half(
        &self,
        h: HalfWeights,
        table: &impl DevicePtr<u16>,
        dim: usize,
        tokens: &[u32],
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), CudaError> {
        self.embedding_of(h.dtype(), table, dim, tokens, out)
    }

    /// [`CudaDevice::embedding`] from a table `[vocab, dim]` kept in ggml
    /// blocks of `q` (raw bytes, `dim` a multiple of a block's values): each value widened
    /// as [`CudaDevice::linear_quant`] widens it.
    pub fn embedding_quant(
        &self,
        q: QuantWeights,
        table: &impl DevicePtr<u8>,
        dim: usize,
        tokens: &[u32],
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), CudaError> {
        let row_bytes = (dim / q.block_values()) * q.block_bytes();
        let vocab = table.len().checked_div(row_bytes).unwrap_or(0);
        q.check("embedding table bytes", table.len(), vocab, dim)?;
        if let Some(&token) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(CudaError::TokenOutOfRange { token, vocab });
        }
        if tokens.is_empty() {
            return Ok(());
        }
        shape("embedding output elements", tokens.len() * dim, out.len())?;
        let ids = self.upload(tokens)?;
        let total = out.len();
        let mut args = Args::new(&self.inner.stream);
        let p = EmbeddingQParams {
            table: args.read(table),
            tokens: args.read(&ids),
            out: args.write(out),
            n_tokens: to_u32("tokens", tokens.len())?,
            dim: to_u32("dim", dim)?,
            vocab: to_u32("vocab", vocab)?,
            format: q.code(),
        };
        // Launch contract: table holds vocab rows of dim / 32 blocks of the
        // format (checked, and vocab is what they hold), every token is
        // below vocab (checked, and the kernel also bounds it), out holds
        // n_tokens*dim f32; a grid-stride loop covers them.
        self.launch(kernels::embedding_q(), &p, grid_stride(total), args)
    }

    fn embedding_of<T>(
        &self,
        dtype: KvDtype,
        table: &impl DevicePtr<T>,
        dim: usize,
        tokens: &[u32],
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), CudaError> {
        if dim == 0 || !table.len().is_multiple_of(dim) {
            return Err(CudaError::Shape {
                what: "embedding table (a multiple of dim)",
                expected: dim,
                got: table.len(),
            });
        }
        let vocab = table.len() / dim;
        if let Some(&token) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(CudaError::TokenOutOfRange { token, vocab });
        }
        if tokens.is_empty() {
            return Ok(());
        }
        shape("embedding output elements", tokens.len() * dim, out.len())?;
        let kernel = kernels::embedding(dtype).ok_or_else(|| CudaError::MissingKernel {
            name: format!("embedding for a {dtype:?} table"),
        })?;
        let ids = self.upload(tokens)?;
        let total = out.len();
        let mut args = Args::new(&self.inner.stream);
        let p = EmbeddingParams {
            table: args.read(table),
            tokens: args.read(&ids),
            out: args.write(out),
            n_tokens: to_u32("tokens", tokens.len())?,
            dim: to_u32("dim", dim)?,
            vocab: to_u32("vocab", vocab)?,
            pad0: 0,
        };
        // Launch contract: table holds vocab*dim elements of the kernel's
        // type (the table's, `dtype`), every token is below vocab (checked,
        // and the kernel also bounds it), out holds n_tokens*dim f32
        // (checked).
        self.launch(kernel, &p, grid_stride(total), args)?;
        self.retire(ids);
        Ok(())
    }

    /// Greedy argmax of each row of `logits` `[n_rows, vocab]` (lowest index
    /// on ties). A row holding any NaN fails with [`CudaError::NanLogits`]:
    /// poisoned or corrupt data never becomes a token.
    pub fn argmax(
        &self,
        logits: &impl DevicePtr<f32>,
        vocab: usize,
    ) -> Result<Vec<u32>, CudaError> {
        if vocab == 0 || !logits.len().is_multiple_of(vocab) || logits.is_empty() {
            return Err(CudaError::Shape {
                what: "logits (a non-empty multiple of vocab)",
                expected: vocab,
                got: logits.len(),
            });
        }
        let n_rows = logits.len() / vocab;
        let mut idx = self.zeros::<u32>(n_rows)?;
        let mut nans = self.zeros::<u32>(n_rows)?;
        let mut args = Args::new(&self.inner.stream);
        let p = ArgmaxParams {
            logits: args.read(logits),
            out_index: args.write(&mut idx),
            out_nans: args.write(&mut nans),
            n_rows: to_u32("logit rows", n_rows)?,
            vocab: to_u32("vocab", vocab)?,
        };
        // Launch contract: logits hold n_rows*vocab f32, idx and nans n_rows
        // u32 each; one block of exactly 256 threads per row (the kernel's
        // shared arrays).
        self.launch(kernels::argmax(), &p, (p.n_rows, 1, 1), args)?;
        let nans = self.download(&nans)?;
        if let Some((row, &n)) = nans.iter().enumerate().find(|(_, n)| **n > 0) {
            return Err(CudaError::NanLogits { row, nans: n });
        }
        self.download(&idx)
    }

    /// One token per row of `logits` `[draws.len(), vocab]`, each by its
    /// draw and [`crate::sampling::sample_row`]'s rule, bit for bit, and,
    /// when any draw asks ([`Draw::logprobs`]), each asking row's
    /// log-probabilities ([`crate::sampling::token_logprobs`]: the same
    /// ids, values within about an f32 ulp; `None` for the other rows, and
    /// an empty list when none asks). Only the token ids (or, for a row
    /// holding a non-finite logit, that logit) and the log-probabilities
    /// asked for come back to the host, in one download: one sync.
    #[allow(clippy::type_complexity)]
    pub fn sample_rows(
        &self,
        logits: &impl DevicePtr<f32>,
        vocab: usize,
        draws: &[Draw],
    ) -> Result<(Vec<Result<u32, SamplingError>>, Vec<Option<TokenLogprobs>>), CudaError> {
        if vocab == 0 || logits.len() != draws.len().saturating_mul(vocab) || draws.is_empty() {
            return Err(CudaError::Shape {
                what: "logits ([draws, vocab], at least one row)",
                expected: draws.len().saturating_mul(vocab.max(1)),
                got: logits.len(),
            });
        }
        if vocab > MAX_VOCAB {
            let e = SamplingError::VocabularyTooLarge {
                vocab,
                max: MAX_VOCAB,
            };
            return Ok((vec![Err(e); draws.len()], Vec::new()));
        }
        let asked = draws.iter().any(|d| d.logprobs().is_some());
        let host: Vec<SampleDraw> = draws
            .iter()
            .map(|d| SampleDraw {
                temperature: d.temperature(),
                top_k: d
                    .top_k()
                    .map_or(0, |k| u32::try_from(k).unwrap_or(u32::MAX)),
                top_p: d.top_p(),
                logprobs: d
                    .logprobs()
                    .map_or(0, |n| 1 + u32::from(n.min(MAX_TOP_LOGPROBS))),
                random: d.random(),
            })
            .collect();
        let n = draws.len();
        let dev_draws = self.upload(&host)?;
        let mut out = self.zeros::<u32>(2 * n + if asked { n * LOGPROB_STRIDE } else { 0 })?;
        let mut args = Args::new(&self.inner.stream);
        let p = SampleParams {
            logits: args.read(logits),
            draws: args.read(&dev_draws),
            out: args.write(&mut out),
            n_rows: to_u32("sampled rows", n)?,
            vocab: to_u32("vocab", vocab)?,
        };
        // Launch contract: logits hold n_rows*vocab f32 (checked), vocab is
        // within MAX_VOCAB (checked: the weights' sums fit u64), draws hold
        // n_rows entries and out at least 2 * n_rows; one block of exactly
        // SAMPLE_THREADS threads per row (its shared arrays).
        self.launch(kernels::sample_rows(), &p, (p.n_rows, 1, 1), args)?;
        if asked {
            let mut args = Args::new(&self.inner.stream);
            let lp = LogprobParams {
                logits: args.read(logits),
                draws: args.read(&dev_draws),
                out: args.write(&mut out),
                n_rows: p.n_rows,
                vocab: p.vocab,
            };
            // Launch contract: as sample_rows, queued after it on the same
            // stream (it reads the tokens and statuses sample_rows wrote),
            // and out holds 2 * n_rows + n_rows * LOGPROB_STRIDE words.
            self.launch(kernels::row_logprobs(), &lp, (lp.n_rows, 1, 1), args)?;
        }
        // The step's one wait for the device: tokens, statuses and the
        // log-probabilities asked for, together.
        let out = self.download(&out)?;
        let (token, rest) = out.split_at(n);
        let (status, lps) = rest.split_at(n);
        let tokens: Vec<Result<u32, SamplingError>> = token
            .iter()
            .zip(status)
            .map(|(&t, &s)| match s {
                0 => Ok(t),
                s => Err(SamplingError::NonFinite {
                    index: s as usize - 1,
                    value: f32::from_bits(t),
                }),
            })
            .collect();
        let logprobs = if asked {
            draws
                .iter()
                .zip(&tokens)
                .zip(lps.chunks_exact(LOGPROB_STRIDE))
                .map(|((d, t), w)| {
                    let (top, &Ok(token)) = (d.logprobs()?, t) else {
                        return None;
                    };
                    let top = usize::from(top.min(MAX_TOP_LOGPROBS)).min(vocab);
                    Some(TokenLogprobs {
                        token,
                        logprob: f32::from_bits(w[0]),
                        top: w[1..1 + 2 * top]
                            .chunks_exact(2)
                            .map(|p| (p[0], f32::from_bits(p[1])))
                            .collect(),
                    })
                })
                .collect()
        } else {
            Vec::new()
        };
        Ok((tokens, logprobs))
    }

    /// xxh3-64 (seed 0) of each `(offset, len)` byte range of `data`, one
    /// warp per range; the same value as `twox_hash::XxHash3_64::oneshot`.
    pub fn xxh3_64_ranges(
        &self,
        data: &impl DevicePtr<u8>,
        ranges: &[(usize, usize)],
    ) -> Result<Vec<u64>, CudaError> {
        for &(off, len) in ranges {
            if off.checked_add(len).is_none_or(|end| end > data.len()) {
                return Err(CudaError::Shape {
                    what: "hashed range end (within the buffer)",
                    expected: data.len(),
                    got: off.saturating_add(len),
                });
            }
        }
        if ranges.is_empty() {
            return Ok(Vec::new());
        }
        let n = to_u32("hashed ranges", ranges.len())?;
        let offsets: Vec<u64> = ranges.iter().map(|r| r.0 as u64).collect();
        let lens: Vec<u64> = ranges.iter().map(|r| r.1 as u64).collect();
        let offsets = self.upload(&offsets)?;
        let lens = self.upload(&lens)?;
        let mut out = self.zeros::<u64>(ranges.len())?;
        let mut args = Args::new(&self.inner.stream);
        let p = HashRangesParams {
            data: args.read(data),
            offsets: args.read(&offsets),
            lens: args.read(&lens),
            out: args.write(&mut out),
            n,
            pad0: 0,
        };
        let blocks = (ranges.len().div_ceil(CHECKSUM_WARPS) as u32, 1, 1);
        // Launch contract: every range lies within data (checked above);
        // offsets, lens and out hold n u64 each; one warp per range over
        // ceil(n / 8) blocks of 8 warps, and the kernel returns for warps
        // past n.
        self.launch(kernels::xxh3_ranges(), &p, blocks, args)?;
        self.download(&out)
    }

    /// The transfer layer's per-page checksums (src/transfer/checksum.rs)
    /// over `pages` of the device arena, page `pages[i]` holding `tokens[i]`
    /// written rows (slots `0..tokens[i]` of every layer, K and V).
    pub fn page_checksums(
        &self,
        arena: &DeviceKvArena,
        pages: &[u32],
        tokens: &[usize],
    ) -> Result<PageChecksums, CudaError> {
        shape("tokens per checksummed page", pages.len(), tokens.len())?;
        for &p in pages {
            if p as usize >= arena.pages() {
                return Err(CudaError::PageOutOfRange {
                    page: p,
                    pages: arena.pages(),
                });
            }
        }
        if let Some(&t) = tokens.iter().find(|&&t| t > arena.page_size()) {
            return Err(CudaError::Shape {
                what: "rows in a checksummed page (at most page_size)",
                expected: arena.page_size(),
                got: t,
            });
        }
        let g = arena.geometry();
        if pages.is_empty() {
            return Ok(PageChecksums {
                regions: Vec::new(),
                pages: Vec::new(),
            });
        }
        let n_pages = to_u32("checksummed pages", pages.len())?;
        let tokens32: Vec<u32> = tokens.iter().map(|&t| t as u32).collect();
        let page_list = self.upload(pages)?;
        let token_list = self.upload(&tokens32)?;
        let mut regions = self.zeros::<u64>(pages.len() * g.n_layers * 2)?;
        let mut sums = self.zeros::<u64>(pages.len())?;
        let mut args = Args::new(&self.inner.stream);
        let p = PageChecksumParams {
            kv: args.read(&arena.data),
            pages: args.read(&page_list),
            tokens: args.read(&token_list),
            region_hashes: args.write(&mut regions),
            page_checksums: args.write(&mut sums),
            page_bytes: arena.page_bytes() as u64,
            n_pages,
            n_layers: to_u32("layers", g.n_layers)?,
            page_size: to_u32("page size", arena.page_size())?,
            row_bytes: to_u32("KV row bytes", g.kv_dim() * g.dtype.size_bytes())?,
        };
        // Launch contract: every page is inside the arena and every token
        // count at most page_size (checked), so each region (at most
        // page_size rows of one layer's K or V) lies inside its page;
        // regions holds n_pages*n_layers*2 and sums n_pages u64; one block
        // per page.
        self.launch(kernels::page_checksums(), &p, (n_pages, 1, 1), args)?;
        Ok(PageChecksums {
            regions: self.download(&regions)?,
            pages: self.download(&sums)?,
        })
    }
}
