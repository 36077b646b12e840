// Dense layers with 16-bit weights on tensor cores: out = x · wᵀ with
// x f32 [m, k], w bf16 or f16 [n, k] (a bf16 or f16 checkpoint's weights,
// kept as they were stored: half the bytes of f32 to read per token), out
// f32 [m, n]. The template parameter T of every body is the weights' type.
//
// Precision: each x value is split into two bf16 parts, hi = bf16(x) and
// lo = bf16(x - hi), and both meet the weight in an mma.sync m16n8k16 with
// f32 accumulation, so the products carry about 16 bits of x (bf16 alone
// would keep 8): within 2^-15 of the f32 product, summed in f32. f16
// weights are split the same way in registers (hi and lo in bf16, exactly:
// see WeightMma), so they too meet x in bf16 mma, with twice the mma.
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
// Group launches (linear_mma_group, _wide_group, _gemm_group) run up to
// three products of the same x (q, k and v; gate and up) in one launch,
// each block on one of them: the same tile code, so each product has the
// bits of its own launch.
//
// The prefill tile, linear_mma_gemm (m >= 128): a block owns 128 rows x 64
// columns, its 8 warps 32 x 32 each (4 x 2), and k-blocks of x and w reach
// shared memory through a 3-stage cp.async pipeline, so each chunk of x
// serves 64 columns and each chunk of w 128 rows (the two tiles above read
// their operands straight from global memory, once per warp). To give the
// bits of the tiles above, a warp keeps two sets of accumulators: it walks
// k-blocks in the other tiles' warp order (phase w: k-blocks w, w + 8, ...,
// the k-blocks warp w sums there) into `acc`, and at the end of a phase
// adds it to `run` (run = phase 0, then run += phase 1, ...), which is how
// their warp 0 adds the warps' partial sums.
//
// The bodies live in this header so that tests/cuda/linear_mma_host.rs can
// run them on the host SIMT emulator against an f64 reference.
#pragma once
#ifdef HANDOFF_SIMT_HOST
#include "simt_host.h"
#else
#include "mma.cuh"
#endif
#include "common.cuh"
#include "params.cuh"
#include "pipeline.cuh"
#include "pointwise.cuh"

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

static_assert(LMMA_THREADS == RMS_THREADS,
              "a tile sums a row's squares in the rms_norm kernel's order");

// The warps' partial sums, [warp][row tile][n-tile][accumulator][lane], and
// the RMSNorm scale of each of the block's rows.
template <int RT, int NT>
struct LmmaSmem {
    float part[LMMA_WARPS][RT][NT][4][32];
    float scale[RT * 16];
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

// x[r][c .. c + 8), 0 outside [m, k]; with NORM, RMSNorm of it (row r's
// `scale`, rms_norm's product with p.norm_w). `vec`: rows of x start on 16
// bytes (k % 4 == 0 and an aligned base), so a chunk inside k is two float4.
template <bool NORM>
__device__ __forceinline__ void lmma_x8(const LinearMmaParams& p, uint64_t r, uint32_t c, bool vec,
                                        float scale, float v[8]) {
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
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = c + i < p.k ? row[c + i] : 0.0f;
    }
    if (!NORM) return;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        if (c + i < p.k) v[i] = rms_apply(v[i], scale, p.norm_w[c + i]);
    }
}

