// Paged decode attention (flash-decoding): one query token per sequence
// against the sequence's pages, grouped-query aware, split over the KV
// length with a second merge pass.
//
// One block handles (split, kv_head, sequence) and all GROUP query heads
// that share the KV head, so every K/V byte is loaded once per step. A
// ratio above the largest compiled GROUP is served in head slices: grid.y
// is n_kv_heads * ceil(group / GROUP), each block taking GROUP of the KV
// head's query heads (the KV is then read once per slice). A
// block's threads form row groups of TPR threads; a row group owns one KV
// position at a time and each thread of it holds VEC consecutive elements
// of the head (one or two 16-byte loads). Each row group keeps its own
// online softmax state; the block combines them through shared memory at
// the end. Positions at or beyond kv_len are never loaded.
//
// The bodies live in this header so that tests/cuda/decode_host.rs can run
// them on the host SIMT emulator (tests/support/sim/) against an f64
// reference; decode_attention.cu instantiates them for the GPU.
#pragma once
#include "common.cuh"
#include "params.cuh"

namespace handoff {

constexpr int DECODE_WARPS = 4;
constexpr int DECODE_THREADS = DECODE_WARPS * 32;

template <typename T, int HEAD_DIM, int GROUP>
struct DecodeCfg {
    // A 16-byte load, but at most 8 elements: FP8 loads 8 bytes, keeping the
    // row groups (and the combine's shared memory) those of a 16-bit dtype.
    static constexpr int VEC_MIN = 16 / (int)sizeof(T) < 8 ? 16 / (int)sizeof(T) : 8;
    // Elements per thread: VEC_MIN at least, and at most 32 threads per row.
    static constexpr int VEC = HEAD_DIM / 32 > VEC_MIN ? HEAD_DIM / 32 : VEC_MIN;
    static constexpr int TPR = HEAD_DIM / VEC;  // threads per row group
    static constexpr int ROWS_PER_WARP = 32 / TPR;
    static constexpr int NRG = DECODE_WARPS * ROWS_PER_WARP;  // row groups per block
    static constexpr int TILE = 4;  // positions each row group loads per step
    static constexpr int STEP = NRG * TILE;  // positions per block per step
    static_assert(HEAD_DIM % VEC == 0 && TPR >= 1 && TPR <= 32 && 32 % TPR == 0, "head_dim");
    // Shared memory for the cross-row-group combine.
    static constexpr int SMEM_BYTES = NRG * GROUP * (HEAD_DIM + 2) * 4;
    static_assert(SMEM_BYTES <= 48 * 1024, "static shared memory");
};

// The KV head of this block and its slice of that head's query heads (grid.y
// = KV heads x ceil(group / GROUP) slices, as plan/mod.rs launches both decode
// kernels): heads kvh * group + h0 + g for g < here.
template <int GROUP>
__device__ __forceinline__ void decode_heads(const DecodeParams& p, uint32_t& kvh, uint32_t& h0,
                                             int& here) {
    const uint32_t slices = (p.group + GROUP - 1) / GROUP;
    kvh = blockIdx.y / slices;
    h0 = (blockIdx.y % slices) * GROUP;
    here = (int)min(p.group - h0, (uint32_t)GROUP);
}

// Positions [begin, end) of chunk `split` of a sequence of `len`
// positions, for both decode kernels: chunks from the sequence's own length
// only (auto), so that its output is bit-identical alone or in any batch;
// chunks past its length are empty (begin >= end) and the merge gives them
// weight 0.
__device__ __forceinline__ void decode_chunk(const DecodeParams& p, uint32_t len, uint32_t split,
                                             uint32_t& begin, uint32_t& end) {
    uint32_t chunk = p.chunk_tokens;
    if (p.auto_max_splits != 0) {
        const uint32_t even = ((len + p.auto_max_splits - 1) / p.auto_max_splits + 63u) & ~63u;
        chunk = max(chunk, even);
    }
    begin = split * chunk;
    end = min(begin + chunk, len);
}

// The end of both decode kernels (this one and decode_mma.cuh): combines
// `parts` partial softmax states of each of the block's `here` heads (part
// r of head g: running max m(r, g), sum l(r, g), weighted V sum o(r, g, d))
// and stores head g's output, or, when the sequence is cut into chunks,
// this chunk's partial output and log-sum-exp for decode_merge. `bad`: a
// non-finite score somewhere in the block, which makes it all NaN.
template <int HEAD_DIM, int THREADS, typename M, typename L, typename O>
__device__ __forceinline__ void decode_combine_store(const DecodeParams& p, uint32_t b, uint32_t kvh,
                                                     uint32_t h0, uint32_t split, int here, int parts,
                                                     bool bad, M m, L l, O o) {
    for (int idx = threadIdx.x; idx < here * HEAD_DIM; idx += THREADS) {
        const int g = idx / HEAD_DIM, d = idx % HEAD_DIM;
        float mx = -INFINITY;
        for (int r = 0; r < parts; ++r) mx = fmaxf(mx, m(r, g));
        float lsum = 0.0f, out = 0.0f;
        if (mx != -INFINITY) {
            for (int r = 0; r < parts; ++r) {
                const float w = exp2f(m(r, g) - mx);
                lsum = fmaf(l(r, g), w, lsum);
                out = fmaf(o(r, g, d), w, out);
            }
        }
        const uint64_t bh = (uint64_t)b * p.n_heads + kvh * p.group + h0 + g;
        const float val = bad ? NAN : lsum > 0.0f ? out / lsum : 0.0f;
        if (p.num_splits == 1) {
            p.out[bh * HEAD_DIM + d] = val;
        } else {
            p.part_o[(bh * p.num_splits + split) * HEAD_DIM + d] = val;
            if (d == 0) {
                p.part_lse[bh * p.num_splits + split] = bad ? NAN : lsum > 0.0f ? mx + log2f(lsum) : -INFINITY;
            }
        }
    }
}

template <typename T, int HEAD_DIM, int GROUP>
__device__ __forceinline__ void decode_attention(const DecodeParams& p) {
    using C = DecodeCfg<T, HEAD_DIM, GROUP>;
    constexpr int VEC = C::VEC, TPR = C::TPR, NRG = C::NRG, TILE = C::TILE;
    pdl_launch_dependents();  // the merge may be scheduled (it waits for the end)

    const uint32_t split = blockIdx.x, b = blockIdx.z;
    uint32_t kvh, h0;
    int here;
    decode_heads<GROUP>(p, kvh, h0, here);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int tx = lane % TPR;                            // slice of the head
    const int rg = warp * C::ROWS_PER_WARP + lane / TPR;  // row group

    const uint32_t len = p.kv_len[b];
    uint32_t begin, end;
    decode_chunk(p, len, split, begin, end);
    const uint32_t* pages = p.page_table + p.page_indptr[b];
    const T* kv = static_cast<const T*>(p.kv);
    const uint32_t kv_dim = p.n_kv_heads * HEAD_DIM;
    const uint32_t slot_mask = (1u << p.page_size_log2) - 1u;
    // Offset within a page of this thread's slice of K at slot 0, and from K to V.
    const uint64_t k_in_page =
        kv_page_offset(0, 0, p.layer, 0, p.page_size_log2, kv_dim) + kvh * HEAD_DIM + tx * VEC;
    const uint64_t k_to_v = ((uint64_t)1 << p.page_size_log2) * kv_dim;

    // Queries of this block's heads, pre-scaled; heads past `here` (padding
    // of the instantiation) are zero and not written.
    float q[GROUP][VEC];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        const uint32_t head = kvh * p.group + h0 + g;
        const float* qp = p.q + ((uint64_t)b * p.n_heads + head) * HEAD_DIM + tx * VEC;
#pragma unroll
        for (int i = 0; i < VEC; ++i) q[g][i] = g < here ? qp[i] * p.sm_scale_log2 : 0.0f;
    }

