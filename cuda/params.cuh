// Kernel parameter structs. Each one is mirrored, field for field, by a
// #[repr(C)] struct that build.rs generates (included by
// src/backend/cuda/params.rs) from the kernel table, where both are
// described once, field by field (src/backend/cuda/table/params.rs).
// build.rs also generates from that description static_asserts of every field's
// offset and kind and every struct's size on both sides (params_layout.cuh,
// included with each .cu's entry points, and params_layout.rs), so that a
// drifted field fails the build, not a launch.
//
// Conventions:
// - Pointers are device addresses. Every pointer's shape is commented.
// - The KV arena is the host arena's layout, page after page:
//     kv: [n_pages][n_layers][2 (k=0, v=1)][page_size][kv_dim]   (KV dtype)
//   with kv_dim = n_kv_heads * head_dim; the element of
//   (page, layer, k|v, slot, e) sits at
//     page * page_stride + ((layer * 2 + kv) * page_size + slot) * kv_dim + e
//   where page_stride = n_layers * 2 * page_size * kv_dim (elements).
// - Page tables are CSR: page_indptr[b]..page_indptr[b+1] index page_table,
//   which lists sequence b's pages in position order. Position t of
//   sequence b lives in page page_table[page_indptr[b] + (t >> page_size_log2)],
//   slot t & (page_size - 1). The host validates every page index against
//   the arena and every length against the pages given before a launch.
#pragma once
#include <stdint.h>