// w[n][c .. c + 8) of `w` [p.n, p.k] (p.w or p.w_up) as four registers (lo
// half = the lower k), 0 outside [n, k]. `vec`: rows of w start on 16 bytes
// (k % 8 == 0 and an aligned base), so a chunk inside k is one 16-byte load.
__device__ __forceinline__ uint4 lmma_w8(const LinearMmaParams& p, const void* w, uint64_t n, uint32_t c,
                                         bool vec) {
    if (n >= p.n || c >= p.k) return make_uint4(0, 0, 0, 0);
    const uint16_t* row = static_cast<const uint16_t*>(w) + n * p.k;
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

// The weights' products on the tensor cores, by how they are stored
// (W: the checkpoint's 16-bit type). bf16 weights meet x's bf16 parts as
// they are: two mma per n-tile and k-step (x hi, then x lo).
template <typename W>
struct WeightMma;
template <>
struct WeightMma<__nv_bfloat16> {
    __device__ __forceinline__ static void run(float c[4], const uint32_t (&hi)[4],
                                               const uint32_t (&lo)[4], uint32_t b0, uint32_t b1) {
        MmaOp<__nv_bfloat16>::run(c, hi, b0, b1);
        MmaOp<__nv_bfloat16>::run(c, lo, b0, b1);
    }
};

// Two f16 weights (one register) as bf16 registers hi and lo with w = hi +
// lo exactly: an f16 value has 11 significant bits, hi keeps the nearest
// 8, and the rest (at most 4 bits, within bf16's range) is exact in lo.
__device__ __forceinline__ void f16x2_split(uint32_t w, uint32_t& hi, uint32_t& lo) {
    const float w0 = f16_bits_to_f32(w & 0xffffu), w1 = f16_bits_to_f32(w >> 16);
    const float h0 = round_to<__nv_bfloat16>(w0), h1 = round_to<__nv_bfloat16>(w1);
    hi = MmaOp<__nv_bfloat16>::pack(h0, h1);
    lo = MmaOp<__nv_bfloat16>::pack(w0 - h0, w1 - h1);
}

// f16 weights (an f16 checkpoint's: half the bytes of f32, as bf16's) are
// split into bf16 hi and lo parts in registers, so that the same bf16 mma
// serves them with no weight bits lost: four mma per n-tile and k-step,
// (x hi, w hi), (x lo, w hi), (x hi, w lo), (x lo, w lo). An f16 mma
// instead would need x in f16, whose range (65504) an activation can pass.
template <>
struct WeightMma<__half> {
    __device__ __forceinline__ static void run(float c[4], const uint32_t (&hi)[4],
                                               const uint32_t (&lo)[4], uint32_t b0, uint32_t b1) {
        uint32_t h0, l0, h1, l1;
        f16x2_split(b0, h0, l0);
        f16x2_split(b1, h1, l1);
        MmaOp<__nv_bfloat16>::run(c, hi, h0, h1);
        MmaOp<__nv_bfloat16>::run(c, lo, h0, h1);
        MmaOp<__nv_bfloat16>::run(c, hi, l0, l1);
        MmaOp<__nv_bfloat16>::run(c, lo, l0, l1);
    }
};

// One k-step of one row tile: the 8 activations of its A fragment (a, in
// the order of the mma's A registers) split into bf16 parts hi and lo, and
// their products with each of the NT weight fragments of k-step `step` (wv
// holds both k-steps' registers, of the weights' type W), hi first. Every
// tile runs this one sequence of operations, which is what gives every
// tile the same bits.
template <typename W, int NT>
__device__ __forceinline__ void lmma_step(const float (&a)[8], const uint4 (&wv)[NT], int step,
                                          float (&c)[NT][4]) {
    uint32_t hi[4], lo[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float h0 = round_to<__nv_bfloat16>(a[2 * i]), h1 = round_to<__nv_bfloat16>(a[2 * i + 1]);
        hi[i] = MmaOp<__nv_bfloat16>::pack(h0, h1);
        lo[i] = MmaOp<__nv_bfloat16>::pack(a[2 * i] - h0, a[2 * i + 1] - h1);
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        const uint32_t b0 = step == 0 ? wv[t].x : wv[t].z;
        const uint32_t b1 = step == 0 ? wv[t].y : wv[t].w;
        WeightMma<W>::run(c[t], hi, lo, b0, b1);
    }
}

// out[at] = v, or out[at] += v (the residual add after the product's own
// rounding, as a separate add would) when p.accumulate.
__device__ __forceinline__ void lmma_store(const LinearMmaParams& p, uint64_t at, float v) {
    p.out[at] = p.accumulate ? p.out[at] + v : v;
}

// RT row tiles of 16 and NT n-tiles of 8 per block, UNROLL k-blocks of
// loads in flight per warp; NORM: x is RMSNorm(x) * p.norm_w; PAIR: n-tiles
// t and t + NT / 2 are the gate (p.w) and the up (p.w_up) of the same
// columns, stored as SwiGLU. grid (ceil(n / (8 NT)), ceil(m / (16 RT))),
// with PAIR ceil(n / (4 NT)) column blocks; block LMMA_THREADS.
template <typename T, int RT, int NT, int UNROLL, bool NORM, bool PAIR>
__device__ __forceinline__ void linear_mma_tiles_as(const LinearMmaParams& p, uint32_t bx) {
    static_assert(NT % 2 == 0, "a SwiGLU pair takes half the n-tiles each");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int group = lane >> 2, tid = lane & 3;
    LmmaSmem<RT, NT>& s = lmma_smem<RT, NT>();
    // This lane's rows: r0 + 16 rt and r0 + 16 rt + 8 of row tile rt.
    const uint64_t r0 = (uint64_t)blockIdx.y * (16 * RT) + group;
    const uint64_t n0 = (uint64_t)bx * (PAIR ? 4 * NT : 8 * NT);
    const bool x_vec = p.k % 4 == 0 && reinterpret_cast<uintptr_t>(p.x) % 16 == 0;
    const bool w_vec = p.k % 8 == 0 && reinterpret_cast<uintptr_t>(p.w) % 16 == 0 &&
                       (!PAIR || reinterpret_cast<uintptr_t>(p.w_up) % 16 == 0);
    const uint32_t kblocks = (p.k + LMMA_KB - 1) / LMMA_KB;
    // RMSNorm: each row's scale, its squares summed as rms_norm sums them
    // (this block's RMS_THREADS threads, the same order, the same
    // block_sum), then this lane's rows' scales.
    float scale[RT][2];
#pragma unroll
    for (int rt = 0; rt < RT; ++rt) scale[rt][0] = scale[rt][1] = 0.0f;
    if (NORM) {
        const uint64_t rb = (uint64_t)blockIdx.y * (16 * RT);
        for (int lr = 0; lr < 16 * RT && rb + lr < p.m; ++lr) {
            const float ss = block_sum(rms_partial(p.x + (rb + lr) * p.k, p.k, threadIdx.x));
            if (threadIdx.x == 0) s.scale[lr] = rms_scale(ss, p.k, p.norm_eps);
        }
        __syncthreads();
#pragma unroll
        for (int rt = 0; rt < RT; ++rt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int lr = 16 * rt + 8 * h + group;
                if (rb + lr < p.m) scale[rt][h] = s.scale[lr];
            }
    }
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
                // A pair's n-tile t reads the gate's rows, t + NT / 2 the up's.
                const void* w = PAIR && t >= NT / 2 ? p.w_up : p.w;
                const uint64_t n = n0 + (PAIR ? t % (NT / 2) : t) * 8 + group;
                wv[u][t] = live ? lmma_w8(p, w, n, c0, w_vec) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int rt = 0; rt < RT; ++rt) {
                const uint64_t ra = r0 + 16 * rt;
                lmma_x8<NORM>(p, live ? ra : p.m, c0, x_vec, scale[rt][0], xv[u][rt][0]);
                lmma_x8<NORM>(p, live ? ra + 8 : p.m, c0, x_vec, scale[rt][1], xv[u][rt][1]);
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
                    lmma_step<T, NT>(a, wv[u], step, c[rt]);
                }
            }
        }
    }
    // The warps' partial sums, added in warp order by warp 0.
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
            for (int i = 0; i < 4; ++i) s.part[warp][rt][t][i][lane] = c[rt][t][i];
    __syncthreads();
    if (warp != 0) return;
    auto sum = [&](int rt, int t, int i) {
        float v = s.part[0][rt][t][i][lane];
        for (int w = 1; w < LMMA_WARPS; ++w) v += s.part[w][rt][t][i][lane];
        return v;
    };
    // C fragment: c0 c1 (row group, cols 2 tid, +1), c2 c3 (row group + 8).
