// Dense layers of the forward pass: x · wᵀ in f32, and in-place adds.
//
// The GEMM is a plain 16x16 shared-memory tiling: correct and
// batch-invariant (each output sums k in ascending order whatever m is),
// not fast. cuBLAS or a tensor-core GEMM replaces it for real models.
#include "common.cuh"
#include "params.cuh"

namespace handoff {

constexpr int LIN_TILE = 16;

__device__ __forceinline__ void linear(const LinearParams& p) {
    __shared__ float xs[LIN_TILE][LIN_TILE + 1];  // x tile [row][k]
    __shared__ float ws[LIN_TILE][LIN_TILE + 1];  // w tile [col][k]
    const uint32_t tx = threadIdx.x, ty = threadIdx.y;
    const uint32_t col0 = blockIdx.x * LIN_TILE, row0 = blockIdx.y * LIN_TILE;
    const uint32_t i = row0 + ty, j = col0 + tx;
    float acc = 0.0f;
    for (uint32_t k0 = 0; k0 < p.k; k0 += LIN_TILE) {
        const uint32_t kk = k0 + tx;
        xs[ty][tx] = (row0 + ty < p.m && kk < p.k) ? p.x[(uint64_t)(row0 + ty) * p.k + kk] : 0.0f;
        ws[ty][tx] = (col0 + ty < p.n && kk < p.k) ? p.w[(uint64_t)(col0 + ty) * p.k + kk] : 0.0f;
        __syncthreads();
        const uint32_t kn = min((uint32_t)LIN_TILE, p.k - k0);
        for (uint32_t t = 0; t < kn; ++t) acc = fmaf(xs[ty][t], ws[tx][t], acc);
        __syncthreads();
    }
    if (i < p.m && j < p.n) p.out[(uint64_t)i * p.n + j] = acc;
}

__device__ __forceinline__ void add_periodic(const AddParams& p) {
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < p.n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        p.x[i] += p.y[i % p.period];
    }
}

}  // namespace handoff

extern "C" __global__ void __launch_bounds__(256) linear(const handoff::LinearParams p) { handoff::linear(p); }
extern "C" __global__ void add_periodic(const handoff::AddParams p) { handoff::add_periodic(p); }
