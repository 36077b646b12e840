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
//! - `params_layout.rs`: `offset_of!`/`size_of` const asserts and field type
//!   checks of every struct in `params.rs`.
//!
//! So adding an instantiation is one edit here; a params struct that drifts
//! from this description on either side fails the build.
//!
//! This file must stay plain const data with no imports: build.rs compiles
//! it on its own.

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

/// Every KV dtype: the scalar attention kernels and the appends.
const ALL_DTYPES: [Dtype; 4] = [Dtype::F32, Dtype::F16, Dtype::BF16, Dtype::F8E4M3];
/// The tensor-core attention kernels': the 16-bit ones, and FP8 (its tiles
/// widened to f16 in shared memory).
const MMA_KV_DTYPES: [Dtype; 3] = [Dtype::F16, Dtype::BF16, Dtype::F8E4M3];

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

/// Every compiled kernel.
pub const FAMILIES: &[Family] = &[
    Family {
        body: "decode_merge_impl",
        mirrors: &[("MERGE_THREADS", 128), ("MERGE_DIMS", MERGE_DIMS)],
        ..Family::plain(
            "decode_merge",
            "decode_attention",
            "MergeParams",
            128,
            true,
            "launching the decode merge",
        )
    },
    Family {
        dtypes: &ALL_DTYPES,
        head_dims: &HEAD_DIMS,
        groups: &DECODE_GROUPS,
        mirrors: &[("DECODE_THREADS", 128)],
        ..Family::plain(
            "decode_attention",
            "decode_attention",
            "DecodeParams",
            128,
            true,
            "launching decode attention",
        )
    },
    Family {
        dtypes: &ALL_DTYPES,
        head_dims: &HEAD_DIMS,
        smem: Smem::Tiles {
            cfg: "PrefillCfg",
            q_rows: PREFILL_ROWS,
            kv_rows: PREFILL_BK,
            pad: 1,
            elem_bytes: 4,
        },
        mirrors: &[
            ("PREFILL_THREADS", 128),
            ("PREFILL_ROWS", PREFILL_ROWS),
            ("PREFILL_BK", PREFILL_BK),
        ],
        ..Family::plain(
            "prefill_attention",
            "prefill_attention",
            "PrefillParams",
            128,
            true,
            "launching prefill attention",
        )
    },
    Family {
        dtypes: &MMA_KV_DTYPES,
        head_dims: &PREFILL_MMA_HEAD_DIMS,
        // A Q tile and two buffers of K and V tiles (double-buffered).
        smem: Smem::Tiles {
            cfg: "PmmaCfg",
            q_rows: PMMA_BM,
            kv_rows: 2 * PMMA_BN,
            pad: 8,
            elem_bytes: 2,
        },
        mirrors: &[
            ("PMMA_THREADS", 128),
            ("PMMA_BM", PMMA_BM),
            ("PMMA_BN", PMMA_BN),
        ],
        ..Family::plain(
            "prefill_mma",
            "prefill_mma",
            "PrefillParams",
            128,
            true,
            "launching tensor-core prefill attention",
        )
    },
    Family {
        dtypes: &MMA_KV_DTYPES,
        head_dims: &PREFILL_MMA_HEAD_DIMS,
        // As prefill_mma, with a Q tile of twice the rows.
        smem: Smem::Tiles {
            cfg: "PmmaWideCfg",
            q_rows: PMMA_WIDE_BM,
            kv_rows: 2 * PMMA_BN,
            pad: 8,
            elem_bytes: 2,
        },
        mirrors: &[("PMMA_WIDE_BM", PMMA_WIDE_BM)],
        ..Family::plain(
            "prefill_mma_wide",
            "prefill_mma",
            "PrefillParams",
            128,
            true,
            "launching tensor-core prefill attention (wide)",
        )
    },
    Family {
        dtypes: &MMA_KV_DTYPES,
        head_dims: &DECODE_MMA_HEAD_DIMS,
        groups: &DECODE_MMA_GROUPS,
        // Every warp's stages of K and V tiles: no Q tile, no padding (the
        // rows are swizzled instead).
        smem: Smem::Tiles {
            cfg: "DmmaCfg",
            q_rows: 0,
            kv_rows: DMMA_WARPS * DMMA_STAGES * DMMA_TILE,
            pad: 0,
            elem_bytes: 2,
        },
        mirrors: &[
            ("DMMA_THREADS", 32 * DMMA_WARPS),
            ("DMMA_TILE", DMMA_TILE),
            ("DMMA_STAGES", DMMA_STAGES),
        ],
        ..Family::plain(
            "decode_mma",
            "decode_mma",
            "DecodeParams",
            32 * DMMA_WARPS as u32,
            true,
            "launching tensor-core decode attention",
        )
    },
    Family {
        dtypes: &MMA_KV_DTYPES,
        head_dims: &DECODE_MMA_HEAD_DIMS,
        groups: &DECODE_MMA_GROUPS,
        // As decode_mma, for twice the warps.
        smem: Smem::Tiles {
            cfg: "DmmaWideCfg",
            q_rows: 0,
            kv_rows: DMMA_WIDE_WARPS * DMMA_STAGES * DMMA_TILE,
            pad: 0,
            elem_bytes: 2,
        },
        mirrors: &[("DMMA_WIDE_THREADS", 32 * DMMA_WIDE_WARPS)],
        ..Family::plain(
            "decode_mma_wide",
            "decode_mma",
            "DecodeParams",
            32 * DMMA_WIDE_WARPS as u32,
            true,
            "launching tensor-core decode attention (wide)",
        )
    },
    Family {
        dtypes: &ALL_DTYPES,
        ..Family::plain(
            "kv_append",
            "elementwise",
            "KvAppendParams",
            256,
            false,
            "launching the KV append",
        )
    },
    Family::plain(
        "scrub_pages",
        "elementwise",
        "ScrubParams",
        256,
        true,
        "launching the page scrub",
    ),
    Family {
        mirrors: &[("RMS_THREADS", RMS_THREADS as usize)],
        ..Family::plain(
            "rms_norm",
            "elementwise",
            "RmsNormParams",
            RMS_THREADS,
            true,
            "launching RMSNorm",
        )
    },
    Family {
        // One per KV dtype for the append; RoPE alone runs the f32 one.
        dtypes: &ALL_DTYPES,
        ..Family::plain(
            "rope",
            "elementwise",
            "RopeParams",
            256,
            false,
            "launching RoPE",
        )
    },
    Family::plain(
        "swiglu",
        "elementwise",
        "SwigluParams",
        256,
        false,
        "launching SwiGLU",
    ),
    Family {
        dtypes: &[Dtype::F32, Dtype::F16, Dtype::BF16],
        ..Family::plain(
            "embedding",
            "elementwise",
            "EmbeddingParams",
            256,
            false,
            "launching the embedding gather",
        )
    },
    Family::plain(
        "argmax",
        "elementwise",
        "ArgmaxParams",
        256,
        true,
        "launching argmax",
    ),
    Family {
        mirrors: &[("SAMPLE_THREADS", SAMPLE_THREADS as usize)],
        ..Family::plain(
            "sample_rows",
            "sampling",
            "SampleParams",
            SAMPLE_THREADS,
            true,
            "launching device sampling",
        )
    },
    Family {
        mirrors: &[("LOGPROB_STRIDE", LOGPROB_STRIDE)],
        ..Family::plain(
            "row_logprobs",
            "sampling",
            "LogprobParams",
            SAMPLE_THREADS,
            true,
            "launching device log-probabilities",
        )
    },
    Family {
        body: "linear_one",
        mirrors: &[
            ("LIN_WARPS", LIN_WARPS),
            ("LIN_COLS", LIN_COLS),
            ("LIN_ROWS_ONE", LIN_ROWS_ONE),
        ],
        ..Family::plain(
            "linear",
            "linear",
            "LinearParams",
            32 * LIN_WARPS as u32,
            true,
            "launching matmul",
        )
    },
    Family {
        mirrors: &[("LIN_ROWS_FEW", LIN_ROWS_FEW)],
        ..Family::plain(
            "linear_few",
            "linear",
            "LinearParams",
            32 * LIN_WARPS as u32,
            true,
            "launching matmul (a few rows)",
        )
    },
    Family {
        mirrors: &[("LIN_ROWS_MANY", LIN_ROWS_MANY)],
        ..Family::plain(
            "linear_many",
            "linear",
            "LinearParams",
            32 * LIN_WARPS as u32,
            true,
            "launching matmul (many rows)",
        )
    },
    Family {
        body: "linear_q_one",
        ..Family::plain(
            "linear_q",
            "linear",
            "LinearQParams",
            32 * LIN_WARPS as u32,
            true,
            "launching matmul (ggml-block weights)",
        )
    },
    Family {
        body: "linear_q_few",
        ..Family::plain(
            "linear_q_few",
            "linear",
            "LinearQParams",
            32 * LIN_WARPS as u32,
            true,
            "launching matmul (ggml-block weights, a few rows)",
        )
    },
    Family {
        body: "linear_q_many",
        ..Family::plain(
            "linear_q_many",
            "linear",
            "LinearQParams",
            32 * LIN_WARPS as u32,
            true,
            "launching matmul (ggml-block weights, many rows)",
        )
    },
    Family::plain(
        "embedding_q",
        "linear",
        "EmbeddingQParams",
        256,
        false,
        "launching the embedding gather (ggml-block table)",
    ),
    Family {
        dtypes: &HALF_WEIGHTS,
        body: "linear_mma_body",
        mirrors: &[
            ("LMMA_THREADS", 32 * LMMA_WARPS),
            ("LMMA_BM", LMMA_BM),
            ("LMMA_BN", LMMA_BN),
        ],
        ..Family::plain(
            "linear_mma",
            "linear",
            "LinearMmaParams",
            32 * LMMA_WARPS as u32,
            true,
            "launching the tensor-core matmul",
        )
    },
    Family {
        dtypes: &HALF_WEIGHTS,
        body: "linear_mma_wide_body",
        mirrors: &[
            ("LMMA_THREADS", 32 * LMMA_WARPS),
            ("LMMA_WIDE_BM", LMMA_WIDE_BM),
            ("LMMA_WIDE_BN", LMMA_WIDE_BN),
        ],
        ..Family::plain(
            "linear_mma_wide",
            "linear",
            "LinearMmaParams",
            32 * LMMA_WARPS as u32,
            true,
            "launching the wide tensor-core matmul",
        )
    },
    Family {
        // Two blocks an SM (67.5 KB of shared memory each), as the bf16
        // weights fit by themselves: the f16 weights' split would
        // otherwise take 133 registers and leave room for one.
        min_blocks: 2,
        dtypes: &HALF_WEIGHTS,
        body: "linear_mma_gemm_body",
        smem: Smem::Fixed {
            cfg: "LgemmCfg",
            bytes: LGEMM_SMEM,
        },
        mirrors: &[
            ("LMMA_THREADS", 32 * LMMA_WARPS),
            ("LGEMM_BM", LGEMM_BM),
            ("LGEMM_BN", LGEMM_BN),
            ("LGEMM_STAGES", LGEMM_STAGES),
        ],
        ..Family::plain(
            "linear_mma_gemm",
            "linear",
            "LinearMmaParams",
            32 * LMMA_WARPS as u32,
            true,
            "launching the prefill tensor-core matmul",
        )
    },
    Family {
        dtypes: &HALF_WEIGHTS,
        body: "linear_mma_group_body",
        ..Family::plain(
            "linear_mma_group",
            "linear",
            "LinearMmaGroupParams",
            32 * LMMA_WARPS as u32,
            true,
            "launching grouped tensor-core matmuls",
        )
    },
    Family {
        dtypes: &HALF_WEIGHTS,
        body: "linear_mma_wide_group_body",
        ..Family::plain(
            "linear_mma_wide_group",
            "linear",
            "LinearMmaGroupParams",
            32 * LMMA_WARPS as u32,
            true,
            "launching grouped wide tensor-core matmuls",
        )
    },
    Family {
        // Two blocks an SM (67.5 KB of shared memory each), as the bf16
        // weights fit by themselves: the f16 weights' split would
        // otherwise take 133 registers and leave room for one.
        min_blocks: 2,
        dtypes: &HALF_WEIGHTS,
        body: "linear_mma_gemm_group_body",
        smem: Smem::Fixed {
            cfg: "LgemmCfg",
            bytes: LGEMM_SMEM,
        },
        ..Family::plain(
            "linear_mma_gemm_group",
            "linear",
            "LinearMmaGroupParams",
            32 * LMMA_WARPS as u32,
            true,
            "launching grouped prefill tensor-core matmuls",
        )
    },
    Family::plain(
        "add_periodic",
        "linear",
        "AddParams",
        256,
        false,
        "launching an add",
    ),
    Family {
        body: "xxh3_ranges_body",
        mirrors: &[("CHECKSUM_WARPS", CHECKSUM_WARPS)],
        ..Family::plain(
            "xxh3_ranges",
            "checksum",
            "HashRangesParams",
            32 * CHECKSUM_WARPS as u32,
            true,
            "launching xxh3 over ranges",
        )
    },
    Family {
        body: "page_checksums_body",
        ..Family::plain(
            "page_checksums",
            "checksum",
            "PageChecksumParams",
            32 * CHECKSUM_WARPS as u32,
            true,
            "launching page checksums",
        )
    },
];

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
    pub fields: &'static [(&'static str, Field)],
}

