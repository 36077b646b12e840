// Small kernels of the forward pass and of page management: KV append,
// page scrub, RMSNorm, RoPE, SwiGLU, embedding gather, greedy argmax.
#include "common.cuh"
#include "params.cuh"

namespace handoff {

template <typename T>
__device__ __forceinline__ void kv_append(const KvAppendParams& p) {
    T* kv = static_cast<T*>(p.kv);
    const uint64_t total = (uint64_t)p.n_tokens * p.kv_dim;
    const uint64_t k_to_v = ((uint64_t)1 << p.page_size_log2) * p.kv_dim;
    for (uint64_t idx = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (uint64_t)gridDim.x * blockDim.x) {
        const uint64_t t = idx / p.kv_dim, e = idx % p.kv_dim;
        const uint64_t off = kv_page_offset(p.dst_page[t], p.page_stride, p.layer, 0, p.page_size_log2, p.kv_dim) +
                             (uint64_t)p.dst_slot[t] * p.kv_dim + e;
        kv[off] = from_float<T>(p.k[idx]);
        kv[off + k_to_v] = from_float<T>(p.v[idx]);
    }
}

__device__ __forceinline__ void scrub_pages(const ScrubParams& p) {
    uint4* kv = static_cast<uint4*>(p.kv);
    const uint4 fill = make_uint4(p.fill, p.fill, p.fill, p.fill);
    uint4* page = kv + (uint64_t)p.pages[blockIdx.x] * p.page_vec16;
    for (uint64_t i = threadIdx.x; i < p.page_vec16; i += blockDim.x) page[i] = fill;
}

__device__ __forceinline__ void rms_norm(const RmsNormParams& p) {
    const uint64_t row = blockIdx.x;
    const float* x = p.x + row * p.dim;
    float ss = 0.0f;
    for (uint32_t i = threadIdx.x; i < p.dim; i += blockDim.x) ss = fmaf(x[i], x[i], ss);
    ss = block_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)p.dim + p.eps);
    float* out = p.out + row * p.dim;
    for (uint32_t i = threadIdx.x; i < p.dim; i += blockDim.x) out[i] = x[i] * inv * p.w[i];
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
__device__ __forceinline__ void rope(const RopeParams& p) {
    const uint32_t half_dim = p.head_dim / 2;
    const uint32_t heads = p.n_heads + p.n_heads2;  // per token, x's then x2's
    const uint64_t total = (uint64_t)p.n_tokens * heads * half_dim;
    for (uint64_t idx = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (uint64_t)gridDim.x * blockDim.x) {
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
        x[i0] = x0 * c - x1 * s;
        x[i1] = x0 * s + x1 * c;
    }
}

__device__ __forceinline__ void swiglu(const SwigluParams& p) {
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < p.n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        const float g = p.gate[i];
        p.out[i] = g / (1.0f + expf(-g)) * p.up[i];
    }
}

template <typename T>
__device__ __forceinline__ void embedding(const EmbeddingParams& p) {
    const T* table = static_cast<const T*>(p.table);
    const uint64_t total = (uint64_t)p.n_tokens * p.dim;
    for (uint64_t idx = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (uint64_t)gridDim.x * blockDim.x) {
        const uint64_t t = idx / p.dim, e = idx % p.dim;
        const uint32_t tok = p.tokens[t];
        // The host refuses out-of-range tokens; should one slip through,
        // it reads nothing and poisons its row.
        p.out[idx] = tok < p.vocab ? to_float(table[(uint64_t)tok * p.dim + e]) : __int_as_float(0x7fc00000);
    }
}

__device__ __forceinline__ void argmax(const ArgmaxParams& p) {
    const uint64_t row = blockIdx.x;
    const float* x = p.logits + row * p.vocab;
    float best = -INFINITY;
    uint32_t best_i = 0xffffffffu, nans = 0;
    for (uint32_t i = threadIdx.x; i < p.vocab; i += blockDim.x) {
        const float v = x[i];
        if (isnan(v)) {
            ++nans;
        } else if (v > best || best_i == 0xffffffffu) {
            best = v;  // strided scan: the first index of a thread's maximum is kept
            best_i = i;
        }
    }
    // Block reduction: larger value wins, then the lower index.
    __shared__ float s_val[256];
    __shared__ uint32_t s_idx[256];
    __shared__ uint32_t s_nan[256];
    s_val[threadIdx.x] = best;
    s_idx[threadIdx.x] = best_i;
    s_nan[threadIdx.x] = nans;
    __syncthreads();
    for (uint32_t stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            const uint32_t o = threadIdx.x + stride;
            const bool take = s_idx[o] != 0xffffffffu &&
                              (s_idx[threadIdx.x] == 0xffffffffu || s_val[o] > s_val[threadIdx.x] ||
                               (s_val[o] == s_val[threadIdx.x] && s_idx[o] < s_idx[threadIdx.x]));
            if (take) {
                s_val[threadIdx.x] = s_val[o];
                s_idx[threadIdx.x] = s_idx[o];
            }
            s_nan[threadIdx.x] += s_nan[o];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        // An all-NaN row reports index 0 and vocab NaNs; the host refuses it.
        p.out_index[row] = s_idx[0] == 0xffffffffu ? 0 : s_idx[0];
        p.out_nans[row] = s_nan[0];
    }
}

}  // namespace handoff

// The extern "C" entry points (one per instantiation) and the checks of the
// constants the host mirrors, generated by build.rs from the kernel table
// src/backend/cuda/table.rs.
#include "elementwise_kernels.cuh"