#pragma unroll
    for (int rt = 0; rt < RT; ++rt) {
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (PAIR && t >= NT / 2) break;  // the up halves: read with their gates
            const uint64_t col = n0 + t * 8 + 2 * tid;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                // A pair stores SwiGLU of the gate's and the up's sums, as
                // swiglu does of the two products' outputs.
                const float v = PAIR ? swiglu_of(sum(rt, t, i), sum(rt, t + NT / 2, i)) : sum(rt, t, i);
                const uint64_t r = r0 + 16 * rt + (i < 2 ? 0 : 8), j = col + (i & 1);
                if (r < p.m && j < p.n) lmma_store(p, r * p.n + j, v);
            }
        }
    }
}

// linear_mma_tiles_as with the stages p asks to carry (one compiled form
// each, so that a plain product runs the code it ran before there were
// stages to carry).
template <typename T, int RT, int NT, int UNROLL>
__device__ __forceinline__ void linear_mma_tiles(const LinearMmaParams& p, uint32_t bx) {
    if (p.norm_w != nullptr) {  // block-uniform, as below
        if (p.w_up != nullptr) {
            linear_mma_tiles_as<T, RT, NT, UNROLL, true, true>(p, bx);
        } else {
            linear_mma_tiles_as<T, RT, NT, UNROLL, true, false>(p, bx);
        }
    } else if (p.w_up != nullptr) {
        linear_mma_tiles_as<T, RT, NT, UNROLL, false, true>(p, bx);
    } else {
        linear_mma_tiles_as<T, RT, NT, UNROLL, false, false>(p, bx);
    }
}

