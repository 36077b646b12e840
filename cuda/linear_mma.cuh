// Dense layers with bf16 weights on tensor cores: out = x · wᵀ with
// x f32 [m, k], w bf16 [n, k] (a bf16 checkpoint's weights, kept as they
// were stored: half the bytes of f32 to read per token), out f32 [m, n].
//
// Precision: each x value is split into two bf16 parts, hi = bf16(x) and
// lo = bf16(x - hi), and both meet the weight in an mma.sync m16n8k16 with
// f32 accumulation, so the products carry about 16 bits of x (bf16 alone
// would keep 8): within 2^-15 of the f32 product, summed in f32.
//
// Tiling: a block owns RT row tiles of 16 rows of x and NT n-tiles of 8
// output columns, and its LMMA_WARPS warps split k in blocks of LMMA_KB =
// 32: warp w takes k-blocks w, w + LMMA_WARPS, ..., in order, two mma
// k-steps each, hi before lo, and the warps' partial sums are then added in
// warp order. So every output is summed in an order fixed by k alone, never
// by m, by the tile shape or by where its row falls in a tile: a row's
// result does not depend on the rest of the batch. Two shapes are compiled,
// with the same bits:
//   linear_mma       16 x 16 (RT 1, NT 2), for decode: few rows of x, so
//                    the kernel is a stream of weight bytes; a 2048-column
//                    layer gives 128 blocks of 8 warps even at batch 1.
//   linear_mma_wide  32 x 32 (RT 2, NT 4), for m >= 32 (prefill): each
//                    weight chunk serves twice the rows and each x chunk
//                    four times the columns (x, re-read once per column
//                    block, is most of a large batch's traffic).
//
// Loads: which k a fragment position stands for is free as long as A and
// B agree, so lane (g, t) of a k-block at k0 takes the 8 consecutive k of
// chunk k0 + 8 t: one 16-byte load of each weight row it needs and two of
// x per row. Its elements 0-1 | 2-3 sit at fragment k 2t, 2t+1 | 2t+8, 2t+9
// of the first k-step, elements 4-5 | 6-7 of the second. Each warp issues
// the loads of UNROLL k-blocks (4 for the decode shape, 2 for the wide one)
// before it computes any of them, so that enough weight bytes are in
// flight to cover memory latency at batch 1 (about 32 KB per block).
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

constexpr int LMMA_WARPS = 8;  // warps per block, splitting k
constexpr int LMMA_THREADS = LMMA_WARPS * 32;
constexpr int LMMA_KB = 32;  // k per k-block (two mma k-steps)
// The decode-shaped tile: 16 rows of x x 16 columns (two n-tiles of 8),
// each warp with the loads of 4 k-blocks in flight.
constexpr int LMMA_BM = 16;
constexpr int LMMA_BN = 16;
// The prefill-shaped tile (m >= 32): 32 rows x 32 columns, so each weight
// chunk serves twice the rows and each x chunk four times the columns
// (x, re-read once per column block, is most of a large batch's traffic);
// 2 k-blocks in flight. Same sums per output in the same order: the same
// bits as the small tile, so choosing it by m keeps a row's result
// independent of its batch.
constexpr int LMMA_WIDE_BM = 32;
constexpr int LMMA_WIDE_BN = 32;

// The warps' partial sums, [warp][row tile][n-tile][accumulator][lane].
template <int RT, int NT>
struct LmmaSmem {
    float part[LMMA_WARPS][RT][NT][4][32];
};

