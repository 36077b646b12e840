// Paged causal prefill attention on tensor cores (mma.sync m16n8k16, f16 or
// bf16 inputs, f32 accumulate), FlashAttention-2 style: one block owns a
// tile of query rows, walks the K/V tiles once with an online softmax and
// keeps its output in registers.
//
// Rows are (query position, query head) pairs of the heads sharing one KV
// head, as in prefill_attention.cu (the scalar reference, which also serves
// f32 KV and the other head dims): row r of the block is position
// q0 + r / group, head kvh * group + r % group, so each K/V tile is loaded
// once for the whole group. Each of the 4 warps owns 16 rows
// (PMMA_BM = 64 per block); K/V tiles hold PMMA_BN = 64 positions. The
// wide form (prefill_mma_wide) gives each warp two m-tiles of 16 rows
// (PMMA_WIDE_BM = 128 per block): each K/V tile copied once for twice the
// rows, each K and V fragment feeding two mma, Q's fragments re-read from
// shared memory per k-step instead of held in registers.
//
// K/V tiles are double-buffered: the block's cp.async copies of tile i + 1
// (cuda/pipeline.cuh) are in flight while its warps compute on tile i.
//
// Per warp and K/V tile:
//   S = Q Kᵀ    A = Q (16 x 16 dims, registers, loaded once), B = Kᵀ from
//               shared memory by ldmatrix (two k-steps of one n-tile per
//               x4); 8 n-tiles of 8 keys, HEAD_DIM / 16 k-steps.
//   online softmax on S in registers (log2 domain; Q is pre-scaled by
//               log2(e) / sqrt(head_dim)); each thread holds 2 rows, the
//               4 lanes of a quad share them (row max/sum by 2 shuffles).
//   O += P V    A = P, reused from S's accumulator layout (two adjacent
//               n-tiles of S form one 16 x 16 A fragment), converted to the
//               KV dtype; B = V from shared memory by ldmatrix.trans (two
//               d-tiles per x4).
// Keys at or beyond the block's last causal position are never loaded
// (their shared rows are zero-filled); keys past a row's own position are
// masked to -inf before the softmax. Warps whose rows all lie before a tile
// skip it.
//
// Precision: Q (f32 in memory) and P are rounded to the KV dtype for the
// mma; products and sums are f32. See tests/cuda_kernels.rs for the
// tolerance this implies.
//
// FP8 E4M3 KV: the copies bring its bytes (rows unpadded: only the
// widening reads them), and after each tile lands the block widens it to
// an f16 K/V tile in the padded layout the 16-bit path reads (every E4M3
// value is an f16); from there it is the f16 kernel, Q and P in f16.
//
// The kernel body lives in this header so that tests/prefill_mma_host.rs can
// also compile it on the host, with HANDOFF_SIMT_HOST defined, against a
// SIMT emulator (tests/support/sim/simt_host.h: 128 threads per block, barriers for
// __syncthreads and shuffles, mma.sync computed from the PTX fragment
// layout). prefill_mma.cu instantiates it for the GPU.
#pragma once
#include "common.cuh"
#ifndef HANDOFF_SIMT_HOST
#include "mma.cuh"
#endif
#include "params.cuh"
#include "pipeline.cuh"