namespace handoff {

// Paged decode attention: one query token per sequence.
// grid (num_splits, n_kv_heads * ceil(group / GROUP), batch); block
// DECODE_THREADS (GROUP: the instantiation's; more than one head slice per KV
// head only past the largest compiled GROUP).
struct DecodeParams {
    const float* q;               // [batch, n_heads, head_dim] f32
    const void* kv;               // KV arena (see above), KV dtype
    const uint32_t* page_table;   // [page_indptr[batch]] page indices
    const uint32_t* page_indptr;  // [batch + 1]
    const uint32_t* kv_len;       // [batch] positions attended (>= 1)
    float* out;                   // [batch, n_heads, head_dim] f32 (num_splits == 1)
    float* part_o;                // [batch, n_heads, num_splits, head_dim] f32 (num_splits > 1)
    float* part_lse;              // [batch, n_heads, num_splits] f32, log2 domain (num_splits > 1)
    uint64_t page_stride;         // elements per page
    uint32_t batch;
    uint32_t n_heads;             // query heads
    uint32_t n_kv_heads;
    uint32_t group;               // n_heads / n_kv_heads, <= the kernel's GROUP
    uint32_t layer;
    uint32_t page_size_log2;
    uint32_t num_splits;          // KV chunks per sequence (grid.x), an upper bound
    uint32_t chunk_tokens;        // positions per chunk (the minimum when auto_max_splits > 0)
    float sm_scale_log2;          // log2(e) / sqrt(head_dim)
    // 0: every chunk is chunk_tokens. Otherwise each sequence's chunk comes
    // from its own length only, max(chunk_tokens, ceil(len / auto_max_splits)
    // rounded up to 64), so its result does not depend on its batch mates.
    uint32_t auto_max_splits;
};

// Second pass of split-KV decode: merges the chunks' partial outputs.
// grid (n_heads, batch); block 128.
struct MergeParams {
    const float* part_o;    // [batch, n_heads, num_splits, head_dim] f32
    const float* part_lse;  // [batch, n_heads, num_splits] f32, log2 domain
    float* out;             // [batch, n_heads, head_dim] f32
    uint32_t batch;
    uint32_t n_heads;
    uint32_t head_dim;
    uint32_t num_splits;
};

// Paged causal prefill attention: q_len new positions per sequence, whose KV
// is already appended, against all kv_len positions of the sequence. Query
// i (0-based within the sequence's new positions) is at absolute position
// kv_len - q_len + i and attends positions 0 ..= kv_len - q_len + i.
// One struct for the family: the scalar kernel (prefill_attention.cu, any
// KV dtype; group <= PREFILL_ROWS) and the tensor-core kernel
// (prefill_mma.cu, f16/bf16 KV; group <= 64; q and out 8-byte aligned).
// grid (q_tiles, n_kv_heads, batch); block PREFILL_THREADS or 128; dynamic
// smem.
struct PrefillParams {
    const float* q;               // [q_indptr[batch], n_heads, head_dim] f32
    const void* kv;               // KV arena, KV dtype
    const uint32_t* page_table;   // [page_indptr[batch]]
    const uint32_t* page_indptr;  // [batch + 1]
    const uint32_t* q_indptr;     // [batch + 1] first query row of each sequence
    const uint32_t* kv_len;       // [batch] positions in the sequence (>= its q_len)
    float* out;                   // [q_indptr[batch], n_heads, head_dim] f32
    uint64_t page_stride;
    uint32_t batch;
    uint32_t n_heads;
    uint32_t n_kv_heads;
    uint32_t group;               // n_heads / n_kv_heads (limit per kernel, above)
    uint32_t layer;
    uint32_t page_size_log2;
    float sm_scale_log2;
    uint32_t pad0;
};

// Writes new K/V rows into page slots (converting f32 to the KV dtype).
// grid-stride over n_tokens * kv_dim.
struct KvAppendParams {
    const float* k;             // [n_tokens, kv_dim] f32
    const float* v;             // [n_tokens, kv_dim] f32
    const uint32_t* dst_page;   // [n_tokens] arena page of each token
    const uint32_t* dst_slot;   // [n_tokens] slot within that page (< page_size)
    void* kv;                   // KV arena, KV dtype
    uint64_t page_stride;
    uint32_t n_tokens;
    uint32_t kv_dim;
    uint32_t layer;
    uint32_t page_size_log2;
};

// Overwrites whole pages with a 32-bit pattern (zero or the dtype's NaN).
// grid (n_pages); block 256.
struct ScrubParams {
    void* kv;                 // KV arena, viewed as uint4 [n_pages_arena, page_vec16]
    const uint32_t* pages;    // [n_pages] arena pages to fill
    uint64_t page_vec16;      // 16-byte words per page
    uint32_t n_pages;
    uint32_t fill;            // pattern, repeated over every 32-bit word
};

// out = x / sqrt(mean(x^2) + eps) * w, per row. grid (n_rows); block 256.
struct RmsNormParams {
    const float* x;   // [n_rows, dim] f32
    const float* w;   // [dim] f32
    float* out;       // [n_rows, dim] f32 (may equal x)
    uint32_t n_rows;
    uint32_t dim;
    float eps;
    uint32_t pad0;
};

// Rotary position embedding, in place. Pair i (0 <= i < head_dim/2) rotates
// by pos * theta^(-2i/head_dim); style 0 pairs (2i, 2i+1) (Meta/llama2.c),
// style 1 pairs (i, i + head_dim/2) (rotate-half, Hugging Face).
// grid-stride over n_tokens * n_heads * head_dim/2.
struct RopeParams {
    float* x;                   // [n_tokens, n_heads, head_dim] f32, in place
    const uint32_t* positions;  // [n_tokens] absolute position of each token
    double theta;
    uint32_t n_tokens;
    uint32_t n_heads;
    uint32_t head_dim;          // even
    uint32_t style;             // 0 interleaved, 1 rotate-half
    // Frequency scaling (model::RopeScaling); unused fields are 0.
    double factor;              // linear and llama3
    double low_freq_factor;     // llama3
    double high_freq_factor;    // llama3
    double original_max_position;  // llama3: pre-training context
    uint32_t scaling;           // 0 none, 1 linear, 2 llama3
    uint32_t n_heads2;          // heads of x2, rotated the same way (0: no x2)
    float* x2;                  // [n_tokens, n_heads2, head_dim] f32, in place (k beside q)
    // The append (kv set; null: none): x2 after its rotation (k) and v are
    // also stored, rounded to the KV dtype, in token t's slot dst_slot[t]
    // of page dst_page[t] of `layer`, as kv_append stores them.
    const float* v;             // [n_tokens, kv_dim] f32
    const uint32_t* dst_page;   // [n_tokens] arena page of each token
    const uint32_t* dst_slot;   // [n_tokens] slot within that page (< page_size)
    void* kv;                   // KV arena, KV dtype
    uint64_t page_stride;
    uint32_t kv_dim;            // n_heads2 * head_dim
    uint32_t layer;
    uint32_t page_size_log2;
    uint32_t pad0;
};

// out = silu(gate) * up, elementwise. grid-stride over n.
struct SwigluParams {
    const float* gate;  // [n] f32
    const float* up;    // [n] f32
    float* out;         // [n] f32
    uint64_t n;
};

// out[t] = table[tokens[t]]. grid-stride over n_tokens * dim.
struct EmbeddingParams {
    const void* table;        // [vocab, dim] f32 or bf16 (the instantiation's type)
    const uint32_t* tokens;   // [n_tokens] (< vocab; checked on the host)
    float* out;               // [n_tokens, dim] f32
    uint32_t n_tokens;
    uint32_t dim;
    uint32_t vocab;
    uint32_t pad0;
};

// Greedy argmax per row; the lowest index wins ties. NaNs never win; each
// row also reports how many it saw. grid (n_rows); block 256.
struct ArgmaxParams {
    const float* logits;  // [n_rows, vocab] f32
    uint32_t* out_index;  // [n_rows]
    uint32_t* out_nans;   // [n_rows] count of NaN logits in the row
    uint32_t n_rows;
    uint32_t vocab;
};

// One row's draw (src/sampling: Draw), made by the host from validated
// sampling parameters and the request stream's next value.
struct SampleDraw {
    float temperature;  // 0: greedy
    uint32_t top_k;     // 0: every token
    float top_p;        // 1: every token
    uint32_t logprobs;  // 0: none asked; 1 + n: the token's and the n most likely (n <= 20)
    uint64_t random;    // the request stream's next value (unused when greedy)
};

// One token per row by src/sampling/row.rs's rule (cuda/sampling.cuh).
// grid (n_rows); block SAMPLE_THREADS.
struct SampleParams {
    const float* logits;      // [n_rows, vocab] f32
    const SampleDraw* draws;  // [n_rows]
    uint32_t* out;            // [2, n_rows]: each row's token (on a failed row, the bits of
                              // its bad logit), then its status (0: sampled; 1 + i: logit
                              // i is not finite), one download for the host
    uint32_t n_rows;
    uint32_t vocab;           // 1..=2^23 (src/sampling: MAX_VOCAB)
};

// Log-probabilities of sampled rows (cuda/sampling.cuh, after sample_rows on
// the same out buffer): for each row whose draw asks, log_softmax of its
// logits at its token and at its n most likely tokens.
// grid (n_rows); block SAMPLE_THREADS.
struct LogprobParams {
    const float* logits;      // [n_rows, vocab] f32, every row sampled already
    const SampleDraw* draws;  // [n_rows]
    uint32_t* out;            // [2, n_rows] u32: sample_rows' tokens, then statuses (read);
                              // then [n_rows, LOGPROB_STRIDE] u32 (written, rows that ask and
                              // sampled): the token's logprob (f32 bits), then (id, logprob
                              // bits) of the n most likely tokens, most likely first
    uint32_t n_rows;
    uint32_t vocab;           // 1..=2^23
};

// out = x · wᵀ (f32), or out += x · wᵀ when `accumulate` (the residual add
// of a projection: the bits of the product, then of the add). Each output
// element sums k in an order fixed by k, the same whatever m is, so a row's
// result does not depend on its batch.
struct LinearParams {
    const float* x;  // [m, k] f32
    const float* w;  // [n, k] f32
    float* out;      // [m, n] f32
    uint32_t m;
    uint32_t n;
    uint32_t k;
    uint32_t accumulate;  // 0 or 1
};

// Formats of the ggml-block matmul's weights (LinearQParams::format).
constexpr uint32_t QFMT_Q8_0 = 0;
constexpr uint32_t QFMT_Q4_0 = 1;
constexpr uint32_t QFMT_Q4_1 = 2;
constexpr uint32_t QFMT_Q4_K = 3;
constexpr uint32_t QFMT_Q5_K = 4;
constexpr uint32_t QFMT_Q6_K = 5;
constexpr uint32_t QFMT_Q5_0 = 6;
constexpr uint32_t QFMT_Q5_1 = 7;

// LinearParams with weights in ggml blocks (k a multiple of a block's 32 or
// 256 values), each
// value widened to f32 as the CPU backend widens it (cuda/linear_f32.cuh).
struct LinearQParams {
    const float* x;       // [m, k] f32
    const void* w;        // [n, k / block values] blocks of `format`
    float* out;           // [m, n] f32
    uint32_t m;
    uint32_t n;
    uint32_t k;
    uint32_t accumulate;  // 0 or 1
    uint32_t format;      // QFMT_*
    uint32_t pad0;
};

// out[t] = table[tokens[t]] from a table in ggml blocks (dim a multiple of a
// block's values),
// widened as LinearQParams' weights are. grid-stride over n_tokens * dim.
struct EmbeddingQParams {
    const void* table;        // [vocab, dim / block values] blocks of `format`
    const uint32_t* tokens;   // [n_tokens] (< vocab; checked on the host)
    float* out;               // [n_tokens, dim] f32
    uint32_t n_tokens;
    uint32_t dim;
    uint32_t vocab;
    uint32_t format;          // QFMT_*
};

// out = x · wᵀ, or out += x · wᵀ when `accumulate`, with bf16 weights on
// tensor cores (cuda/linear_mma.cuh).
struct LinearMmaParams {
    const float* x;       // [m, k] f32
    const void* w;        // [n, k] bf16
    float* out;           // [m, n] f32
    // What the decode and wide tiles carry in (the prefill tile: both null):
    const float* norm_w;  // [k] f32, or null: x is RMSNorm(x) * norm_w, row by row
    const void* w_up;     // [n, k] bf16, or null: out = SwiGLU(x · wᵀ, x · w_upᵀ)
    uint32_t m;
    uint32_t n;
    uint32_t k;
    uint32_t accumulate;  // 0 or 1
    float norm_eps;       // RMSNorm's epsilon (with norm_w)
    uint32_t pad0;
};

// Up to three products of one x in one launch (q, k and v; gate and up),
// with bf16 weights on tensor cores: product i is out_i = x · w_iᵀ, [m, n_i],
// on the column blocks after those of the products before it (blocks0 and
// blocks1 of them for products 0 and 1). Each has the bits of its own
// LinearMmaParams launch on the same tile.
struct LinearMmaGroupParams {
    const float* x;   // [m, k] f32
    const void* w0;   // [n0, k] bf16
    const void* w1;   // [n1, k] bf16 (n_groups >= 2)
    const void* w2;   // [n2, k] bf16 (n_groups == 3)
    float* out0;      // [m, n0] f32
    float* out1;      // [m, n1] f32
    float* out2;      // [m, n2] f32
    uint32_t m;
    uint32_t k;
    uint32_t n0;
    uint32_t n1;
    uint32_t n2;
    uint32_t blocks0;  // column blocks of product 0
    uint32_t blocks1;  // column blocks of product 1
    uint32_t n_groups;  // 1..=3
    const float* norm_w;  // [k] f32, or null: x is RMSNorm(x) * norm_w (decode tile)
    float norm_eps;
    uint32_t pad0;
};

// x[i] += y[i % period] (period = n: add; period = cols: bias per row).
// grid-stride over n.
struct AddParams {
    float* x;        // [n] f32, in place
    const float* y;  // [period] f32
    uint64_t n;
    uint64_t period;
};

// xxh3-64 (seed 0) of byte ranges. grid (ceil(n / 8)); block 256 (a warp per range).
struct HashRangesParams {
    const uint8_t* data;      // bytes
    const uint64_t* offsets;  // [n] first byte of each range
    const uint64_t* lens;     // [n] bytes in each range (offset + len within data)
    uint64_t* out;            // [n] hashes
    uint32_t n;
    uint32_t pad0;
};

// Per-page transfer checksums (src/transfer/checksum.rs): region (layer, K|V)
// of a page is its first `tokens` rows of that layer's K or V, i.e. bytes
// [((layer * 2 + kv) * page_size) * row_bytes, + tokens * row_bytes) of the
// page. grid (n_pages); block 256.
struct PageChecksumParams {
    const uint8_t* kv;          // KV arena bytes
    const uint32_t* pages;      // [n_pages] arena pages (< arena pages)
    const uint32_t* tokens;     // [n_pages] rows written in each page (<= page_size)
    uint64_t* region_hashes;    // [n_pages][n_layers][2] out
    uint64_t* page_checksums;   // [n_pages] out
    uint64_t page_bytes;        // bytes per page
    uint32_t n_pages;
    uint32_t n_layers;
    uint32_t page_size;
    uint32_t row_bytes;         // kv_dim * dtype size
};

}  // namespace handoff
