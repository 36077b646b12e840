//! The kernel table: the one description of every compiled kernel and of
//! every kernel parameter struct's layout.
//!
//! build.rs reads this file (`#[path]`) and generates from it:
//! - for each `cuda/<source>.cu`, `<source>_kernels.cuh`: the `extern "C"`
//!   entry points of its families, one per instantiation, plus
//!   `static_assert`s that the C++ constants the host mirrors (tile sizes,
//!   block sizes, dynamic shared memory) have the values below;
//! - `params_layout.cuh`: `static_assert`s of every field's offset and kind
//!   and every struct's size in `cuda/params.cuh`;
//! - `kernel_table.rs`: the Rust [`KernelId`](super::kernels::KernelId)
//!   enum, each kernel's symbol, block size, shared memory and error text,
//!   and one typed lookup per family (see `kernels.rs`);
//! - `params_structs.rs`: the Rust params structs themselves (included by
//!   `params.rs`), and `params_layout.rs`: `offset_of!`/`size_of` const
//!   asserts and field type checks of them.
//!
//! So adding an instantiation is one edit here; a params struct that drifts
//! from this description on either side fails the build.
//!
//! Split in three: the axes, tile sizes and description types (here), the
//! kernel families (`families.rs`) and the params structs (`params.rs`).
//! They must stay plain const data with no imports from outside this
//! folder: build.rs compiles them on its own.

mod families;
mod params;

pub use families::FAMILIES;
pub use params::PARAMS;

/// KV storage types, in the order kernels are listed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    F32,
    F16,
    BF16,
    F8E4M3,
}

impl Dtype {
    /// Suffix in kernel symbols.
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::BF16 => "bf16",
            Dtype::F8E4M3 => "fp8",
        }
    }
    /// C++ element type.
    pub const fn cxx(self) -> &'static str {
        match self {
            Dtype::F32 => "float",
            Dtype::F16 => "__half",
            Dtype::BF16 => "__nv_bfloat16",
            Dtype::F8E4M3 => "handoff::fp8_e4m3",
        }
    }
    /// The `KvDtype` variant (for generated Rust).
    pub const fn rust(self) -> &'static str {
        match self {
            Dtype::F32 => "F32",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::F8E4M3 => "F8E4M3",
        }
    }
}

/// The 16-bit weight types the tensor-core matmuls are compiled for (a
/// bf16 or f16 checkpoint's matrices stay as they were stored).
pub const HALF_WEIGHTS: [Dtype; 2] = [Dtype::F16, Dtype::BF16];

/// Head dimensions with compiled attention kernels.
pub const HEAD_DIMS: [usize; 6] = [8, 16, 32, 64, 128, 256];
/// Query heads per KV head that decode kernels are compiled for; a ratio in
/// between uses the next one up (the padding heads are computed, not written).
pub const DECODE_GROUPS: [usize; 4] = [1, 2, 4, 8];
/// Dims of a head each thread of the split-KV merge (128 threads) combines:
/// every compiled head_dim fits.
pub const MERGE_DIMS: usize = 2;
const _: () = assert!(HEAD_DIMS[HEAD_DIMS.len() - 1] <= 128 * MERGE_DIMS);
/// Head dimensions with a tensor-core prefill kernel (f16 and bf16 KV).
pub const PREFILL_MMA_HEAD_DIMS: [usize; 2] = [64, 128];
/// Head dimensions with a tensor-core decode kernel (f16 and bf16 KV).
pub const DECODE_MMA_HEAD_DIMS: [usize; 2] = [64, 128];
/// Query heads per KV head of the tensor-core decode kernel: one or two
/// octets of 8 (a ratio in between uses the next one up; a larger one runs
/// in head slices of 16).
pub const DECODE_MMA_GROUPS: [usize; 2] = [8, 16];

