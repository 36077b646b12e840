// Dense layers of the forward pass: x · wᵀ in f32, and in-place adds.
//
// A block owns LIN_WARPS output columns (one weight row per warp) for
// LIN_ROWS rows of x. Chunks of those rows of x are staged in shared memory
// for all its warps; each warp reads its weight row in coalesced 128-byte
// runs (lane l takes k = l, l + 32, ...) and its lanes' partial sums are
// combined by a fixed xor butterfly. An output's summation order depends on
// k alone, never on m or on where its row falls in a tile: batch-invariant.
#include "common.cuh"
#include "params.cuh"

namespace handoff {

constexpr int LIN_ROWS = 16;   // rows of x per block
constexpr int LIN_WARPS = 8;   // output columns per block (one per warp)
constexpr int LIN_CHUNK = 256; // k per shared-memory stage (a multiple of 32)

__device__ __forceinline__ void linear(const LinearParams& p) {
    __shared__ float xs[LIN_ROWS][LIN_CHUNK];  // [row][k - k0] of this stage
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint64_t j = (uint64_t)blockIdx.x * LIN_WARPS + warp;  // output column
    const uint64_t i0 = (uint64_t)blockIdx.y * LIN_ROWS;          // first row of x
    const uint32_t rows = (uint32_t)min((uint64_t)LIN_ROWS, (uint64_t)p.m - i0);
    const bool live = j < p.n;  // warps past n still help stage x
    const float* w = p.w + (live ? j : 0) * p.k;  // [k] this column's weights
    float acc[LIN_ROWS];
#pragma unroll
    for (int r = 0; r < LIN_ROWS; ++r) acc[r] = 0.0f;
    for (uint32_t k0 = 0; k0 < p.k; k0 += LIN_CHUNK) {
        const uint32_t kn = min((uint32_t)LIN_CHUNK, p.k - k0);
        for (uint32_t e = threadIdx.x; e < (uint32_t)LIN_ROWS * LIN_CHUNK; e += 32 * LIN_WARPS) {
            const uint32_t r = e / LIN_CHUNK, c = e % LIN_CHUNK;
            xs[r][c] = (r < rows && c < kn) ? p.x[(i0 + r) * p.k + k0 + c] : 0.0f;
        }
        __syncthreads();
        if (live) {
            for (uint32_t c = lane; c < kn; c += 32) {
                const float wv = w[k0 + c];
#pragma unroll
                for (int r = 0; r < LIN_ROWS; ++r) acc[r] = fmaf(xs[r][c], wv, acc[r]);
            }
        }
        __syncthreads();
    }
    if (!live) return;
#pragma unroll
    for (int r = 0; r < LIN_ROWS; ++r) {
        float v = acc[r];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0 && r < (int)rows) p.out[(i0 + r) * p.n + j] = v;
    }
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
