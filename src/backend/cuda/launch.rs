//! Every kernel launch, and every other `unsafe` of the CUDA backend.
//!
//! Each public operation checks, before it launches, everything the kernel
//! relies on for memory safety: buffer lengths against the shapes in the
//! params struct, page tables and slot maps built for this arena (their
//! page indices were checked when they were built), and shapes with a
//! compiled instantiation. All work runs on the device's one stream, in
//! call order, so a buffer dropped after a call is freed (stream-ordered)
//! only after the kernels that use it.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg};

use super::arena::{DeviceKvArena, PageTables, SlotMap};
use super::params::*;
use super::{CudaDevice, CudaError};
use crate::backend::Rope;
use crate::backend::{RopeScaling, RopeStyle};
use crate::kv::KvDtype;

/// Head dimensions with compiled attention kernels.
pub const HEAD_DIMS: [usize; 6] = [8, 16, 32, 64, 128, 256];
/// Query heads per KV head that decode kernels are compiled for; a ratio in
/// between uses the next one up (the padding heads are computed, not written).
pub const DECODE_GROUPS: [usize; 4] = [1, 2, 4, 8];
/// Most query heads per KV head in prefill (its (position, head) row tile).
pub const PREFILL_MAX_GROUP: usize = PREFILL_ROWS;

const PREFILL_ROWS: usize = 32; // mirrors PREFILL_ROWS in prefill_attention.cu
const PREFILL_BK: usize = 32; // mirrors PREFILL_BK
const PREFILL_THREADS: u32 = 128;
/// Head dimensions with a tensor-core prefill kernel (f16 and bf16 KV).
pub const PREFILL_MMA_HEAD_DIMS: [usize; 2] = [64, 128];
const PMMA_BM: usize = 64; // mirrors PMMA_BM in prefill_mma.cu (rows per block)
const PMMA_BN: usize = 64; // mirrors PMMA_BN (keys per tile)
const PMMA_THREADS: u32 = 128;
const LIN_ROWS: usize = 16; // mirrors LIN_ROWS in linear.cu (rows of x per block)
const LIN_WARPS: usize = 8; // mirrors LIN_WARPS (output columns per block)
const DECODE_THREADS: u32 = 128;
const CHECKSUM_WARPS: usize = 8; // mirrors CHECKSUM_WARPS in checksum.cu
/// Smallest KV chunk a split-KV decode block takes (positions).
const MIN_CHUNK: usize = 256;
/// Most chunks `Split::Auto` cuts one sequence into (32 chunks of each of
/// 8 KV heads already fill an H200's 132 SMs twice for one sequence).
const AUTO_MAX_SPLITS: usize = 32;

// SAFETY (all impls below): each type is #[repr(C)], made only of integers
// and floats, with its size asserted equal to the C++ struct it mirrors in
// cuda/params.cuh; the kernel receives it by value.
unsafe impl DeviceRepr for DecodeParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for MergeParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for PrefillParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for KvAppendParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for ScrubParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for RmsNormParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for RopeParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for SwigluParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for EmbeddingParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for ArgmaxParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for LinearParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for AddParams {}
// SAFETY: as above.
// SAFETY: as above.
unsafe impl DeviceRepr for HashRangesParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for PageChecksumParams {}

/// True when libcuda can be loaded (checked before any driver call, since
/// cudarc's context creation panics without it).
pub(super) fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library and drops the handle.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// A kernel the device must load, with its dynamic shared memory need.
pub(super) struct KernelSpec {
    pub name: String,
    pub dynamic_smem: usize,
}

fn dtype_name(d: KvDtype) -> &'static str {
    match d {
        KvDtype::F32 => "f32",
        KvDtype::F16 => "f16",
        KvDtype::BF16 => "bf16",
    }
}

const DTYPES: [KvDtype; 3] = [KvDtype::F32, KvDtype::F16, KvDtype::BF16];

fn prefill_smem(head_dim: usize) -> usize {
    // mirrors PrefillCfg::SMEM_BYTES: q rows, K tile, V tile, rows padded by one float
    (PREFILL_ROWS + 2 * PREFILL_BK) * (head_dim + 1) * 4
}

fn prefill_mma_smem(head_dim: usize) -> usize {
    // mirrors PmmaCfg::SMEM_BYTES: Q, K and V tiles of 2-byte elements, rows padded by 8
    (PMMA_BM + 2 * PMMA_BN) * (head_dim + 8) * 2
}