/// (position, head) rows per block of the scalar prefill kernel.
pub const PREFILL_ROWS: usize = 32;
/// Keys per K/V tile of the scalar prefill kernel.
pub const PREFILL_BK: usize = 32;
/// (position, head) rows per block of the tensor-core prefill kernel.
pub const PMMA_BM: usize = 64;
/// (position, head) rows per block of the wide tensor-core prefill kernel
/// (two m-tiles of 16 rows a warp).
pub const PMMA_WIDE_BM: usize = 128;
/// Keys per K/V tile of both tensor-core prefill kernels.
pub const PMMA_BN: usize = 64;
/// Warps per block of the tensor-core decode kernel.
pub const DMMA_WARPS: usize = 4;
/// Warps per block of the wide tensor-core decode kernel.
pub const DMMA_WIDE_WARPS: usize = 8;
/// KV positions per warp tile of the tensor-core decode kernel.
pub const DMMA_TILE: usize = 16;
/// Tiles in flight per warp (its cp.async pipeline's stages).
pub const DMMA_STAGES: usize = 3;
/// Warps per block of the f32 matmul (they split k).
pub const LIN_WARPS: usize = 8;
/// Output columns per block of the f32 matmul.
pub const LIN_COLS: usize = 4;
/// Rows of x per block of the f32 matmul at batch 1. Its three shapes
/// (one row, up to 4, more) give every output the same bits.
pub const LIN_ROWS_ONE: usize = 1;
/// Rows of x per block of the f32 matmul for 2 to 4 rows.
pub const LIN_ROWS_FEW: usize = 4;
/// Rows of x per block of the f32 matmul from 5 rows on.
pub const LIN_ROWS_MANY: usize = 8;
/// Warps per block of the checksum kernels (one byte range each).
pub const CHECKSUM_WARPS: usize = 8;
/// Warps per block of the tensor-core matmul.
pub const LMMA_WARPS: usize = 8;
/// Rows of x per block of the tensor-core matmul.
pub const LMMA_BM: usize = 16;
/// Output columns per block of the tensor-core matmul.
pub const LMMA_BN: usize = 16;
/// Rows of x per block of the wide (m >= 32) tensor-core matmul.
pub const LMMA_WIDE_BM: usize = 32;
/// Output columns per block of the wide tensor-core matmul.
pub const LMMA_WIDE_BN: usize = 32;
/// Rows of x per block of the prefill tensor-core matmul (from this many
/// rows on, the host launches it).
pub const LGEMM_BM: usize = 128;
/// Output columns per block of the prefill tensor-core matmul.
pub const LGEMM_BN: usize = 64;
/// Products one grouped tensor-core matmul launch runs (q, k and v).
pub const LMMA_GROUPS: usize = 3;
/// Shared-memory stages of the prefill matmul's cp.async pipeline.
pub const LGEMM_STAGES: usize = 3;
/// Its dynamic shared memory: per stage, an x tile of LGEMM_BM rows of 32
/// f32 padded to 36, and a weight tile of LGEMM_BN rows of 32 bf16.
pub const LGEMM_SMEM: usize = LGEMM_STAGES * (LGEMM_BM * 36 * 4 + LGEMM_BN * 32 * 2);
/// Threads per block of RMSNorm (one row each), which is also the order in
/// which the tensor-core matmul sums a row's squares when it carries the
/// norm (cuda/pointwise.cuh).
pub const RMS_THREADS: u32 = 256;
const _: () = assert!(RMS_THREADS as usize == 32 * LMMA_WARPS);
/// The most rows of x whose RMSNorm the backend has ride in the matmul's
/// loads (the launch allows the whole decode tile): each block re-reads its
/// rows to sum their squares, as much L2 traffic again as the tile's own
/// reads of x, which at batch 1 is a few percent of the weights' bytes and
/// at 16 rows about as much as they are.
pub const NORM_CARRY_ROWS: usize = 4;
/// Threads per block of device sampling (one row each).
pub const SAMPLE_THREADS: u32 = 256;
/// u32 words per row of device log-probabilities: the token's, then 20
/// (id, value) pairs (src/sampling: `MAX_TOP_LOGPROBS`).
pub const LOGPROB_STRIDE: usize = 41;