namespace handoff {


constexpr int PMMA_WARPS = 4;
constexpr int PMMA_THREADS = PMMA_WARPS * 32;
constexpr int PMMA_BM = PMMA_WARPS * 16;  // rows per block (2x for the wide kernel)
constexpr int PMMA_WIDE_BM = 2 * PMMA_BM;
constexpr int PMMA_BN = 64;               // keys per tile

template <int HEAD_DIM, int MT = 1>
struct PmmaCfg {
    static constexpr int BM = PMMA_WARPS * 16 * MT;  // rows per block
    static constexpr int LD = HEAD_DIM + 8;   // padded shared row (elements): conflict-free fragments
    static constexpr int KSTEPS = HEAD_DIM / 16;
    static constexpr int DTILES = HEAD_DIM / 8;  // output n-tiles
    static constexpr int NTILES = PMMA_BN / 8;   // score n-tiles
    // Dynamic shared memory: Q tile, then two buffers of a K and a V tile,
    // 2-byte elements.
    static constexpr int SMEM_BYTES = (BM + 2 * 2 * PMMA_BN) * LD * 2;
    static_assert(HEAD_DIM % 32 == 0, "pairs of k-steps and of d-tiles per ldmatrix");
    static_assert(LD * 2 % 16 == 0, "16-byte aligned rows for cp.async and ldmatrix");
    static_assert(MT == 1 || MT == 2, "one or two m-tiles a warp");
};

// The wide kernel's configuration (the kernel table names one template
// parameter per configuration).
template <int HEAD_DIM>
struct PmmaWideCfg : PmmaCfg<HEAD_DIM, 2> {};

// Two adjacent 16-bit elements (4-byte aligned) as one register.
template <typename T>
__device__ __forceinline__ uint32_t ld_pair(const T* p) {
    return *reinterpret_cast<const uint32_t*>(p);
}

// The kernel body for MT m-tiles (16 rows each) per warp: PMMA_BM = 64
// rows per block for MT = 1 (Q's fragments held in registers), 128 for
// MT = 2 (the wide kernel; Q's fragments re-read from shared memory each
// k-step, as the registers hold two m-tiles' S and O). Each row's arithmetic
// is the same in both, in the same order: their outputs have the same bits.
template <typename T, int HEAD_DIM, int MT>
__device__ __forceinline__ void prefill_mma_rows(const PrefillParams& p) {
    using C = PmmaCfg<HEAD_DIM, MT>;
    using M = MmaOperand<T>;  // what the mma multiplies
    constexpr bool F8 = sizeof(T) == 1;
    constexpr int LD = C::LD, KSTEPS = C::KSTEPS, DTILES = C::DTILES, NTILES = C::NTILES;
    constexpr int BM = C::BM, WROWS = 16 * MT;  // rows per block, per warp
    constexpr int VEC = 16 / (int)sizeof(T);  // elements per 16-byte load
    constexpr int LDS = F8 ? HEAD_DIM : LD;   // a copied row's stride (elements of T)
    M* q_s = reinterpret_cast<M*>(dyn_smem());                  // [BM][LD]
    T* kv_s = reinterpret_cast<T*>(q_s + BM * LD);              // [2 buffers][K|V][PMMA_BN][LDS]
    M* wide_s = reinterpret_cast<M*>(kv_s + 2 * 2 * PMMA_BN * LDS);  // FP8: [K|V][PMMA_BN][LD]
    static_assert(BM * LD * 2 + 2 * 2 * PMMA_BN * LDS * (int)sizeof(T) + (F8 ? 2 * PMMA_BN * LD * 2 : 0) <=
                      C::SMEM_BYTES,
                  "the copies (and FP8's f16 tile) fit the 16-bit kernel's shared memory");

    const uint32_t tile = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tig = lane & 3;  // mma fragment coordinates
    const uint32_t group = p.group;
    const uint32_t qt = BM / group;  // query positions per block
    const uint32_t q_first = p.q_indptr[b];
    const uint32_t q_len = p.q_indptr[b + 1] - q_first;
    const uint32_t q0 = tile * qt;
    if (q0 >= q_len) return;  // whole block
    const uint32_t n_pos = min(qt, q_len - q0);
    const uint32_t n_rows = n_pos * group;
    const uint32_t kv_len = p.kv_len[b];
    const uint32_t past = kv_len - q_len;
    const uint32_t kv_end = past + q0 + n_pos;
    const uint32_t* pages = p.page_table + p.page_indptr[b];
    const T* kv = static_cast<const T*>(p.kv);
    const uint32_t kv_dim = p.n_kv_heads * HEAD_DIM;
    const uint32_t slot_mask = (1u << p.page_size_log2) - 1u;
    const uint64_t k_in_page = kv_page_offset(0, 0, p.layer, 0, p.page_size_log2, kv_dim) + kvh * HEAD_DIM;
    const uint64_t k_to_v = ((uint64_t)1 << p.page_size_log2) * kv_dim;
    const uint32_t n_tiles = (kv_end + PMMA_BN - 1) / PMMA_BN;

    // Queues the block's copies of K/V tile i into buffer i % 2 and closes
    // the group (an empty one past the last tile, so that every thread's
    // group count stays in step with the loop). Keys at or beyond kv_end
    // are zero-filled, never read.
    auto load_tile = [&](uint32_t i) {
        if (i < n_tiles) {
            T* k_s = kv_s + (i % 2) * 2 * PMMA_BN * LDS;
            T* v_s = k_s + PMMA_BN * LDS;
            const uint32_t kt0 = i * PMMA_BN;
            for (uint32_t idx = threadIdx.x; idx < PMMA_BN * (HEAD_DIM / VEC); idx += PMMA_THREADS) {
                const uint32_t j = idx / (HEAD_DIM / VEC), d = (idx % (HEAD_DIM / VEC)) * VEC;
                const uint32_t t = kt0 + j;
                const bool fill = t < kv_end;
                const T* src = kv;  // read nothing when !fill
                if (fill) {
                    const uint64_t page = pages[t >> p.page_size_log2];
                    src = kv + page * p.page_stride + k_in_page + (uint64_t)(t & slot_mask) * kv_dim + d;
                }
                cp_async_16(&k_s[j * LDS + d], src, fill);
                cp_async_16(&v_s[j * LDS + d], fill ? src + k_to_v : kv, fill);
            }
        }
        cp_async_commit();
    };
    load_tile(0);  // in flight while Q is staged

    // Q tile, scaled into the log2 domain and rounded to M.
    for (uint32_t idx = threadIdx.x; idx < BM * HEAD_DIM / 2; idx += PMMA_THREADS) {
        const uint32_t r = idx / (HEAD_DIM / 2), d = 2 * (idx % (HEAD_DIM / 2));
        float x0 = 0.0f, x1 = 0.0f;
        if (r < n_rows) {
            const uint64_t row = q_first + q0 + r / group;
            const uint32_t head = kvh * group + r % group;
            const float2 x = *reinterpret_cast<const float2*>(&p.q[(row * p.n_heads + head) * HEAD_DIM + d]);
            x0 = x.x * p.sm_scale_log2;
            x1 = x.y * p.sm_scale_log2;
        }
        *reinterpret_cast<uint32_t*>(&q_s[r * LD + d]) = MmaOp<M>::pack(x0, x1);
    }
    __syncthreads();

    // This warp's rows: m-tile mt holds rows r(mt, 0) = warp * WROWS + 16 mt
    // + g and r(mt, 1) = that + 8; vis: one past the last key each sees (0
    // for a padding row past n_rows, which sees none).
    uint32_t vis[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint32_t r = warp * WROWS + 16 * mt + 8 * h + g;
            vis[mt][h] = r < n_rows ? past + q0 + r / group + 1 : 0;
        }
    }
    const uint32_t warp_last_row = min((uint32_t)(warp * WROWS + WROWS - 1), n_rows - 1);
    const bool warp_active = (uint32_t)(warp * WROWS) < n_rows;
    const uint32_t warp_limit = past + q0 + warp_last_row / group;  // last key any row sees
    // Last key every row of the warp sees (0 unless all its rows are real):
    // tiles up to it need no mask.
    const uint32_t warp_full_limit =
        (uint32_t)(warp * WROWS + WROWS - 1) < n_rows ? past + q0 + (warp * WROWS) / group : 0;

