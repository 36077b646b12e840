// Paged decode attention on tensor cores (mma.sync m16n8k16, f16 or bf16
// KV, f32 accumulate), with each warp streaming its K/V tiles through a
// cp.async pipeline in shared memory. FP8 E4M3 KV streams its bytes the same
// way (half the bytes a tile, so 4 stages in the same shared memory), and
// each landed tile is widened in shared memory to the f16 tile the 16-bit
// path reads (every E4M3 value is an f16): from there it is the f16 kernel.
//
// Why tensor cores for one query token: the scalar kernel
// (decode_attention.cuh) spends, per KV position, GROUP dot products and
// GROUP x log2(threads per row) shuffles on every 2 x head_dim bytes it
// reads; at GQA 8:1 that is about as many instructions as an SM can issue
// while HBM delivers the bytes, and it read 0.33 of copy bandwidth. Here a
// warp scores 16 positions for 8 heads with head_dim / 16 mma per n-tile of
// 8 positions, and weights V with head_dim / 8 mma per 16 positions.
//
// Grid and chunks as the scalar kernel: one block per (split, KV head x
// head slice, sequence), same DecodeParams, same chunk of each sequence
// from its own length, same outputs (out, or part_o / part_lse for
// decode_merge). A block serves GROUP = 8 x OCT query heads of one KV head
// (OCT octets of 8 heads; a larger ratio runs in slices).
//
// Each of the 4 warps (8 in the wide form, decode_mma_wide) takes every 4th
// (8th) tile of TILE = 16 positions of the chunk and keeps its own online
// softmax; the warps are combined through shared memory at the end. A
// warp's tiles go through STAGES shared-memory stages ([K|V][TILE][HEAD_DIM]
// each): while it computes tile i, the copies of tiles i+1 .. i+STAGES-1
// are in flight. Positions at or beyond the
// chunk's end are zero-filled by the copy, never read, and masked.
//
// Precision, close to the scalar f32 kernel: Q is split into hi + lo (each
// rounded to the KV dtype), and so is every softmax weight P. Rows 0-7 of
// the mma's A operand are an octet's 8 heads' hi parts and rows 8-15 their
// lo parts, so one mma computes both and the lane that holds row g also
// holds row g + 8: score = c[0] + c[2]. Products of 16-bit values are exact
// in f32, sums are f32.
//
// Fragments (PTX ISA, m16n8k16 .row.col): lane = 4 g + t.
//   S = Q Kᵀ: B[k][n] = K[position n][dim]. The order of the dims inside a
//     k-step is free as long as Q uses the same, so lane t takes one whole
//     16-byte chunk c = 4 (ks / 2) + t of K row n = g (8 dims: pairs 0,1
//     for k-step ks even, pairs 2,3 for ks odd), and Q's A fragment puts
//     those dims at the same k.
//   P V: A = P from S's accumulators (n-tiles 0 and 1 are k 0-7 and 8-15),
//     B[k][n] = V[position k][dim n] by ldmatrix.trans.
// Shared rows are 16-byte chunks swizzled by chunk ^ swz(row), swz(row) =
// (row & 1) << 2 | (row >> 1) & 3, so that both the K reads (rows 2j, 2j+1
// x chunks 4s..4s+3 per 8 lanes) and ldmatrix (8 rows of one chunk) are
// free of bank conflicts.
//
// The body lives in this header so that tests/cuda/decode_host.rs runs it
// on the host SIMT emulator (with cp.async landing late, see
// tests/support/sim/simt_host.h) against an f64 reference; decode_mma.cu
// instantiates it for the GPU.
#pragma once
#include "common.cuh"
#ifndef HANDOFF_SIMT_HOST
#include "mma.cuh"
#endif
#include "decode_attention.cuh"  // decode_heads, decode_chunk, decode_combine_store
#include "params.cuh"
#include "pipeline.cuh"