use Field::{F32, F64, Ptr, U32, U64};

/// Every kernel parameter struct, field for field as in params.cuh and
/// params.rs (read params.cuh for what each field means).
pub const PARAMS: &[Params] = &[
    Params {
        name: "DecodeParams",
        fields: &[
            ("q", Ptr),
            ("kv", Ptr),
            ("page_table", Ptr),
            ("page_indptr", Ptr),
            ("kv_len", Ptr),
            ("out", Ptr),
            ("part_o", Ptr),
            ("part_lse", Ptr),
            ("page_stride", U64),
            ("batch", U32),
            ("n_heads", U32),
            ("n_kv_heads", U32),
            ("group", U32),
            ("layer", U32),
            ("page_size_log2", U32),
            ("num_splits", U32),
            ("chunk_tokens", U32),
            ("sm_scale_log2", F32),
            ("auto_max_splits", U32),
        ],
    },
    Params {
        name: "MergeParams",
        fields: &[
            ("part_o", Ptr),
            ("part_lse", Ptr),
            ("out", Ptr),
            ("batch", U32),
            ("n_heads", U32),
            ("head_dim", U32),
            ("num_splits", U32),
        ],
    },
    Params {
        name: "PrefillParams",
        fields: &[
            ("q", Ptr),
            ("kv", Ptr),
            ("page_table", Ptr),
            ("page_indptr", Ptr),
            ("q_indptr", Ptr),
            ("kv_len", Ptr),
            ("out", Ptr),
            ("page_stride", U64),
            ("batch", U32),
            ("n_heads", U32),
            ("n_kv_heads", U32),
            ("group", U32),
            ("layer", U32),
            ("page_size_log2", U32),
            ("sm_scale_log2", F32),
            ("pad0", U32),
        ],
    },
    Params {
        name: "KvAppendParams",
        fields: &[
            ("k", Ptr),
            ("v", Ptr),
            ("dst_page", Ptr),
            ("dst_slot", Ptr),
            ("kv", Ptr),
            ("page_stride", U64),
            ("n_tokens", U32),
            ("kv_dim", U32),
            ("layer", U32),
            ("page_size_log2", U32),
        ],
    },
    Params {
        name: "ScrubParams",
        fields: &[
            ("kv", Ptr),
            ("pages", Ptr),
            ("page_vec16", U64),
            ("n_pages", U32),
            ("fill", U32),
        ],
    },
    Params {
        name: "RmsNormParams",
        fields: &[
            ("x", Ptr),
            ("w", Ptr),
            ("out", Ptr),
            ("n_rows", U32),
            ("dim", U32),
            ("eps", F32),
            ("pad0", U32),
        ],
    },
    Params {
        name: "RopeParams",
        fields: &[
            ("x", Ptr),
            ("positions", Ptr),
            ("theta", F64),
            ("n_tokens", U32),
            ("n_heads", U32),
            ("head_dim", U32),
            ("style", U32),
            ("factor", F64),
            ("low_freq_factor", F64),
            ("high_freq_factor", F64),
            ("original_max_position", F64),
            ("scaling", U32),
            ("n_heads2", U32),
            ("x2", Ptr),
            ("v", Ptr),
            ("dst_page", Ptr),
            ("dst_slot", Ptr),
            ("kv", Ptr),
            ("page_stride", U64),
            ("kv_dim", U32),
            ("layer", U32),
            ("page_size_log2", U32),
            ("pad0", U32),
        ],
    },
    Params {
        name: "SwigluParams",
        fields: &[("gate", Ptr), ("up", Ptr), ("out", Ptr), ("n", U64)],
    },
    Params {
        name: "EmbeddingParams",
        fields: &[
            ("table", Ptr),
            ("tokens", Ptr),
            ("out", Ptr),
            ("n_tokens", U32),
            ("dim", U32),
            ("vocab", U32),
            ("pad0", U32),
        ],
    },
    Params {
        name: "ArgmaxParams",
        fields: &[
            ("logits", Ptr),
            ("out_index", Ptr),
            ("out_nans", Ptr),
            ("n_rows", U32),
            ("vocab", U32),
        ],
    },
    Params {
        name: "SampleDraw",
        fields: &[
            ("temperature", F32),
            ("top_k", U32),
            ("top_p", F32),
            ("logprobs", U32),
            ("random", U64),
        ],
    },
    Params {
        name: "SampleParams",
        fields: &[
            ("logits", Ptr),
            ("draws", Ptr),
            ("out", Ptr),
            ("n_rows", U32),
            ("vocab", U32),
        ],
    },
    Params {
        name: "LogprobParams",
        fields: &[
            ("logits", Ptr),
            ("draws", Ptr),
            ("out", Ptr),
            ("n_rows", U32),
            ("vocab", U32),
        ],
    },
    Params {
        name: "LinearParams",
        fields: &[
            ("x", Ptr),
            ("w", Ptr),
            ("out", Ptr),
            ("m", U32),
            ("n", U32),
            ("k", U32),
            ("accumulate", U32),
        ],
    },
    Params {
        name: "LinearQParams",
        fields: &[
            ("x", Ptr),
            ("w", Ptr),
            ("out", Ptr),
            ("m", U32),
            ("n", U32),
            ("k", U32),
            ("accumulate", U32),
            ("format", U32),
            ("pad0", U32),
        ],
    },
    Params {
        name: "EmbeddingQParams",
        fields: &[
            ("table", Ptr),
            ("tokens", Ptr),
            ("out", Ptr),
            ("n_tokens", U32),
            ("dim", U32),
            ("vocab", U32),
            ("format", U32),
        ],
    },
    Params {
        name: "LinearMmaParams",
        fields: &[
            ("x", Ptr),
            ("w", Ptr),
            ("out", Ptr),
            ("norm_w", Ptr),
            ("w_up", Ptr),
            ("m", U32),
            ("n", U32),
            ("k", U32),
            ("accumulate", U32),
            ("norm_eps", F32),
            ("pad0", U32),
        ],
    },
    Params {
        name: "LinearMmaGroupParams",
        fields: &[
            ("x", Ptr),
            ("w0", Ptr),
            ("w1", Ptr),
            ("w2", Ptr),
            ("out0", Ptr),
            ("out1", Ptr),
            ("out2", Ptr),
            ("m", U32),
            ("k", U32),
            ("n0", U32),
            ("n1", U32),
            ("n2", U32),
            ("blocks0", U32),
            ("blocks1", U32),
            ("n_groups", U32),
            ("norm_w", Ptr),
            ("norm_eps", F32),
            ("pad0", U32),
        ],
    },
    Params {
        name: "AddParams",
        fields: &[("x", Ptr), ("y", Ptr), ("n", U64), ("period", U64)],
    },
    Params {
        name: "HashRangesParams",
        fields: &[
            ("data", Ptr),
            ("offsets", Ptr),
            ("lens", Ptr),
            ("out", Ptr),
            ("n", U32),
            ("pad0", U32),
        ],
    },
    Params {
        name: "PageChecksumParams",
        fields: &[
            ("kv", Ptr),
            ("pages", Ptr),
            ("tokens", Ptr),
            ("region_hashes", Ptr),
            ("page_checksums", Ptr),
            ("page_bytes", U64),
            ("n_pages", U32),
            ("n_layers", U32),
            ("page_size", U32),
            ("row_bytes", U32),
        ],
    },
];

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
