//! Kernel parameter structs, field for field the ones in `cuda/params.cuh`
//! (read that file for the shapes behind each pointer). Both sides assert
//! the sizes; the C++ side with `static_assert`, this side below.
//!
//! Pointers are device addresses (`CUdeviceptr`). Only `launch.rs` fills
//! them in, from buffers whose sizes it has checked.

use std::mem::size_of;

/// Paged decode attention. See `DecodeParams` in params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
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
const _: () = assert!(size_of::<DecodeParams>() == 112);

/// Merge of split-KV partial outputs. See `MergeParams` in params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct MergeParams {
    pub part_o: u64,   // [batch, n_heads, num_splits, head_dim] f32
    pub part_lse: u64, // [batch, n_heads, num_splits] f32
    pub out: u64,      // [batch, n_heads, head_dim] f32
    pub batch: u32,
    pub n_heads: u32,
    pub head_dim: u32,
    pub num_splits: u32,
}
const _: () = assert!(size_of::<MergeParams>() == 40);

/// Paged causal prefill attention, both kernels of the family (scalar and
/// tensor-core). See `PrefillParams` in params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
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
const _: () = assert!(size_of::<PrefillParams>() == 96);

/// KV append into page slots. See `KvAppendParams` in params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
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
const _: () = assert!(size_of::<KvAppendParams>() == 64);

/// Whole-page fill. See `ScrubParams` in params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ScrubParams {
    pub kv: u64,    // KV arena as 16-byte words
    pub pages: u64, // [n_pages] u32
    pub page_vec16: u64,
    pub n_pages: u32,
    pub fill: u32,
}
const _: () = assert!(size_of::<ScrubParams>() == 32);

/// RMSNorm. See `RmsNormParams` in params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RmsNormParams {
    pub x: u64,   // [n_rows, dim] f32
    pub w: u64,   // [dim] f32
    pub out: u64, // [n_rows, dim] f32
    pub n_rows: u32,
    pub dim: u32,
    pub eps: f32,
    pub pad0: u32,
}
const _: () = assert!(size_of::<RmsNormParams>() == 40);

/// Rotary embedding in place. See `RopeParams` in params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
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
    pub pad0: u32,
}
const _: () = assert!(size_of::<RopeParams>() == 80);

/// SwiGLU. See `SwigluParams` in params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SwigluParams {
    pub gate: u64, // [n] f32
    pub up: u64,   // [n] f32
    pub out: u64,  // [n] f32
    pub n: u64,
}
const _: () = assert!(size_of::<SwigluParams>() == 32);

/// Embedding gather. See `EmbeddingParams` in params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct EmbeddingParams {
    pub table: u64,  // [vocab, dim] f32
    pub tokens: u64, // [n_tokens] u32
    pub out: u64,    // [n_tokens, dim] f32
    pub n_tokens: u32,
    pub dim: u32,
    pub vocab: u32,
    pub pad0: u32,
}
const _: () = assert!(size_of::<EmbeddingParams>() == 40);

/// Greedy argmax. See `ArgmaxParams` in params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ArgmaxParams {
    pub logits: u64,    // [n_rows, vocab] f32
    pub out_index: u64, // [n_rows] u32
    pub out_nans: u64,  // [n_rows] u32
    pub n_rows: u32,
    pub vocab: u32,
}
const _: () = assert!(size_of::<ArgmaxParams>() == 32);

/// Dense `x · wᵀ`. See `LinearParams` in params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct LinearParams {
    pub x: u64,   // [m, k] f32
    pub w: u64,   // [n, k] f32
    pub out: u64, // [m, n] f32
    pub m: u32,
    pub n: u32,
    pub k: u32,
    pub pad0: u32,
}
const _: () = assert!(size_of::<LinearParams>() == 40);

/// `x[i] += y[i % period]`. See `AddParams` in params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct AddParams {
    pub x: u64, // [n] f32
    pub y: u64, // [period] f32
    pub n: u64,
    pub period: u64,
}
const _: () = assert!(size_of::<AddParams>() == 32);

/// xxh3-64 of byte ranges. See `HashRangesParams` in params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct HashRangesParams {
    pub data: u64,    // bytes
    pub offsets: u64, // [n] u64
    pub lens: u64,    // [n] u64
    pub out: u64,     // [n] u64
    pub n: u32,
    pub pad0: u32,
}
const _: () = assert!(size_of::<HashRangesParams>() == 40);

/// Per-page transfer checksums. See `PageChecksumParams` in params.cuh.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
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
const _: () = assert!(size_of::<PageChecksumParams>() == 64);