/// Which prefill attention kernel runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PrefillKernel {
    /// Tensor cores where compiled (f16/bf16 KV, head_dim in
    /// [`PREFILL_MMA_HEAD_DIMS`], at most 64 query heads per KV head), else
    /// the scalar kernel.
    #[default]
    Auto,
    /// The scalar f32 kernel (every dtype and head dim): the reference.
    Scalar,
    /// The tensor-core (mma.sync) kernel; refused where not compiled.
    TensorCore,
}

/// Every kernel the dispatch below can name.
pub(super) fn kernel_specs() -> Vec<KernelSpec> {
    let plain = |name: String| KernelSpec {
        name,
        dynamic_smem: 0,
    };
    let mut v = Vec::new();
    for d in DTYPES {
        let t = dtype_name(d);
        for hd in HEAD_DIMS {
            for g in DECODE_GROUPS {
                v.push(plain(format!("decode_attention_{t}_d{hd}_g{g}")));
            }
            v.push(KernelSpec {
                name: format!("prefill_attention_{t}_d{hd}"),
                dynamic_smem: prefill_smem(hd),
            });
            if d != KvDtype::F32 && PREFILL_MMA_HEAD_DIMS.contains(&hd) {
                v.push(KernelSpec {
                    name: format!("prefill_mma_{t}_d{hd}"),
                    dynamic_smem: prefill_mma_smem(hd),
                });
            }
        }
        v.push(plain(format!("kv_append_{t}")));
    }
    for n in [
        "decode_merge",
        "scrub_pages",
        "rms_norm",
        "rope",
        "swiglu",
        "embedding",
        "argmax",
        "linear",
        "add_periodic",
        "xxh3_ranges",
        "page_checksums",
    ] {
        v.push(plain(n.to_string()));
    }
    v
}

fn shape(what: &'static str, expected: usize, got: usize) -> Result<(), CudaError> {
    if expected == got {
        Ok(())
    } else {
        Err(CudaError::Shape {
            what,
            expected,
            got,
        })
    }
}

fn to_u32(what: &'static str, x: usize) -> Result<u32, CudaError> {
    u32::try_from(x).map_err(|_| CudaError::Unsupported {
        what,
        detail: format!("{x} exceeds u32"),
    })
}

/// A launch grid sized from runtime values: `None` when a dimension is 0
/// (nothing to launch: the caller returns before touching the device), and
/// a typed error, before any launch, when one exceeds what CUDA accepts
/// (x below 2^31, y and z at most 65535).
fn grid(
    what: &'static str,
    x: usize,
    y: usize,
    z: usize,
) -> Result<Option<(u32, u32, u32)>, CudaError> {
    if x == 0 || y == 0 || z == 0 {
        return Ok(None);
    }
    if x > i32::MAX as usize || y > 65_535 || z > 65_535 {
        return Err(CudaError::Unsupported {
            what,
            detail: format!("grid ({x}, {y}, {z}) (at most (2^31 - 1, 65535, 65535))"),
        });
    }
    Ok(Some((x as u32, y as u32, z as u32)))
}

fn grid_stride_blocks(total: usize) -> u32 {
    total.div_ceil(256).clamp(1, 65_535) as u32
}

/// How decode splits the KV length across blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Split {
    /// Each sequence cut by its own length only (chunks of at least 256
    /// positions, at most 32 of them), so its output is bit-identical alone
    /// or in any batch.
    #[default]
    Auto,
    /// Chunks of exactly this many positions (at least 1).
    ChunkTokens(usize),
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
        o_len: usize,
        lse_len: usize,
    ) -> Result<(&mut CudaSlice<f32>, &mut CudaSlice<f32>), CudaError> {
        if self.part_o.as_ref().is_none_or(|b| b.len() < o_len) {
            self.part_o = Some(dev.zeros(o_len)?);
        }
        if self.part_lse.as_ref().is_none_or(|b| b.len() < lse_len) {
            self.part_lse = Some(dev.zeros(lse_len)?);
        }
        match (self.part_o.as_mut(), self.part_lse.as_mut()) {
            (Some(o), Some(l)) => Ok((o, l)),
            _ => Err(CudaError::Shape {
                what: "decode workspace",
                expected: o_len,
                got: 0,
            }),
        }
    }
}

/// Attention shape shared by decode and prefill, checked against the arena.
struct AttnShape {
    head_dim: usize,
    n_kv_heads: usize,
    group: usize,
    page_size_log2: u32,
    page_stride: u64,
}