namespace handoff {

constexpr int DMMA_WARPS = 4;
constexpr int DMMA_THREADS = DMMA_WARPS * 32;
// The wide kernel (decode_mma_wide): twice the warps, each with its own
// stages, so a block has twice the tiles in flight and a chunk's tiles
// take half as many turns per warp. Where blocks are few (batch 1: one
// block or fewer per SM), a block's time is its warps' chains of tiles
// (about 1 us per tile on an H200, bound by instruction latency), and this
// halves it. Its bits differ from the 4-warp kernel's (each warp's online
// softmax runs over other tiles), and are the same in any batch.
constexpr int DMMA_WIDE_WARPS = 8;
constexpr int DMMA_WIDE_THREADS = DMMA_WIDE_WARPS * 32;
constexpr int DMMA_TILE = 16;   // positions per warp tile
constexpr int DMMA_STAGES = 3;  // tiles per warp in shared memory

template <int HEAD_DIM, int WARPS = DMMA_WARPS>
struct DmmaCfg {
    static constexpr int CHUNKS = HEAD_DIM / 8;  // 16-byte chunks per 16-bit row
    static constexpr int KSTEPS = HEAD_DIM / 16;
    static constexpr int DTILES = HEAD_DIM / 8;
    static constexpr int TILE_ELEMS = DMMA_TILE * HEAD_DIM;              // K or V of one tile
    static constexpr int WARP_ELEMS = DMMA_STAGES * 2 * TILE_ELEMS;      // one warp's stages
    static constexpr int SMEM_BYTES = WARPS * WARP_ELEMS * 2;           // 2-byte elements
    static_assert(HEAD_DIM % 32 == 0, "chunks 4s + t of every k-step pair");
    static_assert(DMMA_TILE * CHUNKS % 32 == 0, "whole copies per lane");
    // The combine (out of the stages, after they are drained): 16 heads.
    static_assert(WARPS * 16 * (HEAD_DIM + 2) * 4 <= SMEM_BYTES, "combine fits");
};

// The wide kernel's (the table names a config by head_dim alone).
template <int HEAD_DIM>
using DmmaWideCfg = DmmaCfg<HEAD_DIM, DMMA_WIDE_WARPS>;

__device__ __forceinline__ int dmma_swz(int row) { return ((row & 1) << 2) | ((row >> 1) & 3); }

// The hi and lo parts of x in T: x ~ hi + lo.
template <typename T>
__device__ __forceinline__ void split_hi_lo(float x, float& hi, float& lo) {
    hi = to_float(from_float<T>(x));
    lo = x - hi;
}

// WARPS warps a block (DMMA_WARPS, or DMMA_WIDE_WARPS for the wide kernel).
template <typename T, int HEAD_DIM, int GROUP, int WARPS = DMMA_WARPS>
__device__ __forceinline__ void decode_mma(const DecodeParams& p) {
    using C = DmmaCfg<HEAD_DIM, WARPS>;
    using M = MmaOperand<T>;  // what the mma multiplies
    constexpr bool F8 = sizeof(T) == 1;
    // FP8 stages take half the bytes: 4 of them and the f16 tile they are
    // widened into fill the shared memory of 3 16-bit stages.
    constexpr int STAGES = F8 ? DMMA_STAGES + 1 : DMMA_STAGES;
    constexpr int EPC = 16 / (int)sizeof(T);  // elements per 16-byte chunk
    constexpr int SCH = HEAD_DIM / EPC;       // 16-byte chunks per stored row
    static_assert(STAGES * 2 * C::TILE_ELEMS * (int)sizeof(T) + (F8 ? 2 * C::TILE_ELEMS * 2 : 0) <=
                      C::WARP_ELEMS * 2,
                  "a warp's stages (and FP8's f16 tile) fit its shared memory");
    constexpr int THREADS = WARPS * 32;
    constexpr int OCT = GROUP / 8;
    constexpr int KSTEPS = C::KSTEPS, DTILES = C::DTILES;
    static_assert(GROUP % 8 == 0 && OCT >= 1 && OCT <= 2, "octets of 8 heads");
    pdl_launch_dependents();  // the merge may be scheduled (it waits for the end)

    const uint32_t split = blockIdx.x, b = blockIdx.z;
    uint32_t kvh, h0;
    int here;
    decode_heads<GROUP>(p, kvh, h0, here);  // heads kvh * group + h0 + g, g < here
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;

    // This sequence's chunk, from its own length only (decode_attention.cuh).
    uint32_t begin, end;
    decode_chunk(p, p.kv_len[b], split, begin, end);
    const uint32_t n_tiles = end > begin ? (end - begin + DMMA_TILE - 1) / DMMA_TILE : 0;
    // This warp's tiles: warp, warp + WARPS, ...
    const uint32_t mine = n_tiles > (uint32_t)warp ? (n_tiles - warp + WARPS - 1) / WARPS : 0;

    const uint32_t* pages = p.page_table + p.page_indptr[b];
    const T* kv = static_cast<const T*>(p.kv);
    const uint32_t kv_dim = p.n_kv_heads * HEAD_DIM;
    const uint32_t slot_mask = (1u << p.page_size_log2) - 1u;
    const uint64_t k_in_page =
        kv_page_offset(0, 0, p.layer, 0, p.page_size_log2, kv_dim) + kvh * HEAD_DIM;
    const uint64_t k_to_v = ((uint64_t)1 << p.page_size_log2) * kv_dim;
    // This warp's stages: [STAGES][K|V][DMMA_TILE][HEAD_DIM] of T, rows
    // swizzled (16-bit) or not (FP8: only the widening reads them, in
    // order); for FP8, then the f16 tile [K|V][DMMA_TILE][HEAD_DIM], rows
    // swizzled, that the fragments are read from.
    unsigned char* warp_smem = dyn_smem() + warp * C::WARP_ELEMS * 2;
    T* stages = reinterpret_cast<T*>(warp_smem);
    M* wide = reinterpret_cast<M*>(warp_smem + STAGES * 2 * C::TILE_ELEMS * sizeof(T));

    // Queues the copies of this warp's i-th tile into stage i % STAGES and
    // closes the group (an empty one past the last tile, so that every
    // lane's group count stays in step with the loop). Lane l copies the
    // 16-byte chunk l % SCH of rows RPJ j + l / SCH, j < JOBS.
    constexpr int RPJ = 32 / SCH;                 // rows per lane step
    constexpr int JOBS = DMMA_TILE * SCH / 32;    // lane steps per tile
    static_assert(DMMA_TILE * SCH % 32 == 0, "whole copies per lane");
    const int lane_ch = lane % SCH, lane_row = lane / SCH;
    const uint64_t lane_off = (uint64_t)lane_row * kv_dim + lane_ch * EPC;
    // Where lane step j's chunk lands in a stage: the same for every tile,
    // so worked out once.
    int lane_at[JOBS];
#pragma unroll
    for (int j = 0; j < JOBS; ++j) {
        const int row = RPJ * j + lane_row;
        lane_at[j] = row * HEAD_DIM + (F8 ? lane_ch : lane_ch ^ dmma_swz(row)) * EPC;
    }
    const uint32_t row_step = RPJ * kv_dim;  // elements between a lane's rows
    // First position of this warp's i-th tile.
    auto tile_start = [&](uint32_t i) { return begin + (warp + i * WARPS) * DMMA_TILE; };
    // The page-table entry of the first position of the next tile to issue,
    // read one issue ahead: its latency passes during a tile's compute
    // instead of stalling the copies that need it.
    uint32_t next_page = mine > 0 ? pages[tile_start(0) >> p.page_size_log2] : 0;
    auto issue = [&](uint32_t i) {
        if (i < mine) {
            const uint32_t t0 = tile_start(i);
            const uint32_t page = next_page;
            if (i + 1 < mine) next_page = pages[tile_start(i + 1) >> p.page_size_log2];
            T* ks = stages + (i % STAGES) * 2 * C::TILE_ELEMS;
            if ((t0 + DMMA_TILE - 1) >> p.page_size_log2 == t0 >> p.page_size_log2) {
                // The whole tile in one page (every tile of pages of 16 or
                // more with chunks on 16 positions): the entry read ahead,
                // then a fixed stride per row.
                // Every row's address lies inside that page, so it is a
                // valid one whether or not the row is copied (a row at or
                // past `end` is zero-filled, its bytes never read).
                const T* src = kv + (uint64_t)page * p.page_stride + k_in_page +
                               (uint64_t)(t0 & slot_mask) * kv_dim + lane_off;
#pragma unroll
                for (int j = 0; j < JOBS; ++j) {
                    const bool fill = t0 + RPJ * j + lane_row < end;
                    cp_async_16(ks + lane_at[j], src, fill);
                    cp_async_16(ks + C::TILE_ELEMS + lane_at[j], src + k_to_v, fill);
                    src += row_step;
                }
            } else {
                // A tile across pages: each row finds its own.
#pragma unroll
                for (int j = 0; j < JOBS; ++j) {
                    const int row = RPJ * j + lane_row;
                    const uint32_t pos = t0 + row;
                    const bool fill = pos < end;
                    const T* src = kv;  // read nothing when !fill
                    if (fill) {
                        const uint64_t page = pages[pos >> p.page_size_log2];
                        src = kv + page * p.page_stride + k_in_page +
                              (uint64_t)(pos & slot_mask) * kv_dim + lane_ch * EPC;
                    }
                    cp_async_16(ks + lane_at[j], src, fill);
                    cp_async_16(ks + C::TILE_ELEMS + lane_at[j], fill ? src + k_to_v : kv, fill);
                }
            }
        }
        cp_async_commit();
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) issue(s);

    // Q's A fragments, per octet and k-step: rows g (hi) and g + 8 (lo) of
    // head h0 + 8 o + g, the dims of chunk 4 (ks / 2) + t (see the top).
    // Heads past `here` are zero and never written.
    uint32_t qa[OCT][KSTEPS][4];
#pragma unroll
    for (int o = 0; o < OCT; ++o) {
        const bool real = 8 * o + g < here;
        const uint32_t head = kvh * p.group + h0 + 8 * o + g;
        const float* qp = p.q + ((uint64_t)b * p.n_heads + (real ? head : 0)) * HEAD_DIM;
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            const int d0 = 8 * (4 * (ks / 2) + t) + 4 * (ks % 2);
            float hi[4], lo[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                split_hi_lo<M>(real ? qp[d0 + i] * p.sm_scale_log2 : 0.0f, hi[i], lo[i]);
            }
            qa[o][ks][0] = MmaOp<M>::pack(hi[0], hi[1]);
            qa[o][ks][1] = MmaOp<M>::pack(lo[0], lo[1]);
            qa[o][ks][2] = MmaOp<M>::pack(hi[2], hi[3]);
            qa[o][ks][3] = MmaOp<M>::pack(lo[2], lo[3]);
        }
    }