    float m[GROUP], l[GROUP], acc[GROUP][VEC];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[g][i] = 0.0f;
    }

    // A non-finite score (from a poisoned, NaN or infinite K, or a
    // non-finite query) must reach the output as NaN, where the engine
    // refuses it: the online softmax below would otherwise drop it (fmaxf
    // ignores NaN, inf - inf is NaN, and a NaN sum fails the `> 0` tests of
    // the combine, leaving zeros).
    bool bad = false;
    for (uint32_t base = begin; base < end; base += C::STEP) {
        // Issue every load of the step before using any.
        Raw<T, VEC> kr[TILE], vr[TILE];
        bool valid[TILE];
#pragma unroll
        for (int j = 0; j < TILE; ++j) {
            const uint32_t t = base + j * NRG + rg;
            valid[j] = t < end;
            if (valid[j]) {
                const uint64_t page = pages[t >> p.page_size_log2];
                const uint64_t off =
                    page * p.page_stride + k_in_page + (uint64_t)(t & slot_mask) * kv_dim;
                kr[j].load(kv + off);
                vr[j].load(kv + off + k_to_v);
            } else {
                kr[j].zero();
                vr[j].zero();
            }
        }
        // Scores: partial dot over this thread's slice, summed over the row group.
        float s[TILE][GROUP];
#pragma unroll
        for (int j = 0; j < TILE; ++j) {
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                float d = 0.0f;
#pragma unroll
                for (int i = 0; i < VEC; ++i) d = fmaf(q[g][i], kr[j].get(i), d);
#pragma unroll
                for (int o = TPR / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
                if (valid[j] && g < here && !isfinite(d)) bad = true;
                s[j][g] = valid[j] ? d : -INFINITY;
            }
        }
        // Online softmax update of this row group's state.
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            float mx = s[0][g];
#pragma unroll
            for (int j = 1; j < TILE; ++j) mx = fmaxf(mx, s[j][g]);
            const float m_new = fmaxf(m[g], mx);
            if (m_new == -INFINITY) continue;  // no position of this row group yet
            const float alpha = exp2f(m[g] - m_new);  // 0 when m[g] is -inf
            l[g] *= alpha;
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[g][i] *= alpha;
#pragma unroll
            for (int j = 0; j < TILE; ++j) {
                const float pj = exp2f(s[j][g] - m_new);  // 0 for invalid positions
                l[g] += pj;
#pragma unroll
                for (int i = 0; i < VEC; ++i) acc[g][i] = fmaf(pj, vr[j].get(i), acc[g][i]);
            }
            m[g] = m_new;
        }
    }

    // Combine the row groups.
    __shared__ float sm_o[NRG][GROUP][HEAD_DIM];
    __shared__ float sm_m[NRG][GROUP];
    __shared__ float sm_l[NRG][GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) sm_o[rg][g][tx * VEC + i] = acc[g][i];
        if (tx == 0) {
            sm_m[rg][g] = m[g];
            sm_l[rg][g] = l[g];
        }
    }
    const bool any_bad = __syncthreads_or(bad) != 0;
    decode_combine_store<HEAD_DIM, DECODE_THREADS>(
        p, b, kvh, h0, split, here, NRG, any_bad, [&](int r, int g) { return sm_m[r][g]; },
        [&](int r, int g) { return sm_l[r][g]; }, [&](int r, int g, int d) { return sm_o[r][g][d]; });
}