/// Dynamic shared memory of an instantiation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Smem {
    None,
    /// A Q tile of `q_rows` rows and K and V tiles of `kv_rows` rows each,
    /// every row `head_dim + pad` elements of `elem_bytes`; the C++ side
    /// computes it as `handoff::<cfg><HEAD_DIM>::SMEM_BYTES`.
    Tiles {
        cfg: &'static str,
        q_rows: usize,
        kv_rows: usize,
        pad: usize,
        elem_bytes: usize,
    },
    /// `bytes`, whatever the head dim; the C++ side computes it as
    /// `handoff::<cfg>::SMEM_BYTES`.
    Fixed {
        cfg: &'static str,
        bytes: usize,
    },
}

impl Smem {
    /// Bytes for `head_dim`.
    pub const fn bytes(self, head_dim: usize) -> usize {
        match self {
            Smem::None => 0,
            Smem::Tiles {
                q_rows,
                kv_rows,
                pad,
                elem_bytes,
                ..
            } => (q_rows + 2 * kv_rows) * (head_dim + pad) * elem_bytes,
            Smem::Fixed { bytes, .. } => bytes,
        }
    }
}

/// One kernel family: a C++ function in `namespace handoff` instantiated
/// over the listed axes (an empty axis is not a template parameter). Its
/// instantiations are named `<name>[_<dtype>][_d<head_dim>][_g<group>]` and
/// call `handoff::<body><dtype, head_dim, group>(p)` with the template
/// arguments its axes give.
#[derive(Clone, Copy, Debug)]
pub struct Family {
    pub name: &'static str,
    /// `cuda/<source>.cu`, which includes `<source>_kernels.cuh`.
    pub source: &'static str,
    /// Its parameter struct, in params.cuh and params.rs.
    pub params: &'static str,
    pub body: &'static str,
    pub dtypes: &'static [Dtype],
    pub head_dims: &'static [usize],
    pub groups: &'static [usize],
    /// Threads per block (1-D) of every launch.
    pub threads: u32,
    /// Whether the kernel is declared `__launch_bounds__(threads)`.
    pub bounded: bool,
    /// With `bounded`, the blocks per SM the compiler must leave room for
    /// (its registers capped to fit them); 0 for no such bound.
    pub min_blocks: u32,
    pub smem: Smem,
    /// C++ constants of `namespace handoff` the host relies on, with the
    /// values it assumes (checked by `static_assert`).
    pub mirrors: &'static [(&'static str, usize)],
    /// What a failed launch was doing, for `CudaError::Driver`.
    pub during: &'static str,
}

impl Family {
    const fn plain(
        name: &'static str,
        source: &'static str,
        params: &'static str,
        threads: u32,
        bounded: bool,
        during: &'static str,
    ) -> Family {
        Family {
            name,
            source,
            params,
            body: name,
            dtypes: &[],
            head_dims: &[],
            groups: &[],
            threads,
            bounded,
            min_blocks: 0,
            smem: Smem::None,
            mirrors: &[],
            during,
        }
    }
}

/// A parameter struct field's kind: its Rust type, and what the C++ field
/// must be (`Ptr`: any pointer, a `u64` device address on the Rust side).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Field {
    Ptr,
    U64,
    U32,
    F32,
    F64,
}

impl Field {
    /// Size and alignment in bytes (the C ABI of both sides on 64-bit targets).
    pub const fn size(self) -> usize {
        match self {
            Field::Ptr | Field::U64 | Field::F64 => 8,
            Field::U32 | Field::F32 => 4,
        }
    }
}

/// One parameter struct: its fields in declaration order.
#[derive(Clone, Copy, Debug)]
pub struct Params {
    pub name: &'static str,
    /// What it is for (the generated Rust struct's doc; params.cuh says
    /// what each field holds).
    pub doc: &'static str,
    pub fields: &'static [(&'static str, Field)],
}

/// Each field's offset and the struct's size under C layout rules (every
/// field aligned to its size, the size rounded up to the largest).
pub fn layout(p: &Params) -> (Vec<usize>, usize) {
    let mut offsets = Vec::with_capacity(p.fields.len());
    let (mut at, mut align) = (0usize, 1usize);
    for &(_, f) in p.fields {
        at = at.next_multiple_of(f.size());
        offsets.push(at);
        at += f.size();
        align = align.max(f.size());
    }
    (offsets, at.next_multiple_of(align))
}
