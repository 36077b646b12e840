//! Kernel parameter structs, field for field the ones in `cuda/params.cuh`
//! (read that file for the shapes behind each pointer). Both are described
//! once in the kernel table (`table.rs`); build.rs generates from it the
//! checks of every field's offset and type and every struct's size, the
//! C++ side's `static_assert`s and this side's const asserts (included at
//! the end of this file).
//!
//! Pointers are device addresses (`CUdeviceptr`). Only `launch.rs` fills
//! them in, from buffers whose sizes it has checked.

use cudarc::driver::DeviceRepr;

/// Paged decode attention. See `DecodeParams` in params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::NoUninit)]
pub(crate) struct DecodeParams {
    pub q: u64,           // [batch, n_heads, head_dim] f32
    pub kv: u64,          // KV arena
    pub page_table: u64,  // [page_indptr[batch]] u32
    pub page_indptr: u64, // [batch + 1] u32
    pub kv_len: u64,      // [batch] u32
    pub out: u64,         // [batch, n_heads, head_dim] f32
    pub part_o: u64,      // [batch, n_heads, num_splits, head_dim] f32
    pub part_lse: u64,    // [batch, n_heads, num_splits] f32
    pub page_stride: u64,
    pub batch: u32,
    pub n_heads: u32,
    pub n_kv_heads: u32,
    pub group: u32,
    pub layer: u32,
    pub page_size_log2: u32,
    pub num_splits: u32,
    pub chunk_tokens: u32,
    pub sm_scale_log2: f32,
    pub auto_max_splits: u32,
}

/// Merge of split-KV partial outputs. See `MergeParams` in params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::NoUninit)]
pub(crate) struct MergeParams {
    pub part_o: u64,   // [batch, n_heads, num_splits, head_dim] f32
    pub part_lse: u64, // [batch, n_heads, num_splits] f32
    pub out: u64,      // [batch, n_heads, head_dim] f32
    pub batch: u32,
    pub n_heads: u32,
    pub head_dim: u32,
    pub num_splits: u32,
}

/// Paged causal prefill attention, both kernels of the family (scalar and
/// tensor-core). See `PrefillParams` in params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::NoUninit)]
pub(crate) struct PrefillParams {
    pub q: u64,           // [total_q, n_heads, head_dim] f32
    pub kv: u64,          // KV arena
    pub page_table: u64,  // [page_indptr[batch]] u32
    pub page_indptr: u64, // [batch + 1] u32
    pub q_indptr: u64,    // [batch + 1] u32
    pub kv_len: u64,      // [batch] u32
    pub out: u64,         // [total_q, n_heads, head_dim] f32
    pub page_stride: u64,
    pub batch: u32,
    pub n_heads: u32,
    pub n_kv_heads: u32,
    pub group: u32,
    pub layer: u32,
    pub page_size_log2: u32,
    pub sm_scale_log2: f32,
    pub pad0: u32,
}

/// KV append into page slots. See `KvAppendParams` in params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::NoUninit)]
pub(crate) struct KvAppendParams {
    pub k: u64,        // [n_tokens, kv_dim] f32
    pub v: u64,        // [n_tokens, kv_dim] f32
    pub dst_page: u64, // [n_tokens] u32
    pub dst_slot: u64, // [n_tokens] u32
    pub kv: u64,       // KV arena
    pub page_stride: u64,
    pub n_tokens: u32,
    pub kv_dim: u32,
    pub layer: u32,
    pub page_size_log2: u32,
}

/// Whole-page fill. See `ScrubParams` in params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::NoUninit)]
pub(crate) struct ScrubParams {
    pub kv: u64,    // KV arena as 16-byte words
    pub pages: u64, // [n_pages] u32
    pub page_vec16: u64,
    pub n_pages: u32,
    pub fill: u32,
}

/// RMSNorm. See `RmsNormParams` in params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::NoUninit)]
pub(crate) struct RmsNormParams {
    pub x: u64,   // [n_rows, dim] f32
    pub w: u64,   // [dim] f32
    pub out: u64, // [n_rows, dim] f32
    pub n_rows: u32,
    pub dim: u32,
    pub eps: f32,
    pub pad0: u32,
}