fn attn_shape(
    arena: &DeviceKvArena,
    tables: &PageTables,
    layer: usize,
    n_heads: usize,
) -> Result<AttnShape, CudaError> {
    if tables.arena_id != arena.id {
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
    if !HEAD_DIMS.contains(&g.head_dim) {
        return Err(CudaError::Unsupported {
            what: "head_dim",
            detail: format!("{} (compiled: {HEAD_DIMS:?})", g.head_dim),
        });
    }
    if n_heads == 0 || !n_heads.is_multiple_of(g.n_kv_heads) || g.n_kv_heads > 65_535 {
        return Err(CudaError::Unsupported {
            what: "head counts",
            detail: format!(
                "{n_heads} query heads over {} KV heads (a multiple, at most 65535 KV heads)",
                g.n_kv_heads
            ),
        });
    }
    Ok(AttnShape {
        head_dim: g.head_dim,
        n_kv_heads: g.n_kv_heads,
        group: n_heads / g.n_kv_heads,
        page_size_log2: arena.page_size().trailing_zeros(),
        page_stride: arena.page_elems() as u64,
    })
}

fn sm_scale_log2(head_dim: usize) -> f32 {
    (std::f64::consts::LOG2_E / (head_dim as f64).sqrt()) as f32
}

impl CudaDevice {
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
        let s = attn_shape(arena, tables, layer, n_heads)?;
        let Some(&kgroup) = DECODE_GROUPS.iter().find(|&&k| k >= s.group) else {
            return Err(CudaError::Unsupported {
                what: "query heads per KV head in decode",
                detail: format!("{} (at most {})", s.group, DECODE_GROUPS[3]),
            });
        };
        if tables.max_q_len != 1 {
            return Err(CudaError::Unsupported {
                what: "decode query length",
                detail: format!("{} (decode takes one query per sequence)", tables.max_q_len),
            });
        }
        let batch = tables.batch;
        let rows = batch * n_heads * s.head_dim;
        shape("decode q elements", rows, q.len())?;
        shape("decode out elements", rows, out.len())?;

        let max_len = tables.max_kv_len;
        if batch == 0 {
            return Ok(0);
        }
        if max_len == 0 {
            return Err(CudaError::Shape {
                what: "decode KV length (at least the current position)",
                expected: 1,
                got: 0,
            });
        }
        // (chunk, auto_max_splits, num_splits): num_splits is grid.x, enough
        // chunks for the longest sequence.
        let (chunk, auto_max_splits, num_splits) = match split {
            Split::ChunkTokens(0) => {
                return Err(CudaError::Unsupported {
                    what: "decode chunk",
                    detail: "0 positions".into(),
                });
            }
            Split::ChunkTokens(n) => {
                let chunk = n.min(max_len);
                (chunk, 0, max_len.div_ceil(chunk))
            }
            // Each sequence's chunk is max(MIN_CHUNK, ceil(len / AUTO_MAX_SPLITS)
            // rounded up to 64), from its own length (see the kernel): at most
            // min(AUTO_MAX_SPLITS, ceil(len / MIN_CHUNK)) chunks, which
            // max_len bounds for every sequence of the batch.
            Split::Auto => (
                MIN_CHUNK,
                AUTO_MAX_SPLITS,
                AUTO_MAX_SPLITS.min(max_len.div_ceil(MIN_CHUNK)),
            ),
        };
        let name = format!(
            "decode_attention_{}_d{}_g{kgroup}",
            dtype_name(arena.geometry().dtype),
            s.head_dim
        );
        let func = self.kernel(&name)?;
        let stream = &self.inner.stream;
        let mut p = DecodeParams {
            page_stride: s.page_stride,
            batch: to_u32("batch", batch)?,
            n_heads: to_u32("n_heads", n_heads)?,
            n_kv_heads: to_u32("n_kv_heads", s.n_kv_heads)?,
            group: to_u32("group", s.group)?,
            layer: to_u32("layer", layer)?,
            page_size_log2: s.page_size_log2,
            num_splits: to_u32("num_splits", num_splits)?,
            chunk_tokens: to_u32("chunk", chunk)?,
            auto_max_splits: to_u32("auto splits", auto_max_splits)?,
            sm_scale_log2: sm_scale_log2(s.head_dim),
            ..Default::default()
        };
        let Some(grid_dim) = grid("decode grid", num_splits, s.n_kv_heads, batch)? else {
            return Ok(0);
        };
        let Some(merge_grid) = grid("decode merge grid", n_heads, batch, 1)? else {
            return Ok(0);
        };
        let cfg = LaunchConfig {
            grid_dim,
            block_dim: (DECODE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (q_ptr, _gq) = q.device_ptr(stream);
        let (kv_ptr, _gk) = arena.data.device_ptr(stream);
        let (pt_ptr, _g1) = tables.page_table.device_ptr(stream);
        let (pi_ptr, _g2) = tables.page_indptr.device_ptr(stream);
        let (len_ptr, _g3) = tables.kv_len.device_ptr(stream);
        p.q = q_ptr;
        p.kv = kv_ptr;
        p.page_table = pt_ptr;
        p.page_indptr = pi_ptr;
        p.kv_len = len_ptr;
        if num_splits == 1 {
            let (out_ptr, _go) = out.device_ptr_mut(stream);
            p.out = out_ptr;
            let mut b = stream.launch_builder(func);
            b.arg(&p);
            // SAFETY: q and out hold batch*n_heads*head_dim f32 (checked);
            // the page tables were built for this arena (id checked) with every
            // page index inside it and kv_len covered by each sequence's pages;
            // the kernel matches dtype and head_dim and group >= p.group; grid
            // is (1, n_kv_heads, batch) as the kernel indexes.
            unsafe { b.launch(cfg) }
                .map(drop)
                .map_err(CudaError::driver("launching decode attention"))?;
            return Ok(1);
        }
        let (part_o, part_lse) =
            ws.ensure(self, rows * num_splits, batch * n_heads * num_splits)?;
        {
            let (po_ptr, _g4) = part_o.device_ptr_mut(stream);
            let (pl_ptr, _g5) = part_lse.device_ptr_mut(stream);
            p.part_o = po_ptr;
            p.part_lse = pl_ptr;
            let mut b = stream.launch_builder(func);
            b.arg(&p);
            // SAFETY: as the single-chunk launch, with part_o holding at least
            // batch*n_heads*num_splits*head_dim and part_lse batch*n_heads*num_splits
            // f32 (ensured just above); grid.x = num_splits chunks cover every
            // sequence's kv_len (fixed chunks of chunk_tokens cover max_kv_len;
            // auto chunks are at most num_splits per sequence, see above).
            unsafe { b.launch(cfg) }
                .map(drop)
                .map_err(CudaError::driver("launching decode attention"))?;
        }
        let (po_ptr, _g4) = part_o.device_ptr(stream);
        let (pl_ptr, _g5) = part_lse.device_ptr(stream);
        let (out_ptr, _go) = out.device_ptr_mut(stream);
        let mp = MergeParams {
            part_o: po_ptr,
            part_lse: pl_ptr,
            out: out_ptr,
            batch: p.batch,
            n_heads: p.n_heads,
            head_dim: to_u32("head_dim", s.head_dim)?,
            num_splits: p.num_splits,
        };
        let merge = self.kernel("decode_merge")?;
        let mut b = stream.launch_builder(merge);
        b.arg(&mp);
        // SAFETY: part_o/part_lse were sized for (batch, n_heads, num_splits) above
        // and written by the launch before on the same stream; out holds
        // batch*n_heads*head_dim f32; grid (n_heads, batch) as the kernel indexes.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: merge_grid,
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map(drop)
        .map_err(CudaError::driver("launching the decode merge"))?;
        Ok(num_splits)
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
    /// returns the one that ran ([`PrefillKernel::Scalar`] or
    /// [`PrefillKernel::TensorCore`]).
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
        let s = attn_shape(arena, tables, layer, n_heads)?;
        let dtype = arena.geometry().dtype;
        let mma_ok = dtype != KvDtype::F32
            && PREFILL_MMA_HEAD_DIMS.contains(&s.head_dim)
            && s.group <= PMMA_BM;
        let use_mma = match kernel {
            PrefillKernel::Auto => mma_ok,
            PrefillKernel::Scalar => false,
            PrefillKernel::TensorCore if mma_ok => true,
            PrefillKernel::TensorCore => {
                return Err(CudaError::Unsupported {
                    what: "tensor-core prefill",
                    detail: format!(
                        "{dtype:?} KV, head_dim {}, {} query heads per KV head (compiled: f16/bf16, \
                         head_dim {PREFILL_MMA_HEAD_DIMS:?}, at most {PMMA_BM})",
                        s.head_dim, s.group
                    ),
                });
            }
        };
        if !use_mma && s.group > PREFILL_MAX_GROUP {
            return Err(CudaError::Unsupported {
                what: "query heads per KV head in prefill",
                detail: format!("{} (at most {PREFILL_MAX_GROUP})", s.group),
            });
        }
        let rows = tables.total_q * n_heads * s.head_dim;
        shape("prefill q elements", rows, q.len())?;
        shape("prefill out elements", rows, out.len())?;
        let chosen = if use_mma {
            PrefillKernel::TensorCore
        } else {
            PrefillKernel::Scalar
        };
        let rows_per_tile = if use_mma { PMMA_BM } else { PREFILL_ROWS } / s.group;
        let q_tiles = tables.max_q_len.div_ceil(rows_per_tile.max(1));
        let Some(grid_dim) = grid("prefill grid", q_tiles, s.n_kv_heads, tables.batch)? else {
            return Ok(chosen);
        };
        let stream = &self.inner.stream;
        let (q_ptr, _gq) = q.device_ptr(stream);
        let (kv_ptr, _gk) = arena.data.device_ptr(stream);
        let (pt_ptr, _g1) = tables.page_table.device_ptr(stream);
        let (pi_ptr, _g2) = tables.page_indptr.device_ptr(stream);
        let (qi_ptr, _g3) = tables.q_indptr.device_ptr(stream);
        let (len_ptr, _g4) = tables.kv_len.device_ptr(stream);
        let (out_ptr, _go) = out.device_ptr_mut(stream);
        let p = PrefillParams {
            q: q_ptr,
            kv: kv_ptr,
            page_table: pt_ptr,
            page_indptr: pi_ptr,
            q_indptr: qi_ptr,
            kv_len: len_ptr,
            out: out_ptr,
            page_stride: s.page_stride,
            batch: to_u32("batch", tables.batch)?,
            n_heads: to_u32("n_heads", n_heads)?,
            n_kv_heads: to_u32("n_kv_heads", s.n_kv_heads)?,
            group: to_u32("group", s.group)?,
            layer: to_u32("layer", layer)?,
            page_size_log2: s.page_size_log2,
            sm_scale_log2: sm_scale_log2(s.head_dim),
            pad0: 0,
        };
        if use_mma && (q_ptr % 8 != 0 || out_ptr % 8 != 0) {
            return Err(CudaError::Unsupported {
                what: "tensor-core prefill buffers",
                detail: "q and out must be 8-byte aligned (views at an odd element)".into(),
            });
        }
        // The kernel family, its block size and shared memory, and what a
        // failed launch was doing.
        let (family, threads, smem, what) = if use_mma {
            let what = "launching tensor-core prefill attention";
            (
                "prefill_mma",
                PMMA_THREADS,
                prefill_mma_smem(s.head_dim),
                what,
            )
        } else {
            let what = "launching prefill attention";
            (
                "prefill_attention",
                PREFILL_THREADS,
                prefill_smem(s.head_dim),
                what,
            )
        };
        let func = self.kernel(&format!("{family}_{}_d{}", dtype_name(dtype), s.head_dim))?;
        let mut b = stream.launch_builder(func);
        b.arg(&p);
        // SAFETY: q and out hold total_q*n_heads*head_dim f32 (checked); the page
        // tables were built for this arena with every page inside it, each
        // sequence's kv_len covered by its pages and q_len <= kv_len; the kernel
        // matches dtype and head_dim, and its dynamic shared memory is what it
        // computes for this head_dim and was allowed when it was loaded.
        // Scalar: group <= 32 rows per tile. Tensor cores: group <= 64 rows per
        // block; q and out 8-byte aligned (checked) for its float2 accesses; KV
        // rows are 16-byte multiples (arena invariant) for its 16-byte loads.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim,
                block_dim: (threads, 1, 1),
                shared_mem_bytes: smem as u32,
            })
        }
        .map_err(CudaError::driver(what))?;
        Ok(chosen)
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
        let total = slots.n_tokens * g.kv_dim();
        shape("appended K elements", total, k.len())?;
        shape("appended V elements", total, v.len())?;
        let func = self.kernel(&format!("kv_append_{}", dtype_name(g.dtype)))?;
        let stream = &self.inner.stream;
        let (k_ptr, _g1) = k.device_ptr(stream);
        let (v_ptr, _g2) = v.device_ptr(stream);
        let (dp_ptr, _g3) = slots.dst_page.device_ptr(stream);
        let (ds_ptr, _g4) = slots.dst_slot.device_ptr(stream);
        let page_stride = arena.page_elems() as u64;
        let page_size_log2 = arena.page_size().trailing_zeros();
        let (kv_ptr, _g5) = arena.data.device_ptr_mut(stream);
        let p = KvAppendParams {
            k: k_ptr,
            v: v_ptr,
            dst_page: dp_ptr,
            dst_slot: ds_ptr,
            kv: kv_ptr,
            page_stride,
            n_tokens: to_u32("append rows", slots.n_tokens)?,
            kv_dim: to_u32("kv_dim", g.kv_dim())?,
            layer: to_u32("layer", layer)?,
            page_size_log2,
        };
        let mut b = stream.launch_builder(func);
        b.arg(&p);
        // SAFETY: k and v hold n_tokens*kv_dim f32 (checked); the slot map was
        // built for this arena (id checked) with every page inside it and every
        // slot below page_size; layer < n_layers; the kernel matches the dtype.
        unsafe { b.launch(grid_stride(total)) }
            .map(drop)
            .map_err(CudaError::driver("launching the KV append"))
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
        };
        let n_pages = to_u32("pages to scrub", pages.len())?;
        let list = self.upload(pages)?;
        let func = self.kernel("scrub_pages")?;
        let stream = &self.inner.stream;
        let (pl_ptr, _g1) = list.device_ptr(stream);
        let page_vec16 = (arena.page_bytes() / 16) as u64;
        let (kv_ptr, _g2) = arena.data.device_ptr_mut(stream);
        let p = ScrubParams {
            kv: kv_ptr,
            pages: pl_ptr,
            page_vec16,
            n_pages,
            fill,
        };
        let mut b = stream.launch_builder(func);
        b.arg(&p);
        // SAFETY: every listed page is inside the arena (checked); page bytes are
        // a multiple of 16 (checked when the arena was built), so the kernel's
        // 16-byte stores stay inside each page; one block per listed page.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (n_pages, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map(drop)
        .map_err(CudaError::driver("launching the page scrub"))
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
        let Some(grid_dim) = grid("RMSNorm rows", x.len() / dim, 1, 1)? else {
            return Ok(());
        };
        let n_rows = grid_dim.0;
        let stream = &self.inner.stream;
        let (x_ptr, _g1) = x.device_ptr(stream);
        let (w_ptr, _g2) = w.device_ptr(stream);
        let (o_ptr, _g3) = out.device_ptr_mut(stream);
        let p = RmsNormParams {
            x: x_ptr,
            w: w_ptr,
            out: o_ptr,
            n_rows,
            dim: to_u32("RMSNorm dim", dim)?,
            eps,
            pad0: 0,
        };
        let mut b = stream.launch_builder(self.kernel("rms_norm")?);
        b.arg(&p);
        // SAFETY: x and out hold n_rows*dim f32 and w holds dim (checked); one
        // block of 256 threads per row, as the kernel's block reduction expects.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim,
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map(drop)
        .map_err(CudaError::driver("launching RMSNorm"))
    }

    /// Rotary embedding in place on `x` `[positions.len(), rope.n_heads,
    /// rope.head_dim]`.
    pub fn rope(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        positions: &impl DevicePtr<u32>,
        rope: Rope,
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
        let total = positions
            .len()
            .checked_mul(n_heads)
            .and_then(|n| n.checked_mul(head_dim))
            .unwrap_or(usize::MAX);
        shape("RoPE elements", total, x.len())?;
        let stream = &self.inner.stream;
        let (x_ptr, _g1) = x.device_ptr_mut(stream);
        let (pos_ptr, _g2) = positions.device_ptr(stream);
        let p = RopeParams {
            x: x_ptr,
            positions: pos_ptr,
            theta: f64::from(theta),
            n_tokens: to_u32("RoPE tokens", positions.len())?,
            n_heads: to_u32("RoPE heads", n_heads)?,
            head_dim: to_u32("RoPE head_dim", head_dim)?,
            style: match style {
                RopeStyle::Interleaved => 0,
                RopeStyle::Half => 1,
            },
            ..RopeParams::default()
        };
        let p = match scaling {
            RopeScaling::None => p,
            RopeScaling::Linear { factor } => RopeParams {
                scaling: 1,
                factor: f64::from(factor),
                ..p
            },
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            } => RopeParams {
                scaling: 2,
                factor: f64::from(factor),
                low_freq_factor: f64::from(low_freq_factor),
                high_freq_factor: f64::from(high_freq_factor),
                original_max_position: f64::from(original_max_position),
                ..p
            },
        };
        let mut b = stream.launch_builder(self.kernel("rope")?);
        b.arg(&p);
        // SAFETY: x holds n_tokens*n_heads*head_dim f32 and positions n_tokens
        // u32 (checked); head_dim is even; the kernel grid-strides over pairs.
        unsafe { b.launch(grid_stride(total / 2)) }
            .map(drop)
            .map_err(CudaError::driver("launching RoPE"))
    }

    /// `gate = silu(gate) * up`, elementwise, in place.
    pub fn swiglu(
        &self,
        gate: &mut impl DevicePtrMut<f32>,
        up: &impl DevicePtr<f32>,
    ) -> Result<(), CudaError> {
        shape("SwiGLU up elements", gate.len(), up.len())?;
        let n = gate.len();
        let stream = &self.inner.stream;
        let (u_ptr, _g2) = up.device_ptr(stream);
        let (g_ptr, _g1) = gate.device_ptr_mut(stream);
        let p = SwigluParams {
            gate: g_ptr,
            up: u_ptr,
            out: g_ptr,
            n: n as u64,
        };
        let mut b = stream.launch_builder(self.kernel("swiglu")?);
        b.arg(&p);
        // SAFETY: gate and up hold n f32 each (checked); out is gate, which the
        // kernel reads and writes at the same index only.
        unsafe { b.launch(grid_stride(n)) }
            .map(drop)
            .map_err(CudaError::driver("launching SwiGLU"))
    }

    /// `out = x · wᵀ` for `x` `[m, k]` and `w` `[n, k]`; `out` is `[m, n]`.
    pub fn linear(
        &self,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<f32>,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), CudaError> {
        if n == 0 || !w.len().is_multiple_of(n) || w.is_empty() {
            return Err(CudaError::Shape {
                what: "weight (a non-empty multiple of its output rows)",
                expected: n,
                got: w.len(),
            });
        }
        let k = w.len() / n;
        if !x.len().is_multiple_of(k) {
            return Err(CudaError::Shape {
                what: "matmul input (a multiple of the weight's columns)",
                expected: k,
                got: x.len(),
            });
        }
        let m = x.len() / k;
        shape("matmul output elements", m * n, out.len())?;
        if m == 0 {
            return Ok(());
        }
        let stream = &self.inner.stream;
        let (x_ptr, _g1) = x.device_ptr(stream);
        let (w_ptr, _g2) = w.device_ptr(stream);
        let (o_ptr, _g3) = out.device_ptr_mut(stream);
        let p = LinearParams {
            x: x_ptr,
            w: w_ptr,
            out: o_ptr,
            m: to_u32("matmul rows", m)?,
            n: to_u32("matmul columns", n)?,
            k: to_u32("matmul depth", k)?,
            pad0: 0,
        };
        let Some(grid_dim) = grid(
            "matmul blocks (columns, rows)",
            n.div_ceil(LIN_WARPS),
            m.div_ceil(LIN_ROWS),
            1,
        )?
        else {
            return Ok(());
        };
        let mut b = stream.launch_builder(self.kernel("linear")?);
        b.arg(&p);
        // SAFETY: x holds m*k, w n*k and out m*n f32 (checked); the grid
        // covers n columns in blocks of LIN_WARPS warps and m rows in tiles
        // of LIN_ROWS, and the kernel bounds every access by m, n, k.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim,
                block_dim: (32 * LIN_WARPS as u32, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map(drop)
        .map_err(CudaError::driver("launching matmul"))
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
        let stream = &self.inner.stream;
        let (y_ptr, _g2) = y.device_ptr(stream);
        let (x_ptr, _g1) = x.device_ptr_mut(stream);
        let p = AddParams {
            x: x_ptr,
            y: y_ptr,
            n: n as u64,
            period: y.len() as u64,
        };
        let mut b = stream.launch_builder(self.kernel("add_periodic")?);
        b.arg(&p);
        // SAFETY: x holds n f32 and y holds period f32, period > 0 (checked).
        unsafe { b.launch(grid_stride(n)) }
            .map(drop)
            .map_err(CudaError::driver("launching an add"))
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
        let ids = self.upload(tokens)?;
        let stream = &self.inner.stream;
        let (t_ptr, _g1) = table.device_ptr(stream);
        let (i_ptr, _g2) = ids.device_ptr(stream);
        let total = out.len();
        let (o_ptr, _g3) = out.device_ptr_mut(stream);
        let p = EmbeddingParams {
            table: t_ptr,
            tokens: i_ptr,
            out: o_ptr,
            n_tokens: to_u32("tokens", tokens.len())?,
            dim: to_u32("dim", dim)?,
            vocab: to_u32("vocab", vocab)?,
            pad0: 0,
        };
        let mut b = stream.launch_builder(self.kernel("embedding")?);
        b.arg(&p);
        // SAFETY: table holds vocab*dim f32, every token is below vocab (checked,
        // and the kernel also bounds it), out holds n_tokens*dim f32 (checked).
        unsafe { b.launch(grid_stride(total)) }
            .map(drop)
            .map_err(CudaError::driver("launching the embedding gather"))
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
        {
            let stream = &self.inner.stream;
            let (l_ptr, _g1) = logits.device_ptr(stream);
            let (i_ptr, _g2) = idx.device_ptr_mut(stream);
            let (n_ptr, _g3) = nans.device_ptr_mut(stream);
            let p = ArgmaxParams {
                logits: l_ptr,
                out_index: i_ptr,
                out_nans: n_ptr,
                n_rows: to_u32("logit rows", n_rows)?,
                vocab: to_u32("vocab", vocab)?,
            };
            let mut b = stream.launch_builder(self.kernel("argmax")?);
            b.arg(&p);
            // SAFETY: logits hold n_rows*vocab f32, idx and nans n_rows u32 each;
            // one block of exactly 256 threads per row (the kernel's shared arrays).
            unsafe {
                b.launch(LaunchConfig {
                    grid_dim: (p.n_rows, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .map(drop)
            .map_err(CudaError::driver("launching argmax"))?;
        }
        let nans = self.download(&nans)?;
        if let Some((row, &n)) = nans.iter().enumerate().find(|(_, n)| **n > 0) {
            return Err(CudaError::NanLogits { row, nans: n });
        }
        self.download(&idx)
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

impl CudaDevice {
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
        {
            let stream = &self.inner.stream;
            let (d_ptr, _g1) = data.device_ptr(stream);
            let (o_ptr, _g2) = offsets.device_ptr(stream);
            let (l_ptr, _g3) = lens.device_ptr(stream);
            let (out_ptr, _g4) = out.device_ptr_mut(stream);
            let p = HashRangesParams {
                data: d_ptr,
                offsets: o_ptr,
                lens: l_ptr,
                out: out_ptr,
                n,
                pad0: 0,
            };
            let mut b = stream.launch_builder(self.kernel("xxh3_ranges")?);
            b.arg(&p);
            // SAFETY: every range lies within data (checked above); offsets, lens
            // and out hold n u64 each; one warp per range over ceil(n / 8) blocks
            // of 8 warps, and the kernel returns for warps past n.
            unsafe {
                b.launch(LaunchConfig {
                    grid_dim: (ranges.len().div_ceil(CHECKSUM_WARPS) as u32, 1, 1),
                    block_dim: (CHECKSUM_WARPS as u32 * 32, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .map(drop)
            .map_err(CudaError::driver("launching xxh3 over ranges"))?;
        }
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
        {
            let stream = &self.inner.stream;
            let (kv_ptr, _g1) = arena.data.device_ptr(stream);
            let (p_ptr, _g2) = page_list.device_ptr(stream);
            let (t_ptr, _g3) = token_list.device_ptr(stream);
            let (r_ptr, _g4) = regions.device_ptr_mut(stream);
            let (s_ptr, _g5) = sums.device_ptr_mut(stream);
            let p = PageChecksumParams {
                kv: kv_ptr,
                pages: p_ptr,
                tokens: t_ptr,
                region_hashes: r_ptr,
                page_checksums: s_ptr,
                page_bytes: arena.page_bytes() as u64,
                n_pages,
                n_layers: to_u32("layers", g.n_layers)?,
                page_size: to_u32("page size", arena.page_size())?,
                row_bytes: to_u32("KV row bytes", g.kv_dim() * g.dtype.size_bytes())?,
            };
            let mut b = stream.launch_builder(self.kernel("page_checksums")?);
            b.arg(&p);
            // SAFETY: every page is inside the arena and every token count at most
            // page_size (checked), so each region (at most page_size rows of one
            // layer's K or V) lies inside its page; regions holds n_pages*n_layers*2
            // and sums n_pages u64; one block per page.
            unsafe {
                b.launch(LaunchConfig {
                    grid_dim: (n_pages, 1, 1),
                    block_dim: (CHECKSUM_WARPS as u32 * 32, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .map(drop)
            .map_err(CudaError::driver("launching page checksums"))?;
        }
        Ok(PageChecksums {
            regions: self.download(&regions)?,
            pages: self.download(&sums)?,
        })
    }
}

/// Grid-stride launch of 256-thread blocks covering `total` items.
fn grid_stride(total: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid_stride_blocks(total), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grid_with_nothing_to_do_launches_nothing() {
        assert!(matches!(grid("t", 0, 4, 4), Ok(None)));
        assert!(matches!(grid("t", 4, 0, 4), Ok(None)));
        assert!(matches!(grid("t", 4, 4, 0), Ok(None)));
        assert!(matches!(grid("t", 1, 1, 1), Ok(Some((1, 1, 1)))));
    }

    #[test]
    fn a_grid_cuda_would_refuse_is_a_typed_error_before_launch() {
        assert!(matches!(grid("t", 1, 65_535, 65_535), Ok(Some(_))));
        for (x, y, z) in [(1, 65_536, 1), (1, 1, 65_536), (1usize << 31, 1, 1)] {
            assert!(
                matches!(
                    grid("t", x, y, z),
                    Err(CudaError::Unsupported { what: "t", .. })
                ),
                "({x}, {y}, {z})"
            );
        }
    }
}
