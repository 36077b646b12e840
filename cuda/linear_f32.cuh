// Dense layers on the SIMT cores: out = x · wᵀ, or out += x · wᵀ, with x
// f32 [m, k], out f32 [m, n], and w [n, k] either f32 (f32 checkpoints) or
// in a GGUF checkpoint's ggml blocks, each value widened to f32 as it loads
// (QRows below): one body (linear_tiles) for both, so a block-stored
// product has the f32 one's bits on the widened weights.
//
// At batch 1 this is a stream of weight bytes, so what matters is how many
// of them are in flight. A block's LIN_WARPS warps split k in k-blocks of
// LIN_KB = 128 (lane l takes the 4 consecutive k at 4 l of each, one
// 16-byte load per weight row): warp w takes k-blocks w, w + LIN_WARPS, ...
// and issues the loads of UNROLL of them, for all LIN_COLS weight rows of
// the block, before it multiplies any (at batch 1: 16 loads of 16 bytes a
// lane, 8 KB a warp). Blocks own LIN_COLS columns, so a 512-column layer
// still gives 128 blocks.
//
// Order of every sum, fixed by k alone: lane l accumulates its k-blocks in
// order, the four k of each in order, with one fmaf per product; the lanes'
// sums meet in a fixed xor butterfly (16, 8, 4, 2, 1; every lane ends with
// the same bits); the warps' sums are added in warp order. Three shapes
// (rows of x per block) are compiled:
//   linear       1 row   4 k-blocks in flight (m = 1)
//   linear_few   4 rows  2 k-blocks in flight (m <= 4)
//   linear_many  8 rows  1 k-block in flight (m > 4)
// and all three give every output the same bits, so a row's result does
// not depend on the rest of the batch or on the shape the batch chose.
//
// A launch is 1-D: block b is row tile b % row_tiles of column block
// b / row_tiles, so the row tiles of one column block run side by side and
// read its weights from HBM about once, whatever m (x is the small
// operand; it is re-read from L2 by every column block).
//
// The body lives in this header so that tests/cuda/linear_f32_host.rs can
// run it on the host SIMT emulator against an f64 reference and, for the
// blocks, against the crate's own widening.
#pragma once
#ifdef HANDOFF_SIMT_HOST
#include "simt_host.h"
#endif
#include "common.cuh"
#include "params.cuh"

