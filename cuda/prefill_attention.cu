// Paged causal prefill attention, tiled with online softmax (f32 math).
//
// One block handles (query tile, kv_head, sequence). Its PREFILL_ROWS rows
// are (query position, query head) pairs of the query heads that share the
// KV head, so each K/V tile is loaded once for all of them. K/V tiles of
// PREFILL_BK positions are converted to f32 in shared memory (rows padded
// by one float so that the per-key lanes hit distinct banks). Each warp
// owns PREFILL_ROWS / 4 rows: lane j scores key j of the tile, the warp
// reduces max and sum, and lane d accumulates output dims d, d+32, ...
// Positions at or beyond the block's last causal position are never loaded.
//
// This is the correct scalar version; a tensor-core (mma.sync) version is
// the next step (see cuda/README.md).
#include "common.cuh"
#include "params.cuh"

namespace handoff {

constexpr int PREFILL_WARPS = 4;
constexpr int PREFILL_THREADS = PREFILL_WARPS * 32;
constexpr int PREFILL_ROWS = 32;  // (position, head) rows per block
constexpr int PREFILL_BK = 32;    // keys per tile (one per lane)
constexpr int PREFILL_ROWS_PER_WARP = PREFILL_ROWS / PREFILL_WARPS;

template <int HEAD_DIM>
struct PrefillCfg {
    static constexpr int LD = HEAD_DIM + 1;             // padded smem row (floats)
    static constexpr int DPL = (HEAD_DIM + 31) / 32;    // output dims per lane
    // Dynamic shared memory: q rows, then K tile, then V tile.
    static constexpr int SMEM_BYTES = (PREFILL_ROWS + 2 * PREFILL_BK) * LD * 4;
};

template <typename T, int HEAD_DIM>
__device__ __forceinline__ void prefill_attention(const PrefillParams& p) {
    using C = PrefillCfg<HEAD_DIM>;
    constexpr int LD = C::LD, DPL = C::DPL, RPW = PREFILL_ROWS_PER_WARP;
    extern __shared__ float smem[];
    float* q_s = smem;                                // [PREFILL_ROWS][LD]
    float* k_s = q_s + PREFILL_ROWS * LD;             // [PREFILL_BK][LD]
    float* v_s = k_s + PREFILL_BK * LD;               // [PREFILL_BK][LD]

    const uint32_t tile = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint32_t group = p.group;
    const uint32_t qt = PREFILL_ROWS / group;  // query positions per tile
    const uint32_t q_first = p.q_indptr[b];
    const uint32_t q_len = p.q_indptr[b + 1] - q_first;
    const uint32_t q0 = tile * qt;
    if (q0 >= q_len) return;  // whole block: this sequence has fewer tiles
    const uint32_t n_pos = min(qt, q_len - q0);
    const uint32_t n_rows = n_pos * group;
    const uint32_t kv_len = p.kv_len[b];
    const uint32_t past = kv_len - q_len;  // positions before the first query
    const uint32_t kv_end = past + q0 + n_pos;  // keys this block may need
    const uint32_t* pages = p.page_table + p.page_indptr[b];
    const T* kv = static_cast<const T*>(p.kv);
    const uint32_t kv_dim = p.n_kv_heads * HEAD_DIM;
    const uint32_t slot_mask = (1u << p.page_size_log2) - 1u;
    const uint64_t k_in_page = kv_page_offset(0, 0, p.layer, 0, p.page_size_log2, kv_dim) + kvh * HEAD_DIM;
    const uint64_t k_to_v = ((uint64_t)1 << p.page_size_log2) * kv_dim;

    // Query rows, pre-scaled; row r is position q0 + r / group, head kvh * group + r % group.
    for (uint32_t idx = threadIdx.x; idx < PREFILL_ROWS * HEAD_DIM; idx += PREFILL_THREADS) {
        const uint32_t r = idx / HEAD_DIM, d = idx % HEAD_DIM;
        float x = 0.0f;
        if (r < n_rows) {
            const uint64_t row = q_first + q0 + r / group;
            const uint32_t head = kvh * group + r % group;
            x = p.q[(row * p.n_heads + head) * HEAD_DIM + d] * p.sm_scale_log2;
        }
        q_s[r * LD + d] = x;
    }

    float m[RPW], l[RPW], acc[RPW][DPL];
#pragma unroll
    for (int k = 0; k < RPW; ++k) {
        m[k] = -INFINITY;
        l[k] = 0.0f;
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[k][i] = 0.0f;
    }

    for (uint32_t kt0 = 0; kt0 < kv_end; kt0 += PREFILL_BK) {
        __syncthreads();  // the previous tile is consumed (and q_s written)
        for (uint32_t idx = threadIdx.x; idx < PREFILL_BK * HEAD_DIM; idx += PREFILL_THREADS) {
            const uint32_t j = idx / HEAD_DIM, d = idx % HEAD_DIM;
            const uint32_t t = kt0 + j;
            float kx = 0.0f, vx = 0.0f;
            if (t < kv_end) {
                const uint64_t page = pages[t >> p.page_size_log2];
                const uint64_t off = page * p.page_stride + k_in_page + (uint64_t)(t & slot_mask) * kv_dim + d;
                kx = to_float(kv[off]);
                vx = to_float(kv[off + k_to_v]);
            }
            k_s[j * LD + d] = kx;
            v_s[j * LD + d] = vx;
        }
        __syncthreads();

#pragma unroll
        for (int k = 0; k < RPW; ++k) {
            const uint32_t r = warp * RPW + k;
            if (r >= n_rows) continue;  // warp-uniform
            const uint32_t limit = past + q0 + r / group;  // last key this row sees
            if (limit < kt0) continue;  // warp-uniform: the tile is all in its future
            const uint32_t t = kt0 + lane;
            float s = 0.0f;
#pragma unroll 8
            for (int d = 0; d < HEAD_DIM; ++d) s = fmaf(q_s[r * LD + d], k_s[lane * LD + d], s);
            s = t <= limit ? s : -INFINITY;
            const float m_new = fmaxf(m[k], warp_max(s));  // finite: key kt0 <= limit
            const float alpha = exp2f(m[k] - m_new);
            const float pj = exp2f(s - m_new);
            l[k] = l[k] * alpha + warp_sum(pj);
#pragma unroll
            for (int i = 0; i < DPL; ++i) acc[k][i] *= alpha;
            const uint32_t n_keys = min((uint32_t)PREFILL_BK, limit - kt0 + 1);
            for (uint32_t jj = 0; jj < n_keys; ++jj) {
                const float pjj = __shfl_sync(0xffffffffu, pj, jj);
#pragma unroll
                for (int i = 0; i < DPL; ++i) {
                    const int d = lane + 32 * i;
                    if (d < HEAD_DIM) acc[k][i] = fmaf(pjj, v_s[jj * LD + d], acc[k][i]);
                }
            }
            m[k] = m_new;
        }
    }

#pragma unroll
    for (int k = 0; k < RPW; ++k) {
        const uint32_t r = warp * RPW + k;
        if (r >= n_rows) continue;
        const uint64_t row = q_first + q0 + r / group;
        const uint32_t head = kvh * group + r % group;
        const float inv = l[k] > 0.0f ? 1.0f / l[k] : 0.0f;
#pragma unroll
        for (int i = 0; i < DPL; ++i) {
            const int d = lane + 32 * i;
            if (d < HEAD_DIM) p.out[(row * p.n_heads + head) * HEAD_DIM + d] = acc[k][i] * inv;
        }
    }
}

}  // namespace handoff

// The extern "C" entry points (one per instantiation) and the checks of the
// constants the host mirrors, generated by build.rs from the kernel table
// src/backend/cuda/table/.
#include "prefill_attention_kernels.cuh"
