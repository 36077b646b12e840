// Per-element maths that more than one kernel computes: RMSNorm (its row
// scale and product) and SwiGLU. Every rounding is written out (__fmul_rn,
// __fadd_rn, ...: never contracted into an fma), so a kernel that calls
// these gets the bits of any other that does, whatever code surrounds the
// call: elementwise.cu's rms_norm and swiglu, and the matmul tiles that
// carry them in their loads and stores (linear_mma.cuh).
#pragma once
#include "common.cuh"
#include "params.cuh"

namespace handoff {

// Threads of a block that sums one row's squares (the rms_norm launch's
// block size, and the tensor-core matmul's).
constexpr int RMS_THREADS = 256;

// Thread `tid`'s share of the sum of squares of `row` [dim]: elements tid,
// tid + RMS_THREADS, ..., in order. block_sum of the block's shares is the
// row's sum, in one order whatever kernel adds it.
__device__ __forceinline__ float rms_partial(const float* row, uint32_t dim, uint32_t tid) {
    float ss = 0.0f;
    for (uint32_t i = tid; i < dim; i += RMS_THREADS) ss = fmaf(row[i], row[i], ss);
    return ss;
}

// 1 / sqrt(ss / dim + eps): a row's scale from its sum of squares.
__device__ __forceinline__ float rms_scale(float ss, uint32_t dim, float eps) {
    return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)dim), eps)));
}

// One normalised element: (x * scale) * w.
__device__ __forceinline__ float rms_apply(float x, float scale, float w) {
    return __fmul_rn(__fmul_rn(x, scale), w);
}

// SiLU(g) * u = g / (1 + e^-g) * u.
__device__ __forceinline__ float swiglu_of(float g, float u) {
    return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}

// The kernels (elementwise.cu), here so that the SIMT emulator runs them.

// out = RMSNorm(x) * w, row by row: grid (n_rows), block RMS_THREADS.
__device__ __forceinline__ void rms_norm(const RmsNormParams& p) {
    const uint64_t row = blockIdx.x;
    const float* x = p.x + row * p.dim;
    const float scale = rms_scale(block_sum(rms_partial(x, p.dim, threadIdx.x)), p.dim, p.eps);
    float* out = p.out + row * p.dim;
    for (uint32_t i = threadIdx.x; i < p.dim; i += RMS_THREADS) out[i] = rms_apply(x[i], scale, p.w[i]);
}

// out = SwiGLU(gate, up), element by element: grid-stride over n.
__device__ __forceinline__ void swiglu(const SwigluParams& p) {
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < p.n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        p.out[i] = swiglu_of(p.gate[i], p.up[i]);
    }
}

}  // namespace handoff