// grid (ceil(n / LMMA_BN), ceil(m / LMMA_BM)); block LMMA_THREADS.
template <typename T>
__device__ __forceinline__ void linear_mma_body(const LinearMmaParams& p) {
    linear_mma_tiles<T, LMMA_BM / 16, LMMA_BN / 8, 4>(p, blockIdx.x);
}

// grid (ceil(n / LMMA_WIDE_BN), ceil(m / LMMA_WIDE_BM)); block LMMA_THREADS.
template <typename T>
__device__ __forceinline__ void linear_mma_wide_body(const LinearMmaParams& p) {
    linear_mma_tiles<T, LMMA_WIDE_BM / 16, LMMA_WIDE_BN / 8, 2>(p, blockIdx.x);
}

// The prefill tile: LGEMM_BM rows x LGEMM_BN columns per block, warp
// (wm, wn) = (warp / 2, warp % 2) owning rows 32 wm .. + 32 and columns
// 32 wn .. + 32 of it (two row tiles, four n-tiles).
constexpr int LGEMM_BM = 128;
constexpr int LGEMM_BN = 64;
constexpr int LGEMM_STAGES = 3;
constexpr int LGEMM_XLD = LMMA_KB + 4;  // f32 per x row in shared memory: 16-byte
                                        // aligned, and rows g and g + 1 on other banks
struct LgemmCfg {
    static constexpr int X_STAGE = LGEMM_BM * LGEMM_XLD;  // f32 per stage of x
    static constexpr int W_STAGE = LGEMM_BN * LMMA_KB;    // bf16 per stage of w
    // Dynamic shared memory: the x stages [stage][row][LGEMM_XLD] (f32),
    // then the w stages [stage][column][LMMA_KB] (16-bit weights).
    static constexpr int SMEM_BYTES = LGEMM_STAGES * (X_STAGE * 4 + W_STAGE * 2);
};
static_assert(LMMA_WARPS == 8 && LGEMM_BM == 4 * 32 && LGEMM_BN == 2 * 32,
              "8 warps as 4 x 2 warp tiles of 32 x 32");