    // ldmatrix: this lane names row r8 of matrix mi of each x4.
    const int mi = lane >> 3, r8 = lane & 7;
    // Q's A fragments: held for MT = 1; for MT = 2 re-read per k-step by
    // ldmatrix (matrices (rows 0-7 | 8-15) x (dims 0-7 | 8-15)).
    uint32_t qf[MT == 1 ? KSTEPS : 1][4];
    const M* q_lane = q_s + (warp * WROWS + (mi & 1) * 8 + r8) * LD + (mi >> 1) * 8;
    if constexpr (MT == 1) {
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            const M* base = q_s + (warp * 16) * LD + ks * 16 + tig * 2;
            qf[ks][0] = ld_pair(base + g * LD);
            qf[ks][1] = ld_pair(base + (g + 8) * LD);
            qf[ks][2] = ld_pair(base + g * LD + 8);
            qf[ks][3] = ld_pair(base + (g + 8) * LD + 8);
        }
    }

    float o[MT][DTILES][4];
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < DTILES; ++i) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.0f;
        m[mt][0] = m[mt][1] = -INFINITY;
        l[mt][0] = l[mt][1] = 0.0f;
    }

    for (uint32_t i = 0; i < n_tiles; ++i) {
        load_tile(i + 1);     // into the buffer tile i - 1 used (released below)
        cp_async_wait<1>();   // tile i has landed (this thread's copies)
        __syncthreads();      // ... and every thread's
        const uint32_t kt0 = i * PMMA_BN;
        const T* landed = kv_s + (i % 2) * 2 * PMMA_BN * LDS;
        const M* k_s;
        if constexpr (F8) {
            // Widen the landed K and V tiles to f16: 16-byte chunk c of the
            // tile (rows contiguous, K then V) holds 16 values, the f16
            // chunks 2 c and 2 c + 1 of its row. The last tile's reads of
            // wide_s ended before the loop's closing __syncthreads.
            constexpr int SCH = HEAD_DIM / VEC;  // chunks per row
            for (int c = threadIdx.x; c < 2 * PMMA_BN * SCH; c += PMMA_THREADS) {
                const int half = c / (PMMA_BN * SCH), row = c / SCH % PMMA_BN, ch = c % SCH;
                const uint4 raw = *reinterpret_cast<const uint4*>(landed + c * VEC);
                uint4 lo, hi;
                fp8x16_to_half(raw, lo, hi);
                M* dst = wide_s + (half * PMMA_BN + row) * LD + 2 * ch * 8;
                *reinterpret_cast<uint4*>(dst) = lo;
                *reinterpret_cast<uint4*>(dst + 8) = hi;
            }
            __syncthreads();
            k_s = wide_s;
        } else {
            k_s = landed;
        }
        const M* v_s = k_s + PMMA_BN * LD;
        if (warp_active && warp_limit >= kt0) {  // warp-uniform: else the tile is all in the future
            // S = Q Kᵀ for WROWS rows x PMMA_BN keys; matrices of a K x4:
            // (keys of n-tile nt) x (dims 0-7 | 8-15 of k-step 2 sp | of 2 sp
            // + 1). Every s[mt][nt] sums its k-steps in ascending order.
            float s[MT][NTILES][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                for (int nt = 0; nt < NTILES; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.0f;
            }
            if constexpr (MT == 1) {
#pragma unroll
                for (int nt = 0; nt < NTILES; ++nt) {
                    const M* krow = k_s + (nt * 8 + r8) * LD + mi * 8;
#pragma unroll
                    for (int sp = 0; sp < KSTEPS / 2; ++sp) {
                        uint32_t kb[4];
                        ldmatrix_x4(kb, krow + sp * 32);
                        MmaOp<M>::run(s[0][nt], qf[2 * sp], kb[0], kb[1]);
                        MmaOp<M>::run(s[0][nt], qf[2 * sp + 1], kb[2], kb[3]);
                    }
                }
            } else {
#pragma unroll
                for (int sp = 0; sp < KSTEPS / 2; ++sp) {
                    uint32_t qa[MT][2][4];
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        ldmatrix_x4(qa[mt][0], q_lane + mt * 16 * LD + sp * 32);
                        ldmatrix_x4(qa[mt][1], q_lane + mt * 16 * LD + sp * 32 + 16);
                    }
#pragma unroll
                    for (int nt = 0; nt < NTILES; ++nt) {
                        uint32_t kb[4];
                        ldmatrix_x4(kb, k_s + (nt * 8 + r8) * LD + mi * 8 + sp * 32);
#pragma unroll
                        for (int mt = 0; mt < MT; ++mt) {
                            MmaOp<M>::run(s[mt][nt], qa[mt][0], kb[0], kb[1]);
                            MmaOp<M>::run(s[mt][nt], qa[mt][1], kb[2], kb[3]);
                        }
                    }
                }
            }

            // Causal mask. Warp-uniform: a tile every row sees whole (all
            // but the diagonal's) is not masked.
            if (warp_full_limit == 0 || kt0 + PMMA_BN - 1 > warp_full_limit) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                    for (int nt = 0; nt < NTILES; ++nt) {
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const uint32_t t = kt0 + nt * 8 + tig * 2 + e;
                            if (t >= vis[mt][0]) s[mt][nt][e] = -INFINITY;
                            if (t >= vis[mt][1]) s[mt][nt][2 + e] = -INFINITY;
                        }
                    }
                }
            }

            // The online softmax of each m-tile's rows a (h = 0) and b (h = 1).
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
                for (int nt = 0; nt < NTILES; ++nt) {
                    mx[0] = fmaxf(mx[0], fmaxf(s[mt][nt][0], s[mt][nt][1]));
                    mx[1] = fmaxf(mx[1], fmaxf(s[mt][nt][2], s[mt][nt][3]));
                }