namespace handoff {

constexpr int LIN_WARPS = 8;  // warps per block, splitting k
constexpr int LIN_THREADS = 32 * LIN_WARPS;
constexpr int LIN_KB = 128;  // k per k-block: 4 a lane
constexpr int LIN_COLS = 4;  // output columns per block
constexpr int LIN_ROWS_ONE = 1;
constexpr int LIN_ROWS_FEW = 4;
constexpr int LIN_ROWS_MANY = 8;

// The warps' sums of each output, [warp][row][column].
template <int ROWS>
struct LinSmem {
    float part[LIN_WARPS][ROWS][LIN_COLS];
};

template <int ROWS>
__device__ __forceinline__ LinSmem<ROWS>& lin_smem() {
#ifdef HANDOFF_SIMT_HOST
    return *reinterpret_cast<LinSmem<ROWS>*>(sim::ctx.smem);
#else
    __shared__ LinSmem<ROWS> s;
    return s;
#endif
}

// a[row][c .. c + 4) of `a` [rows, k] (x or w), zeros outside [rows, k].
// `vec`: rows start on 16 bytes (k % 4 == 0 and an aligned base), so a
// chunk that starts inside k ends inside it and is one 16-byte load.
__device__ __forceinline__ float4 lin_load4(const float* a, uint64_t row, uint64_t rows, uint32_t k,
                                            uint32_t c, bool vec) {
    float4 v;
    v.x = v.y = v.z = v.w = 0.0f;
    if (row >= rows || c >= k) return v;
    const float* r = a + row * k + c;
    if (vec) return *reinterpret_cast<const float4*>(r);
    v.x = r[0];
    v.y = c + 1 < k ? r[1] : 0.0f;
    v.z = c + 2 < k ? r[2] : 0.0f;
    v.w = c + 3 < k ? r[3] : 0.0f;
    return v;
}

// The body of every matmul here: ROWS rows of x and LIN_COLS columns per
// block, UNROLL k-blocks of loads in flight per warp; `wr.load4(row, n, k,
// c)` gives weight row `row`'s values at k = c .. c + 4 as f32 (zeros
// outside [n, k]), so weights stored otherwise (ggml blocks, widened as
// they load) run these very sums. P: LinearParams or LinearQParams (x, out,
// m, n, k, accumulate). grid (ceil(m / ROWS) * ceil(n / LIN_COLS), 1, 1);
// block LIN_THREADS.
template <int ROWS, int UNROLL, typename P, typename Rows>
__device__ __forceinline__ void linear_tiles(const P& p, const Rows& wr) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    LinSmem<ROWS>& s = lin_smem<ROWS>();
    const uint32_t row_tiles = (p.m + ROWS - 1) / ROWS;
    const uint64_t r0 = (uint64_t)(blockIdx.x % row_tiles) * ROWS;
    const uint64_t n0 = (uint64_t)(blockIdx.x / row_tiles) * LIN_COLS;
    const bool x_vec = p.k % 4 == 0 && reinterpret_cast<uintptr_t>(p.x) % 16 == 0;
    const uint32_t kblocks = (p.k + LIN_KB - 1) / LIN_KB;
    float acc[ROWS][LIN_COLS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int t = 0; t < LIN_COLS; ++t) acc[r][t] = 0.0f;
    for (uint32_t kb0 = warp; kb0 < kblocks; kb0 += LIN_WARPS * UNROLL) {
        // Every load of UNROLL k-blocks first (past the last, zeros).
        float4 wv[UNROLL][LIN_COLS];
        float4 xv[UNROLL][ROWS];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const uint32_t kb = kb0 + u * LIN_WARPS;
            const uint32_t c = kb * LIN_KB + 4 * lane;
            const bool live = kb < kblocks;
#pragma unroll
            for (int t = 0; t < LIN_COLS; ++t) {
                wv[u][t] = wr.load4(live ? n0 + t : p.n, p.n, p.k, c);
            }
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                xv[u][r] = lin_load4(p.x, live ? r0 + r : p.m, p.m, p.k, c, x_vec);
            }
        }
        // Then the products, k-block by k-block in k order.
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (kb0 + u * LIN_WARPS >= kblocks) break;  // warp-uniform
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
#pragma unroll
                for (int t = 0; t < LIN_COLS; ++t) {
                    const float4 a = xv[u][r], b = wv[u][t];
                    float v = acc[r][t];
                    v = fmaf(a.x, b.x, v);
                    v = fmaf(a.y, b.y, v);
                    v = fmaf(a.z, b.z, v);
                    v = fmaf(a.w, b.w, v);
                    acc[r][t] = v;
                }
        }
    }
    // Each warp's sum of each output across its lanes, then the warps' sums
    // in warp order.
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int t = 0; t < LIN_COLS; ++t) {
            float v = acc[r][t];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0) s.part[warp][r][t] = v;
        }
    __syncthreads();
    for (int e = threadIdx.x; e < ROWS * LIN_COLS; e += LIN_THREADS) {
        const int r = e / LIN_COLS, t = e % LIN_COLS;
        const uint64_t row = r0 + r, col = n0 + t;
        if (row >= p.m || col >= p.n) continue;
        float v = s.part[0][r][t];
        for (int w = 1; w < LIN_WARPS; ++w) v += s.part[w][r][t];
        float* o = p.out + row * p.n + col;
        *o = p.accumulate ? *o + v : v;
    }
}

// Weights as f32 (LinearParams::w).
struct F32Rows {
    const float* w;
    bool vec;
    __device__ __forceinline__ explicit F32Rows(const LinearParams& p)
        : w(p.w), vec(p.k % 4 == 0 && reinterpret_cast<uintptr_t>(p.w) % 16 == 0) {}
    __device__ __forceinline__ float4 load4(uint64_t row, uint64_t rows, uint32_t k, uint32_t c) const {
        return lin_load4(w, row, rows, k, c, vec);
    }
};

__device__ __forceinline__ void linear_one(const LinearParams& p) {
    linear_tiles<LIN_ROWS_ONE, 4>(p, F32Rows(p));
}