// Queues the block's copies of k-block kb of x rows m0 .. + LGEMM_BM and w
// rows n0 .. + LGEMM_BN into stage buffers xs [LGEMM_BM][LGEMM_XLD] and ws
// [LGEMM_BN][LMMA_KB]. Outside [m, n, k] they hold zeros. Chunks that are
// not whole 16-byte runs inside k (unaligned or odd k) are stored element by
// element, synchronously.
__device__ __forceinline__ void lgemm_stage(const LinearMmaParams& p, uint64_t m0, uint64_t n0,
                                            uint32_t kb, bool x_vec, bool w_vec, float* xs,
                                            uint16_t* ws) {
    const uint32_t c0 = kb * LMMA_KB;
    // x: LGEMM_BM rows x 8 chunks of 4 f32.
    for (uint32_t idx = threadIdx.x; idx < (uint32_t)LGEMM_BM * 8; idx += LMMA_THREADS) {
        const uint32_t row = idx / 8, c = c0 + (idx % 8) * 4;
        const uint64_t r = m0 + row;
        float* dst = xs + row * LGEMM_XLD + (idx % 8) * 4;
        const bool inside = r < p.m && c < p.k;
        if (x_vec || !inside) {
            // x_vec: k % 4 == 0, so a chunk starting inside k ends inside.
            cp_async_16(dst, inside ? p.x + r * p.k + c : p.x, inside);
        } else {
            const float* src = p.x + r * p.k;
#pragma unroll
            for (int i = 0; i < 4; ++i) dst[i] = c + i < p.k ? src[c + i] : 0.0f;
        }
    }
    // w: LGEMM_BN rows x 4 chunks of 8 bf16.
    const uint16_t* w = static_cast<const uint16_t*>(p.w);
    for (uint32_t idx = threadIdx.x; idx < (uint32_t)LGEMM_BN * 4; idx += LMMA_THREADS) {
        const uint32_t col = idx / 4, c = c0 + (idx % 4) * 8;
        const uint64_t n = n0 + col;
        uint16_t* dst = ws + col * LMMA_KB + (idx % 4) * 8;
        const bool inside = n < p.n && c < p.k;
        if (w_vec || !inside) {
            // w_vec: k % 8 == 0, so a chunk starting inside k ends inside.
            cp_async_16(dst, inside ? w + n * p.k + c : w, inside);
        } else {
            const uint16_t* src = w + n * p.k;
#pragma unroll
            for (int i = 0; i < 8; ++i) dst[i] = c + i < p.k ? src[c + i] : 0;
        }
    }
}

// lgemm_stage for rows of x and w on 16 bytes (k % 8 == 0, aligned bases),
// with what does not change from one k-block to the next worked out once:
// this thread's x chunks are rows r0 + 32 i (i < 4) at column cx of each
// k-block, its w chunk row n0 + tid / 4 at column cw.
struct LgemmVecLoader {
    const float* x;     // x[r0][cx]
    uint64_t x_stride;  // 32 rows of x
    const uint16_t* w;  // w[n0 + tid / 4][cw]
    uint32_t live;      // bit i: x row r0 + 32 i exists; bit 4: the w row does
    uint32_t cx, cw;    // column within a k-block

    __device__ __forceinline__ LgemmVecLoader(const LinearMmaParams& p, uint64_t m0, uint64_t n0) {
        const uint32_t t = threadIdx.x;
        const uint64_t r0 = m0 + t / 8, wn = n0 + t / 4;
        cx = (t % 8) * 4;
        cw = (t % 4) * 8;
        x_stride = 32 * (uint64_t)p.k;
        x = p.x + (r0 < p.m ? r0 * p.k : 0) + cx;
        w = static_cast<const uint16_t*>(p.w) + (wn < p.n ? wn * p.k : 0) + cw;
        live = wn < p.n ? 16u : 0u;
#pragma unroll
        for (int i = 0; i < 4; ++i) live |= r0 + 32 * i < p.m ? 1u << i : 0u;
    }

    // Queues k-block kb into stage buffers xs and ws (zeros outside m, n, k).
    __device__ __forceinline__ void stage(const LinearMmaParams& p, uint32_t kb, float* xs,
                                          uint16_t* ws) const {
        static_assert(LGEMM_BM * 8 == 4 * LMMA_THREADS && LGEMM_BN * 4 == LMMA_THREADS,
                      "four x chunks and one w chunk per thread");
        const uint32_t c0 = kb * LMMA_KB, t = threadIdx.x;
        const bool x_in_k = c0 + cx < p.k;
        float* xd = xs + (t / 8) * LGEMM_XLD + cx;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const bool fill = x_in_k && (live >> i & 1u);
            cp_async_16(xd + i * 32 * LGEMM_XLD, fill ? x + i * x_stride + c0 : p.x, fill);
        }
        const bool w_fill = c0 + cw < p.k && (live >> 4 & 1u);
        cp_async_16(ws + (t / 4) * LMMA_KB + cw, w_fill ? w + c0 : p.w, w_fill);
    }
};

