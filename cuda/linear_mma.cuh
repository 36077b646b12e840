// Dense layers with bf16 weights on tensor cores: out = x · wᵀ with
// x f32 [m, k], w bf16 [n, k] (a bf16 checkpoint's weights, kept as they
// were stored: half the bytes of f32 to read per token), out f32 [m, n].
//
// Precision: each x value is split into two bf16 parts, hi = bf16(x) and
// lo = bf16(x - hi), and both meet the weight in an mma.sync m16n8k16 with
// f32 accumulation, so the products carry about 16 bits of x (bf16 alone
// would keep 8): within 2^-15 of the f32 product, summed in f32.
//
// Tiling, shaped for decode (few rows of x, weights read once): a block
// owns LMMA_BM = 16 rows of x and LMMA_BN = 16 output columns (two n-tiles
// of 8), and its LMMA_WARPS warps split k: warp w takes the k-steps of 16
// numbered w, w + LMMA_WARPS, ..., in order, hi before lo, and the warps'
// partial sums are then added in warp order. So every output is summed in
// an order fixed by k alone, never by m or by where its row falls in a
// tile: a row's result does not depend on the rest of the batch. A 2048-
// column layer gives 128 blocks of 4 warps even at batch 1. Fragments are
// loaded straight from global memory (x is small and cached; each weight
// element is read once per 16 rows of x).
//
// The body lives in this header so that tests/cuda/linear_mma_host.rs can
// run it on the host SIMT emulator against an f64 reference.
#pragma once
#ifdef HANDOFF_SIMT_HOST
#include "simt_host.h"
#else
#include "mma.cuh"
#endif
#include "params.cuh"

namespace handoff {

constexpr int LMMA_WARPS = 4;  // warps per block, splitting k
constexpr int LMMA_THREADS = LMMA_WARPS * 32;
constexpr int LMMA_NT = 2;            // n-tiles of 8 per block
constexpr int LMMA_BM = 16;           // rows of x per block
constexpr int LMMA_BN = LMMA_NT * 8;  // output columns per block

// The warps' partial sums, [warp][n-tile][accumulator][lane].
struct LmmaSmem {
    float part[LMMA_WARPS][LMMA_NT][4][32];
};

__device__ __forceinline__ LmmaSmem& lmma_smem() {
#ifdef HANDOFF_SIMT_HOST
    return *reinterpret_cast<LmmaSmem*>(sim::ctx.smem);
#else
    __shared__ LmmaSmem s;
    return s;
#endif
}

// x rounded to T and back to f32.
template <typename T>
__device__ __forceinline__ float round_to(float x) {
#ifdef HANDOFF_SIMT_HOST
    return sim::Conv<T>::to(sim::Conv<T>::from(x));
#else
    return to_float(from_float<T>(x));
#endif
}

// x[r][c], 0 outside [m, k].
__device__ __forceinline__ float lmma_x(const LinearMmaParams& p, uint64_t r, uint32_t c) {
    return (r < p.m && c < p.k) ? p.x[r * p.k + c] : 0.0f;
}

// w[n][c], w[n][c + 1] as one register (lo = the first), 0 outside [n, k].
__device__ __forceinline__ uint32_t lmma_w(const LinearMmaParams& p, uint64_t n, uint32_t c) {
    if (n >= p.n) return 0;
    const uint16_t* row = static_cast<const uint16_t*>(p.w) + n * p.k;
    if ((p.k & 1) == 0 && c + 1 < p.k) return *reinterpret_cast<const uint32_t*>(row + c);  // 4-byte aligned
    const uint32_t lo = c < p.k ? row[c] : 0, hi = c + 1 < p.k ? row[c + 1] : 0;
    return lo | (hi << 16);
}

// grid (ceil(n / LMMA_BN), ceil(m / LMMA_BM)); block LMMA_THREADS.
template <typename T>
__device__ __forceinline__ void linear_mma_body(const LinearMmaParams& p) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int group = lane >> 2, tid = lane & 3;
    const uint64_t r0 = (uint64_t)blockIdx.y * LMMA_BM + group, r1 = r0 + 8;
    const uint64_t n0 = (uint64_t)blockIdx.x * LMMA_BN;
    float c[LMMA_NT][4];
#pragma unroll
    for (int t = 0; t < LMMA_NT; ++t) c[t][0] = c[t][1] = c[t][2] = c[t][3] = 0.0f;
    for (uint64_t k0 = (uint64_t)warp * 16; k0 < p.k; k0 += 16 * LMMA_WARPS) {
        // A fragment (PTX layout): a0 a1 (row group, cols 2 tid, +1), a2 a3
        // (row group + 8), a4..a7 the same at cols + 8.
        const uint32_t c0 = (uint32_t)k0 + 2 * tid;
        const float xa[8] = {lmma_x(p, r0, c0),     lmma_x(p, r0, c0 + 1), lmma_x(p, r1, c0),
                             lmma_x(p, r1, c0 + 1), lmma_x(p, r0, c0 + 8), lmma_x(p, r0, c0 + 9),
                             lmma_x(p, r1, c0 + 8), lmma_x(p, r1, c0 + 9)};
        uint32_t hi[4], lo[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float h0 = round_to<T>(xa[2 * i]), h1 = round_to<T>(xa[2 * i + 1]);
            hi[i] = MmaOp<T>::pack(h0, h1);
            lo[i] = MmaOp<T>::pack(xa[2 * i] - h0, xa[2 * i + 1] - h1);
        }
#pragma unroll
        for (int t = 0; t < LMMA_NT; ++t) {
            // B fragment: b0 (k = 2 tid, +1), b1 (k + 8) of column group.
            const uint64_t n = n0 + t * 8 + group;
            const uint32_t b0 = lmma_w(p, n, c0), b1 = lmma_w(p, n, c0 + 8);
            MmaOp<T>::run(c[t], hi, b0, b1);
            MmaOp<T>::run(c[t], lo, b0, b1);
        }
    }
    // The warps' partial sums, added in warp order by warp 0.
    LmmaSmem& s = lmma_smem();
#pragma unroll
    for (int t = 0; t < LMMA_NT; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) s.part[warp][t][i][lane] = c[t][i];
    __syncthreads();
    if (warp != 0) return;
    // C fragment: c0 c1 (row group, cols 2 tid, +1), c2 c3 (row group + 8).
#pragma unroll
    for (int t = 0; t < LMMA_NT; ++t) {
        const uint64_t col = n0 + t * 8 + 2 * tid;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float v = s.part[0][t][i][lane];
            for (int w = 1; w < LMMA_WARPS; ++w) v += s.part[w][t][i][lane];
            const uint64_t r = i < 2 ? r0 : r1, j = col + (i & 1);
            if (r < p.m && j < p.n) p.out[r * p.n + j] = v;
        }
    }
}

}  // namespace handoff
