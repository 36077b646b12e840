// Instantiations of the tensor-core prefill kernel (prefill_mma.cuh).
#include "prefill_mma.cuh"

using namespace handoff;

// Explicit instantiations: prefill_mma_<dtype>_d<head_dim>. The host sets
// each one's dynamic shared memory to PmmaCfg::SMEM_BYTES, mirrored in
// src/backend/cuda/launch.rs.
#define PMMA_KERNEL(T, TN, D)                                                        \
    extern "C" __global__ void __launch_bounds__(PMMA_THREADS)                      \
        prefill_mma_##TN##_d##D(const PrefillParams p) {                          \
        prefill_mma<T, D>(p);                                                        \
    }
PMMA_KERNEL(__half, f16, 64)
PMMA_KERNEL(__half, f16, 128)
PMMA_KERNEL(__nv_bfloat16, bf16, 64)
PMMA_KERNEL(__nv_bfloat16, bf16, 128)

static_assert(PmmaCfg<64>::SMEM_BYTES == 192 * 72 * 2, "mirrored in launch.rs");
static_assert(PmmaCfg<128>::SMEM_BYTES == 192 * 136 * 2, "mirrored in launch.rs");