__device__ __forceinline__ void linear_few(const LinearParams& p) {
    linear_tiles<LIN_ROWS_FEW, 2>(p, F32Rows(p));
}

__device__ __forceinline__ void linear_many(const LinearParams& p) {
    linear_tiles<LIN_ROWS_MANY, 1>(p, F32Rows(p));
}

// Weights kept as a GGUF checkpoint stored them: rows of ggml blocks
// (LinearQParams::format; a row of k values is k / ELEMS blocks), each value
// widened to f32 as it loads, exactly as the CPU backend widens it
// (src/backend/quant.rs, with its roundings: nothing here is contracted into
// an fma that is not one there). So a product has the bits of the f32
// matmul on the widened weights, reading 0.56 (Q4_0) to 1.06 (Q8_0) bytes a
// weight instead of 4. Block layouts (little-endian):
//   Q8_0 [f16 d][32 x i8]                           34 bytes, 32 values: d * q
//   Q4_0 [f16 d][16 B: value j in the low nibble of
//        byte j, j + 16 in its high nibble]         18 bytes, 32 values: d * (q - 8)
//   Q4_1 [f16 d][f16 m][16 B as Q4_0]               20 bytes, 32 values: fma(q, d, m)
//   Q5_0 [f16 d][u32: fifth bit of value j in bit j][16 B as Q4_0]
//                                                   22 bytes, 32 values: d * (q - 16)
//   Q5_1 [f16 d][f16 m][u32 as Q5_0][16 B as Q4_0]  24 bytes, 32 values: fma(q, d, m)
//   Q4_K [f16 d][f16 dmin][12 B: 6-bit scale and min of 8 sub-blocks]
//        [128 B: sub-blocks 2g and 2g+1 in the low and high nibbles of
//        bytes 32g ..]                              144 bytes, 256 values:
//        (d * sc) * q - dmin * m
//   Q5_K Q4_K's header, [32 B: fifth bits, bit 2g | 2g+1 of byte l for
//        value l of sub-block 2g | 2g+1][128 B as Q4_K]
//                                                   176 bytes, 256 values: as Q4_K
//   Q6_K [128 B low nibbles][64 B two high bits][16 x i8 scales][f16 d]
//                                                   210 bytes, 256 values:
//        (d * sc) * (q - 32)
template <int FMT>
struct QRows {
    static constexpr bool K = FMT == QFMT_Q4_K || FMT == QFMT_Q5_K || FMT == QFMT_Q6_K;
    static constexpr uint32_t ELEMS = K ? 256 : 32;
    static constexpr uint32_t BLOCK = FMT == QFMT_Q8_0   ? 34
                                      : FMT == QFMT_Q4_0 ? 18
                                      : FMT == QFMT_Q4_1 ? 20
                                      : FMT == QFMT_Q5_0 ? 22
                                      : FMT == QFMT_Q5_1 ? 24
                                      : FMT == QFMT_Q4_K ? 144
                                      : FMT == QFMT_Q5_K ? 176
                                                         : 210;
    const uint8_t* w;
    uint64_t row_bytes;  // blocks per row x block bytes

    // Rows of `k` values in blocks at `blocks`.
    __device__ __forceinline__ QRows(const void* blocks, uint32_t k)
        : w(static_cast<const uint8_t*>(blocks)), row_bytes((uint64_t)(k / ELEMS) * BLOCK) {}

    // The 16-bit word at byte `at` of a block (every field read here starts
    // on an even byte of an even-sized block).
    __device__ __forceinline__ static uint32_t u16_at(const uint8_t* b, uint32_t at) {
        return *reinterpret_cast<const uint16_t*>(b + at);
    }
    // Bytes at .. at + 4 of a block (at even) as one word, byte 0 lowest.
    __device__ __forceinline__ static uint32_t u32_at(const uint8_t* b, uint32_t at) {
        return u16_at(b, at) | u16_at(b, at + 2) << 16;
    }

    // The 6-bit scale and min of sub-block `j` of a K block's 12 bytes
    // `q` (as scale_min_k4 in src/backend/quant.rs).
    __device__ __forceinline__ static void scale_min(const uint8_t* q, uint32_t j, float& sc,
                                                     float& m) {
        if (j < 4) {
            sc = (float)(q[j] & 63);
            m = (float)(q[j + 4] & 63);
        } else {
            sc = (float)((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4));
            m = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
        }
    }