#pragma unroll
                for (int off = 1; off < 4; off <<= 1) {
                    mx[0] = fmaxf(mx[0], __shfl_xor_sync(0xffffffffu, mx[0], off));
                    mx[1] = fmaxf(mx[1], __shfl_xor_sync(0xffffffffu, mx[1], off));
                }
                float base[2], alpha[2];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float mn = fmaxf(m[mt][h], mx[h]);
                    // A row with nothing visible yet keeps m = -inf: use 0 as its base.
                    base[h] = mn == -INFINITY ? 0.0f : mn;
                    alpha[h] = fast_exp2(m[mt][h] - base[h]);
                    m[mt][h] = mn;
                }
                float sum[2] = {0.0f, 0.0f};
#pragma unroll
                for (int nt = 0; nt < NTILES; ++nt) {
                    s[mt][nt][0] = fast_exp2(s[mt][nt][0] - base[0]);
                    s[mt][nt][1] = fast_exp2(s[mt][nt][1] - base[0]);
                    s[mt][nt][2] = fast_exp2(s[mt][nt][2] - base[1]);
                    s[mt][nt][3] = fast_exp2(s[mt][nt][3] - base[1]);
                    sum[0] += s[mt][nt][0] + s[mt][nt][1];
                    sum[1] += s[mt][nt][2] + s[mt][nt][3];
                }