template <int RT, int NT>
__device__ __forceinline__ LmmaSmem<RT, NT>& lmma_smem() {
#ifdef HANDOFF_SIMT_HOST
    return *reinterpret_cast<LmmaSmem<RT, NT>*>(sim::ctx.smem);
#else
    __shared__ LmmaSmem<RT, NT> s;
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

// x[r][c .. c + 8), 0 outside [m, k]. `vec`: rows of x start on 16 bytes
// (k % 4 == 0 and an aligned base), so a chunk inside k is two float4.
__device__ __forceinline__ void lmma_x8(const LinearMmaParams& p, uint64_t r, uint32_t c, bool vec,
                                        float v[8]) {
    if (r >= p.m) {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = 0.0f;
        return;
    }
    const float* row = p.x + r * p.k;
    if (vec && c + 8 <= p.k) {
        const float4 a = *reinterpret_cast<const float4*>(row + c);
        const float4 b = *reinterpret_cast<const float4*>(row + c + 4);
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
        v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
        return;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = c + i < p.k ? row[c + i] : 0.0f;
}

// w[n][c .. c + 8) as four registers (lo half = the lower k), 0 outside
// [n, k]. `vec`: rows of w start on 16 bytes (k % 8 == 0 and an aligned
// base), so a chunk inside k is one 16-byte load.
__device__ __forceinline__ uint4 lmma_w8(const LinearMmaParams& p, uint64_t n, uint32_t c, bool vec) {
    if (n >= p.n || c >= p.k) return make_uint4(0, 0, 0, 0);
    const uint16_t* row = static_cast<const uint16_t*>(p.w) + n * p.k;
    if (vec) return *reinterpret_cast<const uint4*>(row + c);  // c + 8 <= k: k % 8 == 0
    uint32_t e[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint32_t lo = c + 2 * i < p.k ? row[c + 2 * i] : 0;
        const uint32_t hi = c + 2 * i + 1 < p.k ? row[c + 2 * i + 1] : 0;
        e[i] = lo | (hi << 16);
    }
    return make_uint4(e[0], e[1], e[2], e[3]);
}

// RT row tiles of 16 and NT n-tiles of 8 per block, UNROLL k-blocks of
// loads in flight per warp. grid (ceil(n / (8 NT)), ceil(m / (16 RT)));
// block LMMA_THREADS.
template <typename T, int RT, int NT, int UNROLL>
__device__ __forceinline__ void linear_mma_tiles(const LinearMmaParams& p) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int group = lane >> 2, tid = lane & 3;
    // This lane's rows: r0 + 16 rt and r0 + 16 rt + 8 of row tile rt.
    const uint64_t r0 = (uint64_t)blockIdx.y * (16 * RT) + group;
    const uint64_t n0 = (uint64_t)blockIdx.x * (8 * NT);
    const bool x_vec = p.k % 4 == 0 && reinterpret_cast<uintptr_t>(p.x) % 16 == 0;
    const bool w_vec = p.k % 8 == 0 && reinterpret_cast<uintptr_t>(p.w) % 16 == 0;
    const uint32_t kblocks = (p.k + LMMA_KB - 1) / LMMA_KB;
    float c[RT][NT][4];
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int t = 0; t < NT; ++t) c[rt][t][0] = c[rt][t][1] = c[rt][t][2] = c[rt][t][3] = 0.0f;
    for (uint32_t kb0 = warp; kb0 < kblocks; kb0 += LMMA_WARPS * UNROLL) {
        // Every load of UNROLL k-blocks first (past the last, zeros).
        uint4 wv[UNROLL][NT];
        float xv[UNROLL][RT][2][8];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const uint32_t kb = kb0 + u * LMMA_WARPS;
            const uint32_t c0 = kb * LMMA_KB + 8 * tid;
            const bool live = kb < kblocks;
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                wv[u][t] = live ? lmma_w8(p, n0 + t * 8 + group, c0, w_vec) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int rt = 0; rt < RT; ++rt) {
                const uint64_t ra = r0 + 16 * rt;
                lmma_x8(p, live ? ra : p.m, c0, x_vec, xv[u][rt][0]);
                lmma_x8(p, live ? ra + 8 : p.m, c0, x_vec, xv[u][rt][1]);
            }
        }
        // Then the mma, k-block by k-block in k order: for every output,
        // k-step 0 hi, lo, then k-step 1 hi, lo, whatever RT, NT and UNROLL.
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (kb0 + u * LMMA_WARPS >= kblocks) break;  // warp-uniform
#pragma unroll
            for (int step = 0; step < 2; ++step) {
#pragma unroll
                for (int rt = 0; rt < RT; ++rt) {
                    // A fragment: rows ra / ra + 8, chunk elements 4 step +
                    // (0, 1) at k 2t, 2t+1 and + (2, 3) at k 2t+8, 2t+9.
                    const float(&xa)[2][8] = xv[u][rt];
                    const int e = 4 * step;
                    const float a[8] = {xa[0][e],     xa[0][e + 1], xa[1][e],     xa[1][e + 1],
                                        xa[0][e + 2], xa[0][e + 3], xa[1][e + 2], xa[1][e + 3]};
                    uint32_t hi[4], lo[4];
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const float h0 = round_to<T>(a[2 * i]), h1 = round_to<T>(a[2 * i + 1]);
                        hi[i] = MmaOp<T>::pack(h0, h1);
                        lo[i] = MmaOp<T>::pack(a[2 * i] - h0, a[2 * i + 1] - h1);
                    }
#pragma unroll
                    for (int t = 0; t < NT; ++t) {
                        const uint32_t b0 = step == 0 ? wv[u][t].x : wv[u][t].z;
                        const uint32_t b1 = step == 0 ? wv[u][t].y : wv[u][t].w;
                        MmaOp<T>::run(c[rt][t], hi, b0, b1);
                        MmaOp<T>::run(c[rt][t], lo, b0, b1);
                    }
                }
            }
        }
    }
    // The warps' partial sums, added in warp order by warp 0.
    LmmaSmem<RT, NT>& s = lmma_smem<RT, NT>();
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
            for (int i = 0; i < 4; ++i) s.part[warp][rt][t][i][lane] = c[rt][t][i];
    __syncthreads();
    if (warp != 0) return;
    // C fragment: c0 c1 (row group, cols 2 tid, +1), c2 c3 (row group + 8).
#pragma unroll
    for (int rt = 0; rt < RT; ++rt) {
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            const uint64_t col = n0 + t * 8 + 2 * tid;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float v = s.part[0][rt][t][i][lane];
                for (int w = 1; w < LMMA_WARPS; ++w) v += s.part[w][rt][t][i][lane];
                const uint64_t r = r0 + 16 * rt + (i < 2 ? 0 : 8), j = col + (i & 1);
                if (r < p.m && j < p.n) p.out[r * p.n + j] = v;
            }
        }
    }
}

// grid (ceil(n / LMMA_BN), ceil(m / LMMA_BM)); block LMMA_THREADS.
template <typename T>
__device__ __forceinline__ void linear_mma_body(const LinearMmaParams& p) {
    linear_mma_tiles<T, LMMA_BM / 16, LMMA_BN / 8, 4>(p);
}

// grid (ceil(n / LMMA_WIDE_BN), ceil(m / LMMA_WIDE_BM)); block LMMA_THREADS.
template <typename T>
__device__ __forceinline__ void linear_mma_wide_body(const LinearMmaParams& p) {
    linear_mma_tiles<T, LMMA_WIDE_BM / 16, LMMA_WIDE_BN / 8, 2>(p);
}

}  // namespace handoff
