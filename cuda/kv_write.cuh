// The kernels that write K/V rows into pages: kv_append, and RoPE, which
// can append the rows it rotates in the same launch (one launch a layer
// instead of two). Bodies in a header so that tests/cuda/kv_write_host.rs
// runs them on the host SIMT emulator (the append fused into RoPE must store
// the bits that RoPE then kv_append store); elementwise.cu instantiates them.
#pragma once
#include "common.cuh"
#include "params.cuh"

namespace handoff {

// Element offset of token t's row (slot dst_slot[t] of page dst_page[t]) in
// K of `layer`; V's row is k_to_v further.
__device__ __forceinline__ uint64_t kv_row_offset(uint32_t page, uint32_t slot, uint64_t page_stride,
                                                  uint32_t layer, uint32_t page_size_log2, uint32_t kv_dim) {
    return kv_page_offset(page, page_stride, layer, 0, page_size_log2, kv_dim) + (uint64_t)slot * kv_dim;
}

template <typename T>
__device__ __forceinline__ void kv_append(const KvAppendParams& p) {
    T* kv = static_cast<T*>(p.kv);
    const uint64_t total = (uint64_t)p.n_tokens * p.kv_dim;
    const uint64_t k_to_v = ((uint64_t)1 << p.page_size_log2) * p.kv_dim;
    for (uint64_t idx = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (uint64_t)gridDim.x * blockDim.x) {
        const uint64_t t = idx / p.kv_dim, e = idx % p.kv_dim;
        const uint64_t off =
            kv_row_offset(p.dst_page[t], p.dst_slot[t], p.page_stride, p.layer, p.page_size_log2, p.kv_dim) + e;
        kv[off] = from_float<T>(p.k[idx]);
        kv[off + k_to_v] = from_float<T>(p.v[idx]);
    }
}

// Rotation frequency of pair i, as RopeScaling::inv_freq on the host.
__device__ __forceinline__ double rope_inv_freq(const RopeParams& p, uint32_t i) {
    const double base = pow(p.theta, -2.0 * (double)i / (double)p.head_dim);
    if (p.scaling == 1) return base / p.factor;
    if (p.scaling == 2) {
        const double old = p.original_max_position;
        const double wavelen = 2.0 * 3.14159265358979323846 / base;
        if (wavelen < old / p.high_freq_factor) return base;
        if (wavelen > old / p.low_freq_factor) return base / p.factor;
        const double smooth =
            (old / wavelen - p.low_freq_factor) / (p.high_freq_factor - p.low_freq_factor);
        return (1.0 - smooth) * base / p.factor + smooth * base;
    }
    return base;
}

// x (and x2, when it has heads: k beside q) rotated for each token's
// position; a head of x2 gets the bits a launch of its own would give.
// With p.kv set, x2's rotated rows and v's rows are also stored in the
// arena (T) as kv_append stores them: the rotated pair is rounded from the
// values written back to x2, and v follows the rotations in the index space.
template <typename T>
__device__ __forceinline__ void rope(const RopeParams& p) {
    const uint32_t half_dim = p.head_dim / 2;
    const uint32_t heads = p.n_heads + p.n_heads2;  // per token, x's then x2's
    const uint64_t total = (uint64_t)p.n_tokens * heads * half_dim;
    const uint64_t v_total = p.kv != nullptr ? (uint64_t)p.n_tokens * p.kv_dim : 0;
    T* kv = static_cast<T*>(p.kv);
    const uint64_t k_to_v = ((uint64_t)1 << p.page_size_log2) * p.kv_dim;
    for (uint64_t idx = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total + v_total;
         idx += (uint64_t)gridDim.x * blockDim.x) {
        if (idx >= total) {  // a v element of the append
            const uint64_t j = idx - total, t = j / p.kv_dim, e = j % p.kv_dim;
            const uint64_t off =
                kv_row_offset(p.dst_page[t], p.dst_slot[t], p.page_stride, p.layer, p.page_size_log2, p.kv_dim);
            kv[off + k_to_v + e] = from_float<T>(p.v[j]);
            continue;
        }
        const uint32_t i = idx % half_dim;
        const uint64_t th = idx / half_dim;  // token * heads + head
        const uint64_t t = th / heads;
        const uint32_t h = th % heads;
        float* x = h < p.n_heads ? p.x + (t * p.n_heads + h) * p.head_dim
                                 : p.x2 + (t * p.n_heads2 + (h - p.n_heads)) * p.head_dim;
        // Angles in double: positions reach 10^5-10^6, where an f32 angle
        // would already be off by more than the f32 result's precision.
        const double inv_freq = rope_inv_freq(p, i);
        double sd, cd;
        sincos((double)p.positions[t] * inv_freq, &sd, &cd);
        const float s = (float)sd, c = (float)cd;
        const uint32_t i0 = p.style == 0 ? 2 * i : i;
        const uint32_t i1 = p.style == 0 ? 2 * i + 1 : i + half_dim;
        const float x0 = x[i0], x1 = x[i1];
        // Rounded products then one rounded difference (no fused multiply-
        // add), so that every instantiation and the host agree on the bits.
        const float r0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
        const float r1 = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
        x[i0] = r0;
        x[i1] = r1;
        if (kv != nullptr && h >= p.n_heads) {
            const uint64_t off = kv_row_offset(p.dst_page[t], p.dst_slot[t], p.page_stride, p.layer,
                                               p.page_size_log2, p.kv_dim) +
                                 (uint64_t)(h - p.n_heads) * p.head_dim;
            kv[off + i0] = from_float<T>(r0);
            kv[off + i1] = from_float<T>(r1);
        }
    }
}

}  // namespace handoff
