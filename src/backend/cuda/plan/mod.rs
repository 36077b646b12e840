//! Launch policy, planned on the host before anything touches the device:
//! which attention kernel runs, how decode splits the KV length
//! (split-KV), the workspace that needs, and every grid. As FlashInfer's
//! `plan()`/`run()`: [`decode`] and [`prefill`] are pure functions of
//! sizes (no CUDA type, unit-tested on the CPU) that check what the kernels
//! need and answer the kernel, its params (device addresses left 0) and
//! grid; the ops (`ops/`) run a plan, filling in the addresses of buffers
//! they have checked against the plan. The matmuls' shapes and tiles,
//! chosen by the rows of x, are in `linear.rs`.
//!
//! Batch invariance: a split-KV chunk comes from each sequence's own length
//! (in the kernel, from `chunk_tokens` and `auto_max_splits`, which do not
//! depend on the batch); the batch only bounds how many chunks the grid
//! offers.

use super::CudaError;
use super::kernels::{self, Kernel};
use super::params::{DecodeParams, MergeParams, PrefillParams};
use super::table::{
    DECODE_GROUPS, DECODE_MMA_GROUPS, DECODE_MMA_HEAD_DIMS, HEAD_DIMS, PMMA_BM, PMMA_WIDE_BM,
    PREFILL_MMA_HEAD_DIMS, PREFILL_ROWS,
};
use crate::{KvDtype, KvGeometry};

mod linear;
#[cfg(test)]
mod tests;

pub(crate) use linear::{Bf16Tile, LinShape, dims, matmul_shape};

/// Most query heads per KV head in prefill (its (position, head) row tile).
pub const PREFILL_MAX_GROUP: usize = PREFILL_ROWS;
/// Smallest KV chunk a split-KV decode block takes (positions). Short
/// chunks lose: the H200 sweep of BENCHMARKS.md ("Second run on a GPU",
/// tensor-core kernel, GQA 32:4) read, as a share of copy bandwidth, with
/// chunks of 256 / 1024 positions: 0.35 / 0.49 at batch 1 and 32k, 0.50 /
/// 0.72 at batch 8 and 8k, 0.68 / 0.90 at batch 64 and 8k; only batch 1 at
/// 8k (0.24 / 0.15) preferred the shorter chunk. Its figures fit a fixed
/// cost of ~8-14 us per call plus ~1 us per 16-position tile of a warp,
/// and a block's start and end (Q's load, the pipeline's first copies, the
/// combine) weigh on short chunks.
const MIN_CHUNK: usize = 1024;
/// Most chunks `Split::Auto` cuts one sequence into: past 64k positions
/// chunks grow beyond `MIN_CHUNK`. At batch 1 and 128k positions the same
/// sweep read 0.82 of copy bandwidth with 64 chunks of 2048 against 0.65
/// with 128 of 1024 (and 0.75 with 32 of 4096); at batch 64 and 8k, 2048
/// beat 1024 too (0.97 / 0.92).
const AUTO_MAX_SPLITS: usize = 64;

/// How decode splits the KV length across blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Split {
    /// Each sequence cut by its own length only (chunks of at least 1024
    /// positions, at most 64 of them), so its output is bit-identical alone
    /// or in any batch.
    #[default]
    Auto,
    /// Chunks of exactly this many positions (at least 1).
    ChunkTokens(usize),
}

/// Which decode attention kernel runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DecodeKernel {
    /// Tensor cores where compiled (f16/bf16/FP8 KV, head_dim in
    /// [`DECODE_MMA_HEAD_DIMS`]), else the scalar kernel.
    #[default]
    Auto,
    /// The scalar f32 kernel (every dtype and head dim): the reference.
    Scalar,
    /// The tensor-core (mma.sync, cp.async pipeline) kernel; refused where
    /// not compiled.
    TensorCore,
    /// The tensor-core kernel with eight warps a block instead of four,
    /// each with its own pipeline: a chunk's tiles take half as many turns
    /// per warp, which is what a block's time is where blocks are few
    /// (batch 1). Its bits differ from [`DecodeKernel::TensorCore`]'s (each
    /// warp's softmax runs over other tiles) and are the same in any batch.
    /// Refused where not compiled, and at launch on a device without the
    /// shared memory (192 KiB a block at head_dim 128: compute capability
    /// 9.0). Not yet what `Auto` picks: it has not been timed on a GPU.
    TensorCoreWide,
}