    // k % ELEMS == 0 (checked on the host), so a chunk of 4 that starts
    // inside k ends inside it, in one block (and one sub-block).
    __device__ __forceinline__ float4 load4(uint64_t row, uint64_t rows, uint32_t k, uint32_t c) const {
        float4 v;
        v.x = v.y = v.z = v.w = 0.0f;
        if (row >= rows || c >= k) return v;
        const uint8_t* b = w + row * row_bytes + (uint64_t)(c / ELEMS) * BLOCK;
        const uint32_t j = c % ELEMS;  // a multiple of 4
        float q[4];
        if (FMT == QFMT_Q8_0) {
            const float d = f16_bits_to_f32(u16_at(b, 0));
            const uint32_t bytes = u32_at(b, 2 + j);
#pragma unroll
            for (int i = 0; i < 4; ++i) q[i] = __fmul_rn((float)(int8_t)(uint8_t)(bytes >> (8 * i)), d);
        } else if (FMT == QFMT_Q4_0 || FMT == QFMT_Q4_1 || FMT == QFMT_Q5_0 || FMT == QFMT_Q5_1) {
            const float d = f16_bits_to_f32(u16_at(b, 0));
            const uint32_t qs = FMT == QFMT_Q4_0 ? 2 : FMT == QFMT_Q4_1 ? 4 : FMT == QFMT_Q5_0 ? 6 : 8;
            const uint32_t bytes = u32_at(b, qs + j % 16);
            const uint32_t shift = j < 16 ? 0 : 4;  // values 0-15 low nibbles, 16-31 high
            // Q5_0 / Q5_1: the fifth bits, bit v for value v.
            const uint32_t qh = FMT == QFMT_Q5_0 ? u32_at(b, 2) : FMT == QFMT_Q5_1 ? u32_at(b, 4) : 0;
            float n[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const uint32_t fifth = (qh >> (j + i)) & 1u ? 16u : 0u;
                n[i] = (float)(((bytes >> (8 * i + shift)) & 0xfu) | fifth);
            }
            if (FMT == QFMT_Q4_0) {
#pragma unroll
                for (int i = 0; i < 4; ++i) q[i] = __fmul_rn(n[i] - 8.0f, d);
            } else if (FMT == QFMT_Q5_0) {
#pragma unroll
                for (int i = 0; i < 4; ++i) q[i] = __fmul_rn(n[i] - 16.0f, d);
            } else {
                const float m = f16_bits_to_f32(u16_at(b, 2));
#pragma unroll
                for (int i = 0; i < 4; ++i) q[i] = fmaf(n[i], d, m);
            }
        } else if (FMT == QFMT_Q4_K || FMT == QFMT_Q5_K) {
            const float d = f16_bits_to_f32(u16_at(b, 0)), dmin = f16_bits_to_f32(u16_at(b, 2));
            const uint32_t g = j / 64, l = j % 32, sub = j / 32;  // sub = 2g or 2g + 1
            float sc, mn;
            scale_min(b + 4, sub, sc, mn);
            const float d1 = __fmul_rn(d, sc), m1 = __fmul_rn(dmin, mn);
            const uint32_t qs = FMT == QFMT_Q4_K ? 16 : 48;
            const uint32_t bytes = u32_at(b, qs + 32 * g + l);
            const uint32_t shift = sub & 1 ? 4 : 0;
            uint32_t high = 0;  // Q5_K: the fifth bits of the four values
            if (FMT == QFMT_Q5_K) high = u32_at(b, 16 + l);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                uint32_t n = (bytes >> (8 * i + shift)) & 0xfu;
                if (FMT == QFMT_Q5_K) n += (high >> (8 * i + sub)) & 1u ? 16u : 0u;
                q[i] = __fsub_rn(__fmul_rn(d1, (float)n), m1);
            }
        } else {  // Q6_K
            const float d = f16_bits_to_f32(u16_at(b, 208));
            const uint32_t half = j / 128, jj = j % 128, quarter = jj / 32, l = jj % 32;
            // Quarters 0 and 2 take low | high nibbles of ql[l], 1 and 3 of
            // ql[l + 32]; quarter t takes bits 2t, 2t + 1 of qh[l].
            const uint32_t ql = u32_at(b, 64 * half + l + (quarter & 1 ? 32 : 0));
            const uint32_t qh = u32_at(b, 128 + 32 * half + l);
            const uint32_t shift = quarter >= 2 ? 4 : 0;
            const float sc = (float)(int8_t)b[192 + 8 * half + l / 16 + 2 * quarter];
            const float ds = __fmul_rn(d, sc);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const uint32_t lo = (ql >> (8 * i + shift)) & 0xfu;
                const uint32_t hi = (qh >> (8 * i + 2 * quarter)) & 3u;
                q[i] = __fmul_rn(ds, (float)((int)(lo | hi << 4) - 32));
            }
        }
        v.x = q[0], v.y = q[1], v.z = q[2], v.w = q[3];
        return v;
    }
};