/// Rotary embedding in place. See `RopeParams` in params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::NoUninit)]
pub(crate) struct RopeParams {
    pub x: u64,         // [n_tokens, n_heads, head_dim] f32
    pub positions: u64, // [n_tokens] u32
    pub theta: f64,
    pub n_tokens: u32,
    pub n_heads: u32,
    pub head_dim: u32,
    pub style: u32,
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position: f64,
    pub scaling: u32,
    pub n_heads2: u32, // heads of x2 (0: no x2)
    pub x2: u64,       // [n_tokens, n_heads2, head_dim] f32
    // The append of x2 (k) and v (kv != 0).
    pub v: u64,        // [n_tokens, kv_dim] f32
    pub dst_page: u64, // [n_tokens] u32
    pub dst_slot: u64, // [n_tokens] u32
    pub kv: u64,       // KV arena (0: no append)
    pub page_stride: u64,
    pub kv_dim: u32,
    pub layer: u32,
    pub page_size_log2: u32,
    pub pad0: u32,
}

/// SwiGLU. See `SwigluParams` in params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::NoUninit)]
pub(crate) struct SwigluParams {
    pub gate: u64, // [n] f32
    pub up: u64,   // [n] f32
    pub out: u64,  // [n] f32
    pub n: u64,
}

/// Embedding gather. See `EmbeddingParams` in params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::NoUninit)]
pub(crate) struct EmbeddingParams {
    pub table: u64,  // [vocab, dim] f32 or bf16
    pub tokens: u64, // [n_tokens] u32
    pub out: u64,    // [n_tokens, dim] f32
    pub n_tokens: u32,
    pub dim: u32,
    pub vocab: u32,
    pub pad0: u32,
}

/// Greedy argmax. See `ArgmaxParams` in params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::NoUninit)]
pub(crate) struct ArgmaxParams {
    pub logits: u64,    // [n_rows, vocab] f32
    pub out_index: u64, // [n_rows] u32
    pub out_nans: u64,  // [n_rows] u32
    pub n_rows: u32,
    pub vocab: u32,
}

/// One row's draw. See `SampleDraw` in params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::NoUninit)]
pub(crate) struct SampleDraw {
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    /// 0: no log-probabilities; 1 + n: the token's and the n most likely.
    pub logprobs: u32,
    pub random: u64,
}

/// `x · wᵀ` with bf16 weights on tensor cores. See `LinearMmaParams` in
/// params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::NoUninit)]
pub(crate) struct LinearMmaParams {
    pub x: u64,   // [m, k] f32
    pub w: u64,   // [n, k] bf16
    pub out: u64, // [m, n] f32
    /// [k] f32, or 0: x is RMSNorm(x) * norm_w, row by row (decode and
    /// wide tiles only).
    pub norm_w: u64,
    /// [n, k] bf16, or 0: out = SwiGLU(x · wᵀ, x · w_upᵀ) (decode and wide
    /// tiles only).
    pub w_up: u64,
    pub m: u32,
    pub n: u32,
    pub k: u32,
    pub accumulate: u32, // 0 or 1: out += x · wᵀ
    pub norm_eps: f32,
    pub pad0: u32,
}

/// Up to three products of one `x` in one launch. See
/// `LinearMmaGroupParams` in params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::NoUninit)]
pub(crate) struct LinearMmaGroupParams {
    pub x: u64,    // [m, k] f32
    pub w0: u64,   // [n0, k] bf16
    pub w1: u64,   // [n1, k] bf16
    pub w2: u64,   // [n2, k] bf16
    pub out0: u64, // [m, n0] f32
    pub out1: u64, // [m, n1] f32
    pub out2: u64, // [m, n2] f32
    pub m: u32,
    pub k: u32,
    pub n0: u32,
    pub n1: u32,
    pub n2: u32,
    pub blocks0: u32,
    pub blocks1: u32,
    pub n_groups: u32,
    /// [k] f32, or 0: x is RMSNorm(x) * norm_w (decode tile only).
    pub norm_w: u64,
    pub norm_eps: f32,
    pub pad0: u32,
}