/// Which prefill attention kernel runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PrefillKernel {
    /// Tensor cores where compiled (f16/bf16/FP8 KV, head_dim in
    /// [`PREFILL_MMA_HEAD_DIMS`], at most 64 query heads per KV head), else
    /// the scalar kernel.
    #[default]
    Auto,
    /// The scalar f32 kernel (every dtype and head dim): the reference.
    Scalar,
    /// The tensor-core (mma.sync) kernel, 64 (position, head) rows a block;
    /// refused where not compiled.
    TensorCore,
    /// The wide tensor-core kernel: 128 rows a block, two m-tiles a warp,
    /// so each K/V tile and fragment serves twice the rows. Its outputs
    /// have the bits of [`PrefillKernel::TensorCore`]'s (each row's
    /// arithmetic is the same); refused where not compiled. Not yet what
    /// `Auto` picks: it has not been timed on a GPU.
    TensorCoreWide,
}

/// Blocks of a launch, (x, y, z).
pub(crate) type Grid = (u32, u32, u32);

/// One kernel launch: the kernel, its params and its grid.
#[derive(Debug)]
pub(crate) struct Step<P> {
    pub kernel: Kernel<P>,
    pub params: P,
    pub grid: Grid,
}

pub(crate) fn to_u32(what: &'static str, x: usize) -> Result<u32, CudaError> {
    u32::try_from(x).map_err(|_| CudaError::Unsupported {
        what,
        detail: format!("{x} exceeds u32"),
    })
}

pub(crate) fn shape(what: &'static str, expected: usize, got: usize) -> Result<(), CudaError> {
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

/// A launch grid sized from runtime values: `None` when a dimension is 0
/// (nothing to launch: the caller returns before touching the device), and
/// a typed error, before any launch, when one exceeds what CUDA accepts
/// (x below 2^31, y and z at most 65535).
pub(crate) fn grid(
    what: &'static str,
    x: usize,
    y: usize,
    z: usize,
) -> Result<Option<Grid>, CudaError> {
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

/// Blocks of a grid-stride launch covering `total` items (256 per block,
/// at most 65535 blocks).
pub(crate) fn grid_stride(total: usize) -> Grid {
    (total.div_ceil(256).clamp(1, 65_535) as u32, 1, 1)
}

/// Attention shape shared by decode and prefill: the arena's geometry and
/// the layer and query heads asked for, checked against what is compiled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Attn {
    pub dtype: KvDtype,
    pub head_dim: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub group: usize,
    pub layer: usize,
    pub page_size_log2: u32,
    /// Elements per page.
    pub page_stride: u64,
}

impl Attn {
    /// Checks `layer` and `n_heads` against the arena's geometry `g` (pages
    /// of `page_size` positions, `page_elems` elements) and the compiled
    /// head dimensions.
    pub(crate) fn new(
        g: &KvGeometry,
        page_size: usize,
        page_elems: usize,
        layer: usize,
        n_heads: usize,
    ) -> Result<Attn, CudaError> {
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
        Ok(Attn {
            dtype: g.dtype,
            head_dim: g.head_dim,
            n_heads,
            n_kv_heads: g.n_kv_heads,
            group: n_heads / g.n_kv_heads,
            layer,
            page_size_log2: page_size.trailing_zeros(),
            page_stride: page_elems as u64,
        })
    }

    fn sm_scale_log2(&self) -> f32 {
        (std::f64::consts::LOG2_E / (self.head_dim as f64).sqrt()) as f32
    }
}

/// The batch a set of page tables describes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Batch {
    pub batch: usize,
    pub total_q: usize,
    pub max_q_len: usize,
    pub max_kv_len: usize,
}

/// What one decode attention call launches.
#[derive(Debug)]
pub(crate) enum DecodePlan {
    /// No sequence: nothing to launch.
    Empty,
    /// One block per (KV head, sequence) over its whole length, writing the
    /// output directly.
    Whole(Step<DecodeParams>),
    /// `splits` chunks per sequence into the workspace, then a merge pass.
    Split {
        attn: Step<DecodeParams>,
        merge: Step<MergeParams>,
        workspace: Workspace,
    },
}

impl DecodePlan {
    /// KV chunks launched per sequence, an upper bound on what each one
    /// uses (0: nothing launched, 1: no merge pass).
    pub(crate) fn splits(&self) -> usize {
        match self {
            DecodePlan::Empty => 0,
            DecodePlan::Whole(_) => 1,
            DecodePlan::Split { attn, .. } => attn.params.num_splits as usize,
        }
    }
}

/// f32 elements of split-KV decode's scratch buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Workspace {
    /// Partial outputs, `[batch, n_heads, num_splits, head_dim]`.
    pub part_o: usize,
    /// Their log-sum-exps, `[batch, n_heads, num_splits]`.
    pub part_lse: usize,
}

