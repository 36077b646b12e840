// Helpers shared by the kernels: KV element conversion, vector loads, warp
// and block reductions.
#pragma once
#ifdef HANDOFF_SIMT_HOST
#include "simt_host.h"  // the host SIMT emulator (tests/support/sim/)
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>
#endif

namespace handoff {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// An f16 value as f32, from its bits (exact): 16-bit weights and ggml block
// scales, read as raw bits.
__device__ __forceinline__ float f16_bits_to_f32(uint32_t bits) {
#ifdef HANDOFF_SIMT_HOST
    return sim::f16_to_float((uint16_t)bits);
#else
    return __half2float(__ushort_as_half((unsigned short)bits));
#endif
}

// FP8 E4M3 KV elements (OCP "fn": no infinities), the bytes src/kv/fp8.rs
// stores: from f32 rounded to nearest even, saturated to +-448 (satfinite),
// NaN kept as NaN. Every E4M3 value is an f16, so widening is exact.
struct fp8_e4m3 {
    uint8_t bits;
};
__device__ __forceinline__ float to_float(fp8_e4m3 x) {
#ifdef HANDOFF_SIMT_HOST
    return sim::fp8_e4m3_to_float(x.bits);
#else
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(x.bits, __NV_E4M3)));
#endif
}

// The tensor cores' operand type for KV stored as T: T itself, or f16 for
// FP8 (whose tiles the attention kernels widen in shared memory).
template <typename T> struct MmaOperandOf {
    using type = T;
};
template <> struct MmaOperandOf<fp8_e4m3> {
    using type = __half;
};
template <typename T> using MmaOperand = typename MmaOperandOf<T>::type;

// Four E4M3 values (the bytes of w, lowest first) widened to f16, as two
// f16x2 words: lo holds bytes 0 and 1 (byte 0 in its low half), hi 2 and 3.
__device__ __forceinline__ void fp8x4_to_half2x2(uint32_t w, uint32_t& lo, uint32_t& hi) {
#ifdef HANDOFF_SIMT_HOST
    auto h = [](uint32_t b) { return (uint32_t)sim::float_to_f16(sim::fp8_e4m3_to_float((uint8_t)b)); };
    lo = h(w & 0xFF) | h((w >> 8) & 0xFF) << 16;
    hi = h((w >> 16) & 0xFF) | h(w >> 24) << 16;
#else
    const __half2_raw a = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w & 0xFFFF), __NV_E4M3);
    const __half2_raw b = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w >> 16), __NV_E4M3);
    lo = (uint32_t)a.x | (uint32_t)a.y << 16;
    hi = (uint32_t)b.x | (uint32_t)b.y << 16;
#endif
}

// A 16-byte chunk of 16 E4M3 values widened to f16: the two 16-byte
// chunks lo (values 0-7) and hi (8-15). The attention kernels widen landed
// FP8 tiles with it.
__device__ __forceinline__ void fp8x16_to_half(const uint4& raw, uint4& lo, uint4& hi) {
    fp8x4_to_half2x2(raw.x, lo.x, lo.y);
    fp8x4_to_half2x2(raw.y, lo.z, lo.w);
    fp8x4_to_half2x2(raw.z, hi.x, hi.y);
    fp8x4_to_half2x2(raw.w, hi.z, hi.w);
}

// Round to nearest even, as the host's `half` crate (and src/kv/fp8.rs) do.
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ fp8_e4m3 from_float<fp8_e4m3>(float x) {
#ifdef HANDOFF_SIMT_HOST
    return fp8_e4m3{sim::float_to_fp8_e4m3(x)};
#else
    return fp8_e4m3{(uint8_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)};
#endif
}

// The word of a vector load of `BYTES` bytes: 16 bytes, or 8 (FP8 KV,
// 8 elements a thread).
template <int BYTES> struct LoadWord {
    using type = uint4;
};
template <> struct LoadWord<8> {
    using type = uint2;
};

// N elements of T as raw words (N * sizeof(T) is a multiple of 16, or 8;
// the address is aligned to that: see the callers).
template <typename T, int N>
struct Raw {
    static constexpr int BYTES = N * (int)sizeof(T);
    static_assert(BYTES % 16 == 0 || BYTES == 8, "vector loads are whole 16-byte words, or one 8-byte one");
    using Word = typename LoadWord<BYTES % 16 == 0 ? 16 : 8>::type;
    static constexpr int WORDS = BYTES / (int)sizeof(Word);
    Word w[WORDS];

    __device__ __forceinline__ void load(const T* __restrict__ p) {
        const Word* src = reinterpret_cast<const Word*>(p);
#pragma unroll
        for (int i = 0; i < WORDS; ++i) w[i] = src[i];
    }
    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int i = 0; i < WORDS; ++i) w[i] = Word{};
    }
    __device__ __forceinline__ float get(int i) const {
        return to_float(reinterpret_cast<const T*>(w)[i]);
    }
};

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

// x reduced over the block by `warp_op` (warp_sum, warp_max), with
// `identity` for the missing warps (blockDim.x a multiple of 32, at most
// 1024). Every thread gets the result. Uses 32 floats of shared memory.
template <typename WarpOp>
__device__ __forceinline__ float block_reduce(float x, float identity, WarpOp warp_op) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    x = warp_op(x);
    __syncthreads();  // partial may still be read by a previous call
    if (lane == 0) partial[warp] = x;
    __syncthreads();
    const int n_warps = blockDim.x >> 5;
    float y = lane < n_warps ? partial[lane] : identity;
    return warp_op(y);
}

__device__ __forceinline__ float block_sum(float x) {
    return block_reduce(x, 0.0f, [](float v) { return warp_sum(v); });
}

__device__ __forceinline__ float block_max(float x) {
    return block_reduce(x, -INFINITY, [](float v) { return warp_max(v); });
}

// 2^x on the special-function unit (ex2.approx.ftz: relative error about
// 2^-22, results below 2^-126 flushed to 0), without exp2f's rescaling of
// the denormal range (three more instructions per call). For softmax
// weights, where anything below 2^-126 of the maximum is nothing. PTX
// gives its special cases: 2^±0 is exactly 1 (so an unchanged maximum still
// skips the rescale), 2^-inf is +0, NaN stays NaN.
__device__ __forceinline__ float fast_exp2(float x) {
#ifdef HANDOFF_SIMT_HOST
    const float y = std::exp2(x);
    return std::fpclassify(y) == FP_SUBNORMAL ? 0.0f : y;
#else
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#endif
}

// Programmatic dependent launch (sm_90 and newer; no-ops on older code and
// on the host emulator, which runs launches one after another). A kernel
// the host queues with programmatic stream serialization (ops/queue.rs,
// `launch_with` with `overlap`) may have its blocks scheduled before the
// launch ahead of it ends: it must call pdl_wait() before its first global
// read, which returns once that launch has completed and its writes are
// visible. The launch ahead lets it be scheduled early by calling
// pdl_launch_dependents() (its blocks' signals; without them, the dependent
// starts at its end).
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Element offset of (page, layer, k|v, slot 0) in the arena; see params.cuh.
__device__ __forceinline__ uint64_t kv_page_offset(uint64_t page, uint64_t page_stride,
                                                   uint32_t layer, uint32_t kv,
                                                   uint32_t page_size_log2, uint32_t kv_dim) {
    return page * page_stride + ((uint64_t)(layer * 2 + kv) << page_size_log2) * kv_dim;
}

}  // namespace handoff