// The merge: out(b, h) = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s -
// max lse), summed in split order. Every split's lse is read once, by one
// thread, and its weight worked out once per block into shared memory; a
// thread then walks the splits for its dims with only the part_o loads in
// its chain (independent of each other, so many in flight), instead of
// re-reading and re-weighting every split per dim. The sums' order and
// terms are the same as one thread walking all splits alone.
constexpr int MERGE_THREADS = 128;
constexpr int MERGE_DIMS = 2;  // dims per thread: head_dim <= 256
constexpr int MERGE_BATCH = 8;  // splits whose part_o loads are in flight together

__device__ __forceinline__ void decode_merge_impl(const MergeParams& p) {
    // Queued to overlap the split launch's end: nothing is read before it has
    // completed (common.cuh).
    pdl_wait();
    __shared__ float w_s[MERGE_THREADS];  // the weights of one group of splits
    const uint32_t h = blockIdx.x, b = blockIdx.y;
    const uint64_t bh = (uint64_t)b * p.n_heads + h;
    const float* lse = p.part_lse + bh * p.num_splits;
    float mx = -INFINITY;
    bool bad = false;  // a chunk saw a non-finite score: the head's output is NaN
    for (uint32_t s = threadIdx.x; s < p.num_splits; s += MERGE_THREADS) {
        mx = fmaxf(mx, lse[s]);
        bad |= isnan(lse[s]);
    }
    mx = block_max(mx);
    bad = __syncthreads_or(bad) != 0;
    float wsum = 0.0f, o[MERGE_DIMS];
#pragma unroll
    for (int k = 0; k < MERGE_DIMS; ++k) o[k] = 0.0f;
    if (!bad && mx != -INFINITY) {
        for (uint32_t base = 0; base < p.num_splits; base += MERGE_THREADS) {
            const uint32_t n = min((uint32_t)MERGE_THREADS, p.num_splits - base);
            __syncthreads();  // the previous group's weights are read
            if (threadIdx.x < n) w_s[threadIdx.x] = exp2f(lse[base + threadIdx.x] - mx);  // 0 for empty chunks
            __syncthreads();
            const float* po = p.part_o + (bh * p.num_splits + base) * p.head_dim;
            // MERGE_BATCH splits' loads issued before their sums (a dim
            // past head_dim loads nothing and is never stored).
            for (uint32_t j = 0; j < n; j += MERGE_BATCH) {
                float v[MERGE_BATCH][MERGE_DIMS];
#pragma unroll
                for (int u = 0; u < MERGE_BATCH; ++u) {
#pragma unroll
                    for (int k = 0; k < MERGE_DIMS; ++k) {
                        const uint32_t d = threadIdx.x + k * MERGE_THREADS;
                        v[u][k] = j + u < n && d < p.head_dim ? po[(uint64_t)(j + u) * p.head_dim + d] : 0.0f;
                    }
                }
#pragma unroll
                for (int u = 0; u < MERGE_BATCH; ++u) {
                    if (j + u < n) {
                        const float w = w_s[j + u];
                        wsum += w;
#pragma unroll
                        for (int k = 0; k < MERGE_DIMS; ++k) o[k] = fmaf(w, v[u][k], o[k]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int k = 0; k < MERGE_DIMS; ++k) {
        const uint32_t d = threadIdx.x + k * MERGE_THREADS;
        if (d < p.head_dim) p.out[bh * p.head_dim + d] = bad ? NAN : wsum > 0.0f ? o[k] / wsum : 0.0f;
    }
}

}  // namespace handoff