/// A paged-attention params struct `$ty` with the fields every attention
/// kernel shares (the arena's layout from `$a`, the batch from `$b`) and
/// the kernel's own fields as given; the rest zero.
macro_rules! attention_params {
    ($ty:ident, $a:expr, $b:expr, { $($field:ident: $value:expr),* $(,)? }) => {
        $ty {
            page_stride: $a.page_stride,
            batch: to_u32("batch", $b.batch)?,
            n_heads: to_u32("n_heads", $a.n_heads)?,
            n_kv_heads: to_u32("n_kv_heads", $a.n_kv_heads)?,
            group: to_u32("group", $a.group)?,
            layer: to_u32("layer", $a.layer)?,
            page_size_log2: $a.page_size_log2,
            sm_scale_log2: $a.sm_scale_log2(),
            $($field: $value,)*
            ..Default::default()
        }
    };
}

/// Plans decode attention (one query per sequence) for `b` with buffers
/// `q` and `out` of `q_len` and `out_len` elements, on the kernel `choice`
/// asks for; answers the kernel chosen (never [`DecodeKernel::Auto`]) with
/// the plan.
pub(crate) fn decode(
    a: &Attn,
    b: &Batch,
    q_len: usize,
    out_len: usize,
    split: Split,
    choice: DecodeKernel,
) -> Result<(DecodeKernel, DecodePlan), CudaError> {
    if a.group == 0 {
        return Err(CudaError::Unsupported {
            what: "query heads per KV head in decode",
            detail: "0".into(),
        });
    }
    // The tensor-core kernel copies 16-byte chunks of K and V rows: pages
    // must start on 16 bytes (they do for every compiled head dim, whose
    // rows are 64 bytes or more).
    let mma = matches!(a.dtype, KvDtype::F16 | KvDtype::BF16 | KvDtype::F8E4M3)
        && DECODE_MMA_HEAD_DIMS.contains(&a.head_dim)
        && (a.page_stride * a.dtype.size_bytes() as u64).is_multiple_of(16);
    let chosen = match (choice, mma) {
        (DecodeKernel::Scalar, _) | (DecodeKernel::Auto, false) => DecodeKernel::Scalar,
        (DecodeKernel::Auto | DecodeKernel::TensorCore, true) => DecodeKernel::TensorCore,
        (DecodeKernel::TensorCoreWide, true) => DecodeKernel::TensorCoreWide,
        (DecodeKernel::TensorCore | DecodeKernel::TensorCoreWide, false) => {
            return Err(CudaError::Unsupported {
                what: "tensor-core decode",
                detail: format!(
                    "{:?} KV, head_dim {} (compiled: f16/bf16/FP8, head_dim {DECODE_MMA_HEAD_DIMS:?})",
                    a.dtype, a.head_dim
                ),
            });
        }
    };
    let groups: &[usize] = match chosen {
        DecodeKernel::TensorCore | DecodeKernel::TensorCoreWide => &DECODE_MMA_GROUPS,
        _ => &DECODE_GROUPS,
    };
    // The smallest compiled group that holds the ratio; above the largest,
    // the largest, in head slices (see cuda/decode_attention.cuh).
    let largest = groups[groups.len() - 1];
    let kgroup = groups
        .iter()
        .copied()
        .find(|&k| k >= a.group)
        .unwrap_or(largest);
    let slices = a.group.div_ceil(kgroup);
    if b.max_q_len != 1 {
        return Err(CudaError::Unsupported {
            what: "decode query length",
            detail: format!("{} (decode takes one query per sequence)", b.max_q_len),
        });
    }
    let rows = b.batch * a.n_heads * a.head_dim;
    shape("decode q elements", rows, q_len)?;
    shape("decode out elements", rows, out_len)?;
    let max_len = b.max_kv_len;
    if b.batch == 0 {
        return Ok((chosen, DecodePlan::Empty));
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
        // min(AUTO_MAX_SPLITS, ceil(len / MIN_CHUNK)) chunks, which max_len
        // bounds for every sequence of the batch.
        Split::Auto => (
            MIN_CHUNK,
            AUTO_MAX_SPLITS,
            AUTO_MAX_SPLITS.min(max_len.div_ceil(MIN_CHUNK)),
        ),
    };
    let (family, kernel) = match chosen {
        DecodeKernel::TensorCore => (
            "decode_mma",
            kernels::decode_mma(a.dtype, a.head_dim, kgroup),
        ),
        DecodeKernel::TensorCoreWide => (
            "decode_mma_wide",
            kernels::decode_mma_wide(a.dtype, a.head_dim, kgroup),
        ),
        _ => (
            "decode_attention",
            kernels::decode_attention(a.dtype, a.head_dim, kgroup),
        ),
    };
    let kernel = kernel.ok_or_else(|| CudaError::MissingKernel {
        name: format!("{family} for {:?}, d{}, g{kgroup}", a.dtype, a.head_dim),
    })?;
    let params = attention_params!(DecodeParams, a, b, {
        num_splits: to_u32("num_splits", num_splits)?,
        chunk_tokens: to_u32("chunk", chunk)?,
        auto_max_splits: to_u32("auto splits", auto_max_splits)?,
    });
    let Some(attn_grid) = grid(
        "decode grid",
        num_splits,
        a.n_kv_heads.saturating_mul(slices),
        b.batch,
    )?
    else {
        return Ok((chosen, DecodePlan::Empty));
    };
    let Some(merge_grid) = grid("decode merge grid", a.n_heads, b.batch, 1)? else {
        return Ok((chosen, DecodePlan::Empty));
    };
    let attn = Step {
        kernel,
        params,
        grid: attn_grid,
    };
    if num_splits == 1 {
        return Ok((chosen, DecodePlan::Whole(attn)));
    }
    let merge = Step {
        kernel: kernels::decode_merge(),
        params: MergeParams {
            batch: params.batch,
            n_heads: params.n_heads,
            head_dim: to_u32("head_dim", a.head_dim)?,
            num_splits: params.num_splits,
            ..Default::default()
        },
        grid: merge_grid,
    };
    Ok((
        chosen,
        DecodePlan::Split {
            attn,
            merge,
            workspace: Workspace {
                part_o: rows * num_splits,
                part_lse: b.batch * a.n_heads * num_splits,
            },
        },
    ))
}

