// Asynchronous copies into shared memory and shared-memory matrix loads,
// for the pipelined tensor-core kernels (decode_mma.cuh, prefill_mma.cuh):
//   cp_async_16(dst, src, fill)  16 bytes global -> shared, in the
//                                background (cp.async.cg); fill == false
//                                writes 16 zero bytes and reads nothing
//   cp_async_commit()            closes the thread's current group of copies
//   cp_async_wait<N>()           waits until at most N of the thread's
//                                groups are still in flight
//   ldmatrix_x4(r, row)          four 8x8 b16 matrices from rows named by
//                                lanes 8i..8i+7 of matrix i
//   ldmatrix_x4_trans(r, row)    the same, transposed
//   dyn_smem()                   the block's dynamic shared memory
// A copy's bytes are visible to its own thread after the wait, and to the
// other lanes after a __syncwarp (or __syncthreads) that follows it.
//
// The host SIMT emulator (tests/support/sim/simt_host.h) defines the same
// functions; there a copy lands only at its wait and its destination reads
// as NaN until then, so a kernel that reads a stage too early fails its
// emulator test.
#pragma once
#include "common.cuh"

namespace handoff {

#ifndef HANDOFF_SIMT_HOST
__device__ __forceinline__ unsigned char* dyn_smem() {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    return smem_raw;
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

// dst: 16-byte aligned shared memory; src: 16-byte aligned global memory,
// read only when `fill` (any valid address otherwise).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool fill) {
    const int n = fill ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(n)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// r[i]: this lane's fragment of matrix i (rows from lanes 8i..8i+7's `row`,
// each 16 bytes, 16-byte aligned): lane l gets elements (l / 4, 2 (l % 4))
// and (l / 4, 2 (l % 4) + 1), the first in the low half.
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(row))
                 : "memory");
}

// As ldmatrix_x4, transposed: lane l gets elements
// (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4), the first in the low half.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(row))
                 : "memory");
}
#endif

}  // namespace handoff
