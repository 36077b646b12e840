//! Every kernel family of the table (see `mod.rs`).

use super::*;

/// Every KV dtype: the scalar attention kernels and the appends.
const ALL_DTYPES: [Dtype; 4] = [Dtype::F32, Dtype::F16, Dtype::BF16, Dtype::F8E4M3];
/// The tensor-core attention kernels': the 16-bit ones, and FP8 (its tiles
/// widened to f16 in shared memory).
const MMA_KV_DTYPES: [Dtype; 3] = [Dtype::F16, Dtype::BF16, Dtype::F8E4M3];
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