    // Online softmax state of head 8 o + g: m is shared by the lane's quad,
    // l is this lane's part (summed over the quad at the end), acc rows g
    // (from P's hi part) and g + 8 (lo) of the output's 16 x 8 d-tiles.
    float m[OCT], l[OCT], acc[OCT][DTILES][4];
#pragma unroll
    for (int o = 0; o < OCT; ++o) {
        m[o] = -INFINITY;
        l[o] = 0.0f;
#pragma unroll
        for (int dt = 0; dt < DTILES; ++dt) acc[o][dt][0] = acc[o][dt][1] = acc[o][dt][2] = acc[o][dt][3] = 0.0f;
    }
    // A non-finite score of a real head at a real position makes the head's
    // output NaN (as in decode_attention.cuh).
    bool bad = false;

    for (uint32_t i = 0; i < mine; ++i) {
        cp_async_wait<STAGES - 2>();  // tile i has landed (this lane's copies)
        __syncwarp();                 // ... and every lane's
        issue(i + STAGES - 1);        // into the stage tile i - 1 used
        const T* landed = stages + (i % STAGES) * 2 * C::TILE_ELEMS;
        const M* ks;
        if constexpr (F8) {
            // Widen the landed K and V to f16 in the swizzled layout of the
            // 16-bit stages: lane l takes 16-byte chunks l, l + 32, ... of
            // the tile (row-major, K then V), each 16 values, which are the
            // f16 chunks 2 c and 2 c + 1 of its row. The last tile's reads of
            // `wide` ended before the __syncwarp above.
#pragma unroll
            for (int c = lane; c < 2 * DMMA_TILE * SCH; c += 32) {
                const int half = c / (DMMA_TILE * SCH), row = c / SCH % DMMA_TILE, ch = c % SCH;
                const uint4 raw = *reinterpret_cast<const uint4*>(landed + c * EPC);
                uint4 lo, hi;
                fp8x16_to_half(raw, lo, hi);
                M* dst = wide + half * C::TILE_ELEMS + row * HEAD_DIM;
                *reinterpret_cast<uint4*>(dst + ((2 * ch) ^ dmma_swz(row)) * 8) = lo;
                *reinterpret_cast<uint4*>(dst + ((2 * ch + 1) ^ dmma_swz(row)) * 8) = hi;
            }
            __syncwarp();
            ks = wide;
        } else {
            ks = landed;
        }
        const M* vs = ks + C::TILE_ELEMS;
        const uint32_t t0 = tile_start(i);

        // S for positions nt * 8 + n of the tile, both octets.
        float s[OCT][2][4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
            for (int o = 0; o < OCT; ++o) s[o][nt][0] = s[o][nt][1] = s[o][nt][2] = s[o][nt][3] = 0.0f;
            const int row = nt * 8 + g;
#pragma unroll
            for (int sp = 0; sp < KSTEPS / 2; ++sp) {
                const uint4 kx = *reinterpret_cast<const uint4*>(
                    ks + row * HEAD_DIM + ((4 * sp + t) ^ dmma_swz(row)) * 8);
#pragma unroll
                for (int o = 0; o < OCT; ++o) {
                    MmaOp<M>::run(s[o][nt], qa[o][2 * sp], kx.x, kx.y);
                    MmaOp<M>::run(s[o][nt], qa[o][2 * sp + 1], kx.z, kx.w);
                }
            }
        }

#pragma unroll
        for (int o = 0; o < OCT; ++o) {
            // Scores of head 8 o + g at positions nt * 8 + 2 t + e.
            float sc[2][2];
            float mx = -INFINITY;
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const bool valid = t0 + nt * 8 + 2 * t + e < end;
                    const float v = s[o][nt][e] + s[o][nt][2 + e];
                    if (valid && 8 * o + g < here && !isfinite(v)) bad = true;
                    sc[nt][e] = valid ? v : -INFINITY;
                    mx = fmaxf(mx, sc[nt][e]);
                }
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(m[o], mx);
            const float base = m_new == -INFINITY ? 0.0f : m_new;
            const float alpha = fast_exp2(m[o] - base);  // 0 when m[o] is -inf
            m[o] = m_new;
            float pw[2][2], hi[2][2], lo[2][2];
            float sum = 0.0f;
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    pw[nt][e] = fast_exp2(sc[nt][e] - base);  // 0 for masked positions
                    sum += pw[nt][e];
                    split_hi_lo<M>(pw[nt][e], hi[nt][e], lo[nt][e]);
                }
            }
            l[o] = l[o] * alpha + sum;
            // Rescale only when some head's maximum moved (alpha is exactly
            // 1 otherwise, and x * 1 is x: the same bits either way).
            if (__any_sync(0xffffffffu, alpha != 1.0f)) {
#pragma unroll
                for (int dt = 0; dt < DTILES; ++dt) {
#pragma unroll
                    for (int r = 0; r < 4; ++r) acc[o][dt][r] *= alpha;
                }
            }
            uint32_t pa[4];
            pa[0] = MmaOp<M>::pack(hi[0][0], hi[0][1]);
            pa[1] = MmaOp<M>::pack(lo[0][0], lo[0][1]);
            pa[2] = MmaOp<M>::pack(hi[1][0], hi[1][1]);
            pa[3] = MmaOp<M>::pack(lo[1][0], lo[1][1]);
            // O += P V, two d-tiles per ldmatrix: matrices (positions 0-7 |
            // 8-15) x (chunk 2 j | 2 j + 1); this lane names row r8 of
            // matrix lane / 8.
            const int mi = lane >> 3, r8 = lane & 7;
            const int vrow = r8 + (mi & 1) * 8;