#pragma unroll
                for (int off = 1; off < 4; off <<= 1) {
                    sum[0] += __shfl_xor_sync(0xffffffffu, sum[0], off);
                    sum[1] += __shfl_xor_sync(0xffffffffu, sum[1], off);
                }
                l[mt][0] = l[mt][0] * alpha[0] + sum[0];
                l[mt][1] = l[mt][1] * alpha[1] + sum[1];
                // Rescale only when some row's maximum moved (alpha is exactly 1
                // otherwise, and x * 1 is x: the same bits either way).
                if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
                    for (int dt = 0; dt < DTILES; ++dt) {
                        o[mt][dt][0] *= alpha[0];
                        o[mt][dt][1] *= alpha[0];
                        o[mt][dt][2] *= alpha[1];
                        o[mt][dt][3] *= alpha[1];
                    }
                }
            }

            // O += P V: keys in k-steps of 16 (two score n-tiles per A fragment).
#pragma unroll
            for (int kk = 0; kk < PMMA_BN / 16; ++kk) {
                uint32_t pa[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    pa[mt][0] = MmaOp<M>::pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                    pa[mt][1] = MmaOp<M>::pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                    pa[mt][2] = MmaOp<M>::pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                    pa[mt][3] = MmaOp<M>::pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
                }
                // Matrices (keys 0-7 | 8-15 of the k-step) x (d-tile 2 j | 2 j + 1).
                const M* vrow = v_s + (kk * 16 + (mi & 1) * 8 + r8) * LD + (mi >> 1) * 8;
#pragma unroll
                for (int j = 0; j < DTILES / 2; ++j) {
                    uint32_t vb[4];
                    ldmatrix_x4_trans(vb, vrow + j * 16);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        MmaOp<M>::run(o[mt][2 * j], pa[mt], vb[0], vb[1]);
                        MmaOp<M>::run(o[mt][2 * j + 1], pa[mt], vb[2], vb[3]);
                    }
                }
            }
        }
        __syncthreads();  // every warp is done with buffer i % 2 before tile i + 2 is copied there
    }
    cp_async_wait<0>();  // only an empty group remains

    // out = O / l for the thread's rows.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint32_t r = warp * WROWS + 16 * mt + 8 * h + g;
            if (r >= n_rows) continue;
            const float inv = l[mt][h] > 0.0f ? 1.0f / l[mt][h] : 0.0f;
            const uint64_t row = q_first + q0 + r / group;
            const uint32_t head = kvh * group + r % group;
            float* dst = p.out + (row * p.n_heads + head) * HEAD_DIM + tig * 2;
#pragma unroll
            for (int dt = 0; dt < DTILES; ++dt) {
                *reinterpret_cast<float2*>(dst + dt * 8) =
                    make_float2(o[mt][dt][2 * h] * inv, o[mt][dt][2 * h + 1] * inv);
            }
        }
    }
}

// The kernel of 64 rows a block (one m-tile a warp).
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void prefill_mma(const PrefillParams& p) {
    prefill_mma_rows<T, HEAD_DIM, 1>(p);
}

// The wide kernel: 128 rows a block (two m-tiles a warp), each K/V tile
// loaded once for twice the rows and each K/V fragment feeding two mma.
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void prefill_mma_wide(const PrefillParams& p) {
    prefill_mma_rows<T, HEAD_DIM, 2>(p);
}

}  // namespace handoff