/// What one prefill attention call launches.
#[derive(Debug)]
pub(crate) struct PrefillPlan {
    /// The kernel chosen (never [`PrefillKernel::Auto`]).
    pub chosen: PrefillKernel,
    /// `None` when the grid is empty (nothing to launch).
    pub step: Option<Step<PrefillParams>>,
    /// Whether q and out must be 8-byte aligned (the tensor-core kernel's
    /// float2 accesses); checked when their addresses are known.
    pub needs_aligned_rows: bool,
}

/// Plans causal prefill attention for `b` with buffers `q` and `out` of
/// `q_len` and `out_len` elements, on the kernel `choice` asks for.
pub(crate) fn prefill(
    a: &Attn,
    b: &Batch,
    q_len: usize,
    out_len: usize,
    choice: PrefillKernel,
) -> Result<PrefillPlan, CudaError> {
    let narrow = || {
        kernels::prefill_mma(a.dtype, a.head_dim)
            .filter(|_| a.group <= PMMA_BM)
            .map(|k| (PrefillKernel::TensorCore, k, PMMA_BM))
    };
    let wide = || {
        kernels::prefill_mma_wide(a.dtype, a.head_dim)
            .filter(|_| a.group <= PMMA_WIDE_BM)
            .map(|k| (PrefillKernel::TensorCoreWide, k, PMMA_WIDE_BM))
    };
    let refused = |what: &'static str, most: usize| CudaError::Unsupported {
        what,
        detail: format!(
            "{:?} KV, head_dim {}, {} query heads per KV head (compiled: f16/bf16/FP8, \
             head_dim {PREFILL_MMA_HEAD_DIMS:?}, at most {most})",
            a.dtype, a.head_dim, a.group
        ),
    };
    let mma = match choice {
        PrefillKernel::Scalar => None,
        PrefillKernel::Auto => narrow(),
        PrefillKernel::TensorCore => {
            Some(narrow().ok_or_else(|| refused("tensor-core prefill", PMMA_BM))?)
        }
        PrefillKernel::TensorCoreWide => {
            Some(wide().ok_or_else(|| refused("wide tensor-core prefill", PMMA_WIDE_BM))?)
        }
    };
    if mma.is_none() && a.group > PREFILL_MAX_GROUP {
        return Err(CudaError::Unsupported {
            what: "query heads per KV head in prefill",
            detail: format!("{} (at most {PREFILL_MAX_GROUP})", a.group),
        });
    }
    let rows = b.total_q * a.n_heads * a.head_dim;
    shape("prefill q elements", rows, q_len)?;
    shape("prefill out elements", rows, out_len)?;
    let (chosen, kernel, block_rows) = match mma {
        Some((chosen, k, rows)) => (chosen, Some(k), rows),
        None => (
            PrefillKernel::Scalar,
            kernels::prefill_attention(a.dtype, a.head_dim),
            PREFILL_ROWS,
        ),
    };
    let rows_per_tile = block_rows / a.group;
    let q_tiles = b.max_q_len.div_ceil(rows_per_tile.max(1));
    let Some(grid) = grid("prefill grid", q_tiles, a.n_kv_heads, b.batch)? else {
        return Ok(PrefillPlan {
            chosen,
            step: None,
            needs_aligned_rows: false,
        });
    };
    let kernel = kernel.ok_or_else(|| CudaError::MissingKernel {
        name: format!("prefill_attention for {:?}, d{}", a.dtype, a.head_dim),
    })?;
    let params = attention_params!(PrefillParams, a, b, {});
    Ok(PrefillPlan {
        chosen,
        step: Some(Step {
            kernel,
            params,
            grid,
        }),
        needs_aligned_rows: chosen != PrefillKernel::Scalar,
    })
}