// Calls f(rows) with the loader of `format` over the blocks at `blocks`
// (rows of k values): the one dispatch of every ggml-block kernel to its
// compiled forms, a block-uniform branch. The host sends only these
// formats (QuantWeights).
template <typename F>
__device__ __forceinline__ void with_qrows(uint32_t format, const void* blocks, uint32_t k, F&& f) {
    switch (format) {
        case QFMT_Q8_0: f(QRows<QFMT_Q8_0>(blocks, k)); break;
        case QFMT_Q4_0: f(QRows<QFMT_Q4_0>(blocks, k)); break;
        case QFMT_Q4_1: f(QRows<QFMT_Q4_1>(blocks, k)); break;
        case QFMT_Q5_0: f(QRows<QFMT_Q5_0>(blocks, k)); break;
        case QFMT_Q5_1: f(QRows<QFMT_Q5_1>(blocks, k)); break;
        case QFMT_Q4_K: f(QRows<QFMT_Q4_K>(blocks, k)); break;
        case QFMT_Q5_K: f(QRows<QFMT_Q5_K>(blocks, k)); break;
        case QFMT_Q6_K: f(QRows<QFMT_Q6_K>(blocks, k)); break;
        default: break;
    }
}

// The shapes of the ggml-block matmul: the same ROWS and UNROLL, so the
// same bits, as the f32 shapes.
template <int ROWS, int UNROLL>
__device__ __forceinline__ void linear_q_rows(const LinearQParams& p) {
    with_qrows(p.format, p.w, p.k, [&](const auto& rows) { linear_tiles<ROWS, UNROLL>(p, rows); });
}

__device__ __forceinline__ void linear_q_one(const LinearQParams& p) {
    linear_q_rows<LIN_ROWS_ONE, 4>(p);
}

__device__ __forceinline__ void linear_q_few(const LinearQParams& p) {
    linear_q_rows<LIN_ROWS_FEW, 2>(p);
}

__device__ __forceinline__ void linear_q_many(const LinearQParams& p) {
    linear_q_rows<LIN_ROWS_MANY, 1>(p);
}

// out[t][e] = row tokens[t] of a ggml-block table [vocab, dim], widened as
// above (the embedding of a quantized checkpoint; with tied embeddings the
// same bytes are the output head's). A grid-stride loop over n_tokens x dim.
__device__ __forceinline__ void embedding_q(const EmbeddingQParams& p) {
    with_qrows(p.format, p.table, p.dim, [&](const auto& rows) {
        const uint64_t total = (uint64_t)p.n_tokens * p.dim;
        for (uint64_t idx = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
             idx += (uint64_t)gridDim.x * blockDim.x) {
            const uint64_t t = idx / p.dim;
            const uint32_t e = (uint32_t)(idx % p.dim);
            const uint32_t tok = p.tokens[t];
            if (tok >= p.vocab) {  // refused on the host; should one slip through, NaN
                p.out[idx] = __int_as_float(0x7fc00000);
                continue;
            }
            // The chunk of 4 holding e, from the matmul's own loader.
            const float4 v = rows.load4(tok, p.vocab, p.dim, e & ~3u);
            const uint32_t i = e & 3u;
            p.out[idx] = i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
        }
    });
}

}  // namespace handoff