/// Device sampling. See `SampleParams` in params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::NoUninit)]
pub(crate) struct SampleParams {
    pub logits: u64, // [n_rows, vocab] f32
    pub draws: u64,  // [n_rows] SampleDraw
    pub out: u64,    // [2, n_rows] u32: tokens, then statuses
    pub n_rows: u32,
    pub vocab: u32,
}

/// Device log-probabilities. See `LogprobParams` in params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::NoUninit)]
pub(crate) struct LogprobParams {
    pub logits: u64, // [n_rows, vocab] f32
    pub draws: u64,  // [n_rows] SampleDraw
    pub out: u64,    // [2, n_rows] u32 tokens, statuses; then [n_rows, LOGPROB_STRIDE] u32
    pub n_rows: u32,
    pub vocab: u32,
}

/// Dense `x · wᵀ`. See `LinearParams` in params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::NoUninit)]
pub(crate) struct LinearParams {
    pub x: u64,   // [m, k] f32
    pub w: u64,   // [n, k] f32
    pub out: u64, // [m, n] f32
    pub m: u32,
    pub n: u32,
    pub k: u32,
    pub accumulate: u32, // 0 or 1: out += x · wᵀ
}

/// Formats of the ggml-block matmul's weights (`QFMT_*` in params.cuh).
pub(crate) const QFMT_Q8_0: u32 = 0;
pub(crate) const QFMT_Q4_0: u32 = 1;
pub(crate) const QFMT_Q4_1: u32 = 2;
pub(crate) const QFMT_Q4_K: u32 = 3;
pub(crate) const QFMT_Q5_K: u32 = 4;
pub(crate) const QFMT_Q6_K: u32 = 5;
pub(crate) const QFMT_Q5_0: u32 = 6;
pub(crate) const QFMT_Q5_1: u32 = 7;

/// Dense `x · wᵀ` with weights in ggml blocks. See `LinearQParams` in
/// params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::NoUninit)]
pub(crate) struct LinearQParams {
    pub x: u64,   // [m, k] f32
    pub w: u64,   // [n, k / block values] blocks of `format`
    pub out: u64, // [m, n] f32
    pub m: u32,
    pub n: u32,
    pub k: u32,
    pub accumulate: u32, // 0 or 1: out += x · wᵀ
    pub format: u32,     // QFMT_*
    pub pad0: u32,
}

/// Embedding gather from a table in ggml blocks. See `EmbeddingQParams` in
/// params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::NoUninit)]
pub(crate) struct EmbeddingQParams {
    pub table: u64,  // [vocab, dim / block values] blocks of `format`
    pub tokens: u64, // [n_tokens] u32
    pub out: u64,    // [n_tokens, dim] f32
    pub n_tokens: u32,
    pub dim: u32,
    pub vocab: u32,
    pub format: u32, // QFMT_*
}

/// `x[i] += y[i % period]`. See `AddParams` in params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::NoUninit)]
pub(crate) struct AddParams {
    pub x: u64, // [n] f32
    pub y: u64, // [period] f32
    pub n: u64,
    pub period: u64,
}

/// xxh3-64 of byte ranges. See `HashRangesParams` in params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::NoUninit)]
pub(crate) struct HashRangesParams {
    pub data: u64,    // bytes
    pub offsets: u64, // [n] u64
    pub lens: u64,    // [n] u64
    pub out: u64,     // [n] u64
    pub n: u32,
    pub pad0: u32,
}

/// Per-page transfer checksums. See `PageChecksumParams` in params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::NoUninit)]
pub(crate) struct PageChecksumParams {
    pub kv: u64,             // KV arena bytes
    pub pages: u64,          // [n_pages] u32
    pub tokens: u64,         // [n_pages] u32
    pub region_hashes: u64,  // [n_pages, n_layers, 2] u64
    pub page_checksums: u64, // [n_pages] u64
    pub page_bytes: u64,
    pub n_pages: u32,
    pub n_layers: u32,
    pub page_size: u32,
    pub row_bytes: u32,
}