#pragma unroll
            for (int j = 0; j < DTILES / 2; ++j) {
                const int ch = 2 * j + (mi >> 1);
                uint32_t vb[4];
                ldmatrix_x4_trans(vb, vs + vrow * HEAD_DIM + (ch ^ dmma_swz(vrow)) * 8);
                MmaOp<M>::run(acc[o][2 * j], pa, vb[0], vb[1]);
                MmaOp<M>::run(acc[o][2 * j + 1], pa, vb[2], vb[3]);
            }
        }
    }
    cp_async_wait<0>();  // only empty groups remain; drained before the stages are reused

    // Combine the warps: [WARPS][GROUP][HEAD_DIM] outputs, then m and l.
    float* sm_o = reinterpret_cast<float*>(dyn_smem());
    float* sm_m = sm_o + WARPS * GROUP * HEAD_DIM;
    float* sm_l = sm_m + WARPS * GROUP;
    __syncthreads();  // every warp is done with its stages
#pragma unroll
    for (int o = 0; o < OCT; ++o) {
        float lq = l[o];
        lq += __shfl_xor_sync(0xffffffffu, lq, 1);
        lq += __shfl_xor_sync(0xffffffffu, lq, 2);
        const int h = 8 * o + g;
        float* dst = sm_o + (warp * GROUP + h) * HEAD_DIM + 2 * t;
#pragma unroll
        for (int dt = 0; dt < DTILES; ++dt) {
            dst[dt * 8] = acc[o][dt][0] + acc[o][dt][2];
            dst[dt * 8 + 1] = acc[o][dt][1] + acc[o][dt][3];
        }
        if (t == 0) {
            sm_m[warp * GROUP + h] = m[o];
            sm_l[warp * GROUP + h] = lq;
        }
    }
    const bool any_bad = __syncthreads_or(bad) != 0;
    decode_combine_store<HEAD_DIM, THREADS>(
        p, b, kvh, h0, split, here, WARPS, any_bad, [&](int w, int h) { return sm_m[w * GROUP + h]; },
        [&](int w, int h) { return sm_l[w * GROUP + h]; },
        [&](int w, int h, int d) { return sm_o[(w * GROUP + h) * HEAD_DIM + d]; });
}

// The wide kernel: decode_mma with DMMA_WIDE_WARPS warps.
template <typename T, int HEAD_DIM, int GROUP>
__device__ __forceinline__ void decode_mma_wide(const DecodeParams& p) {
    decode_mma<T, HEAD_DIM, GROUP, DMMA_WIDE_WARPS>(p);
}

}  // namespace handoff