// grid (ceil(n / LGEMM_BN), ceil(m / LGEMM_BM)); block LMMA_THREADS;
// LgemmCfg::SMEM_BYTES of dynamic shared memory.
template <typename T>
__device__ __forceinline__ void linear_mma_gemm_tiles(const LinearMmaParams& p, uint32_t bx) {
    constexpr int RT = 2, NT = 4;  // row tiles of 16 and n-tiles of 8 per warp
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int group = lane >> 2, tid = lane & 3;
    const int wm = warp >> 1, wn = warp & 1;
    const uint64_t m0 = (uint64_t)blockIdx.y * LGEMM_BM, n0 = (uint64_t)bx * LGEMM_BN;
    const bool x_vec = p.k % 4 == 0 && reinterpret_cast<uintptr_t>(p.x) % 16 == 0;
    const bool w_vec = p.k % 8 == 0 && reinterpret_cast<uintptr_t>(p.w) % 16 == 0;
    const uint32_t kblocks = (p.k + LMMA_KB - 1) / LMMA_KB;
    const bool all_vec = x_vec && w_vec;  // block-uniform
    const LgemmVecLoader vec_loader(p, m0, n0);
    float* x_s = reinterpret_cast<float*>(dyn_smem());  // [stage][LGEMM_BM][LGEMM_XLD]
    uint16_t* w_s = reinterpret_cast<uint16_t*>(x_s + LGEMM_STAGES * LgemmCfg::X_STAGE);
    // [stage][LGEMM_BN][LMMA_KB]

    // The k-blocks in phase order: phase w holds k-blocks w, w + 8, ...
    // `next` steps a k-block to the one after it (kblocks when none is).
    auto next = [&](uint32_t kb) -> uint32_t {
        kb += LMMA_WARPS;
        if (kb < kblocks) return kb;
        const uint32_t phase = kb % LMMA_WARPS + 1;
        return phase < (uint32_t)LMMA_WARPS && phase < kblocks ? phase : kblocks;
    };
    // Stage s of the pipeline holds the k-block at position s of that order.
    uint32_t load_kb = kblocks > 0 ? 0 : kblocks;
    auto load = [&](uint32_t s) {
        if (load_kb < kblocks) {
            const int st = s % LGEMM_STAGES;
            float* xs = x_s + st * LgemmCfg::X_STAGE;
            uint16_t* ws = w_s + st * LgemmCfg::W_STAGE;
            if (all_vec) {
                vec_loader.stage(p, load_kb, xs, ws);
            } else {
                lgemm_stage(p, m0, n0, load_kb, x_vec, w_vec, xs, ws);
            }
            load_kb = next(load_kb);
        }
        cp_async_commit();  // an empty group past the last k-block keeps the count in step
    };
#pragma unroll
    for (int s = 0; s < LGEMM_STAGES - 1; ++s) load(s);

    float acc[RT][NT][4], run[RT][NT][4];
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[rt][t][i] = run[rt][t][i] = 0.0f;

    uint32_t kb = 0, phases = 0;  // phases summed into run so far
    for (uint32_t s = 0; s < kblocks; ++s) {
        cp_async_wait<LGEMM_STAGES - 2>();  // stage s has landed (this thread's copies)
        __syncthreads();                    // ... and every thread's; stage s - 1 is free
        load(s + LGEMM_STAGES - 1);
        const int st = s % LGEMM_STAGES;
        const float* xs = x_s + st * LgemmCfg::X_STAGE;
        const uint16_t* ws = w_s + st * LgemmCfg::W_STAGE;
        // This lane's chunk of each of its weight rows: the k of both steps.
        uint4 wv[NT];
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            wv[t] = *reinterpret_cast<const uint4*>(ws + (wn * 32 + t * 8 + group) * LMMA_KB + 8 * tid);
        }
#pragma unroll
        for (int step = 0; step < 2; ++step) {
#pragma unroll
            for (int rt = 0; rt < RT; ++rt) {
                // Rows ra and ra + 8, chunk elements 4 step .. + 4: as the
                // other tiles' A fragment.
                const float* xr = xs + (wm * 32 + rt * 16 + group) * LGEMM_XLD + 8 * tid + 4 * step;
                const float4 ya = *reinterpret_cast<const float4*>(xr);
                const float4 yb = *reinterpret_cast<const float4*>(xr + 8 * LGEMM_XLD);
                const float a[8] = {ya.x, ya.y, yb.x, yb.y, ya.z, ya.w, yb.z, yb.w};
                lmma_step<T, NT>(a, wv, step, acc[rt]);
            }
        }
        // The end of a phase: add its sum to run, as the other tiles add
        // warp partial sums.
        if (kb + LMMA_WARPS >= kblocks) {
#pragma unroll
            for (int rt = 0; rt < RT; ++rt)
#pragma unroll
                for (int t = 0; t < NT; ++t)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        run[rt][t][i] = phases == 0 ? acc[rt][t][i] : run[rt][t][i] + acc[rt][t][i];
                        acc[rt][t][i] = 0.0f;
                    }
            ++phases;
        }
        kb = next(kb);
    }
    cp_async_wait<0>();  // only empty groups remain
    // The phases with no k-block (k < 8 k-blocks): the other tiles' idle
    // warps add their zero sums too (x + 0 is not always x: -0 + 0 is +0).
    // (None for phase 0: with no k-block at all, run is their warp 0's +0.)
    for (uint32_t w = phases > 0 ? phases : 1; w < (uint32_t)LMMA_WARPS; ++w) {
#pragma unroll
        for (int rt = 0; rt < RT; ++rt)
#pragma unroll
            for (int t = 0; t < NT; ++t)
#pragma unroll
                for (int i = 0; i < 4; ++i) run[rt][t][i] += 0.0f;
    }
    // C fragment: c0 c1 (row group, cols 2 tid, +1), c2 c3 (row group + 8).