/// Parameter structs the kernels receive by value.
macro_rules! device_repr {
    ($($t:ty),* $(,)?) => {$(
        // SAFETY: #[repr(C)], made only of integers and floats, with every
        // field's offset and type and the size asserted below against the
        // table that the C++ struct in cuda/params.cuh is asserted against;
        // the kernel receives it by value.
        unsafe impl DeviceRepr for $t {}
    )*};
}

device_repr!(
    DecodeParams,
    MergeParams,
    PrefillParams,
    KvAppendParams,
    ScrubParams,
    RmsNormParams,
    RopeParams,
    SwigluParams,
    EmbeddingParams,
    ArgmaxParams,
    SampleDraw,
    SampleParams,
    LogprobParams,
    LinearParams,
    LinearQParams,
    EmbeddingQParams,
    LinearMmaParams,
    LinearMmaGroupParams,
    AddParams,
    HashRangesParams,
    PageChecksumParams,
);

include!(concat!(env!("OUT_DIR"), "/params_layout.rs"));

#[cfg(test)]
mod tests {
    //! The C++ half of the layout checks, run with the host compiler: the
    //! generated asserts accept cuda/params.cuh as it is, and refuse it
    //! with one field moved, one retyped, or one struct grown.
    use std::path::{Path, PathBuf};
    use std::process::Command;

    fn cxx() -> Option<PathBuf> {
        let paths = std::env::var_os("PATH")?;
        ["c++", "g++", "clang++"].iter().find_map(|c| {
            std::env::split_paths(&paths)
                .map(|d| d.join(c))
                .find(|p| p.is_file())
        })
    }

    /// Compiles the generated layout checks against `params_cuh`; the
    /// compiler's complaint when they fail.
    fn check_layout(cxx: &Path, params_cuh: &str) -> Result<(), String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let generated = include_str!(concat!(env!("OUT_DIR"), "/cuda-gen/params_layout.cuh"));
        std::fs::write(dir.path().join("params.cuh"), params_cuh).map_err(|e| e.to_string())?;
        let main = dir.path().join("main.cpp");
        std::fs::write(&main, format!("{generated}\nint main() {{ return 0; }}\n"))
            .map_err(|e| e.to_string())?;
        let out = Command::new(cxx)
            .args(["-std=c++17", "-fsyntax-only", "-I"])
            .arg(dir.path())
            .arg(&main)
            .output()
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    #[test]
    fn the_cxx_layout_checks_accept_params_cuh_and_refuse_any_drift() {
        let Some(cxx) = cxx() else {
            eprintln!(
                "SKIP the_cxx_layout_checks_accept_params_cuh_and_refuse_any_drift: no C++ compiler"
            );
            return;
        };
        let real = include_str!("../../../cuda/params.cuh");
        assert_eq!(check_layout(&cxx, real), Ok(()));

        let swapped = "    uint32_t n_heads;             // query heads\n    uint32_t batch;\n";
        let drifts = [
            // Two fields of DecodeParams swapped: same size, other offsets.
            (
                "    uint32_t batch;\n    uint32_t n_heads;             // query heads\n",
                swapped,
                "DecodeParams::batch: table.rs puts it at byte 72",
            ),
            // A u32 that became a float: same offset and size.
            (
                "    uint32_t n_rows;\n    uint32_t dim;\n    float eps;",
                "    uint32_t n_rows;\n    float dim;\n    float eps;",
                "RmsNormParams::dim: table.rs says U32",
            ),
            // A field added at the end of a struct.
            (
                "    uint32_t row_bytes;         // kv_dim * dtype size\n",
                "    uint32_t row_bytes;         // kv_dim * dtype size\n    uint64_t extra;\n",
                "PageChecksumParams: table.rs says 64 bytes",
            ),
        ];
        for (from, to, complaint) in drifts {
            assert_eq!(
                real.matches(from).count(),
                1,
                "{from:?} is in params.cuh once"
            );
            let drifted = real.replacen(from, to, 1);
            let err = check_layout(&cxx, &drifted).expect_err(complaint);
            assert!(err.contains(complaint), "{complaint}: {err}");
        }
    }
}