#pragma unroll
    for (int rt = 0; rt < RT; ++rt) {
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            const uint64_t col = n0 + wn * 32 + t * 8 + 2 * tid;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const uint64_t r = m0 + wm * 32 + rt * 16 + group + (i < 2 ? 0 : 8), j = col + (i & 1);
                if (r < p.m && j < p.n) lmma_store(p, r * p.n + j, run[rt][t][i]);
            }
        }
    }
}

template <typename T>
__device__ __forceinline__ void linear_mma_gemm_body(const LinearMmaParams& p) {
    linear_mma_gemm_tiles<T>(p, blockIdx.x);
}

// A group launch's product for this block, and the block's column block in
// it (the same for every thread of the block).
__device__ __forceinline__ LinearMmaParams lmma_group(const LinearMmaGroupParams& g, uint32_t& bx) {
    LinearMmaParams p{g.x, g.w0, g.out0, g.norm_w, nullptr, g.m, g.n0, g.k, 0, g.norm_eps, 0};
    bx = blockIdx.x;
    if (g.n_groups >= 2 && bx >= g.blocks0) {
        bx -= g.blocks0;
        p.w = g.w1, p.out = g.out1, p.n = g.n1;
        if (g.n_groups == 3 && bx >= g.blocks1) {
            bx -= g.blocks1;
            p.w = g.w2, p.out = g.out2, p.n = g.n2;
        }
    }
    return p;
}

// The group launches of the three tiles: grid (blocks0 + blocks1 + blocks of
// product 2, ceil(m / the tile's rows)).
template <typename T>
__device__ __forceinline__ void linear_mma_group_body(const LinearMmaGroupParams& g) {
    uint32_t bx;
    const LinearMmaParams p = lmma_group(g, bx);
    linear_mma_tiles<T, LMMA_BM / 16, LMMA_BN / 8, 4>(p, bx);
}

template <typename T>
__device__ __forceinline__ void linear_mma_wide_group_body(const LinearMmaGroupParams& g) {
    uint32_t bx;
    const LinearMmaParams p = lmma_group(g, bx);
    linear_mma_tiles<T, LMMA_WIDE_BM / 16, LMMA_WIDE_BN / 8, 2>(p, bx);
}

template <typename T>
__device__ __forceinline__ void linear_mma_gemm_group_body(const LinearMmaGroupParams& g) {
    uint32_t bx;
    const LinearMmaParams p = lmma_group(g, bx);
    linear_mma_gemm_tiles<T>(p, bx);
}

}  // namespace handoff
