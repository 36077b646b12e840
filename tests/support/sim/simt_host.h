// A small SIMT emulator, enough to run cuda/prefill_mma.cuh,
// cuda/decode_attention.cuh and cuda/sampling.cuh on the host.
//
// Each CUDA thread of a block is an OS thread. __syncthreads is a barrier of
// the block's threads; __shfl_xor_sync and mma.sync are warp-collective:
// every lane publishes its operand, the warp waits, each lane computes its
// result from all lanes' operands, the warp waits again. mma.sync
// m16n8k16 rebuilds A (16x16), B (16x8) from the fragments with the row
// and column formulas of the PTX ISA ("Matrix Fragments for mma.m16n8k16
// with floating point type"), written here independently of the kernel's
// own pointer arithmetic, so a fragment indexed wrongly by the kernel
// shows up as a wrong result.
//
// cp.async (cuda/pipeline.cuh) is modelled at its worst: a copy's
// destination reads as NaN bytes (0xff) from its issue until cp_async_wait
// lets its group complete (each wait re-poisons the copies still in
// flight), and only then holds its source, so a read of a stage before its
// wait, a wait for too few groups, or a copy issued into a stage still
// being read shows up as NaN.
// ldmatrix is warp-collective like mma.sync: each lane publishes its row
// address and takes its fragment from the PTX ISA's layout.
//
// Not emulated: memory ordering (everything is sequentially consistent
// here), timing, and the exact f32 summation order of the tensor cores.
#pragma once
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <thread>
#include <vector>

#define __device__
#define __forceinline__ inline
#define __host__
#define __restrict__ __restrict
// One block runs at a time (the harnesses launch blocks in turn), so a
// function's statics are its block's shared memory.
#define __shared__ static

using std::isfinite;
using std::isnan;

struct SimDim3 {
    unsigned x, y, z;
};
inline thread_local SimDim3 threadIdx;
inline thread_local SimDim3 blockIdx;
inline thread_local SimDim3 blockDim;
inline thread_local SimDim3 gridDim;

struct alignas(16) uint4 {
    uint32_t x, y, z, w;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return {x, y, z, w}; }
struct alignas(8) uint2 {
    uint32_t x, y;
};
struct float2 {
    float x, y;
};
inline float2 make_float2(float x, float y) { return {x, y}; }

template <typename T>
inline T min(T a, T b) { return a < b ? a : b; }
template <typename T>
inline T max(T a, T b) { return a > b ? a : b; }

struct __half {
    uint16_t bits;
};
struct __nv_bfloat16 {
    uint16_t bits;
};

namespace sim {

struct Warp {
    std::barrier<> bar{32};
    uint32_t a[32][4];
    uint32_t b[32][2];
    uint64_t word[32];
    const void* row[32];
};

// One thread's cp.async copies: the open group and the committed ones,
// oldest first.
struct AsyncCopy {
    void* dst;
    const void* src;
    bool fill;
};
struct AsyncGroups {
    std::vector<AsyncCopy> open;
    std::deque<std::vector<AsyncCopy>> committed;
};
inline thread_local AsyncGroups async_groups;

struct ThreadCtx {
    Warp* warp;
    std::barrier<>* block;
    unsigned char* smem;
};
inline thread_local ThreadCtx ctx;

// Runs `body` as every thread of every block of a gx x gy grid of blocks of
// `threads` threads (a multiple of 32), one block at a time, each block
// with `smem_bytes` of shared memory that starts as 0xff bytes (a NaN in
// every f32 slot: a read of a slot nothing wrote shows).
template <typename Body>
void run_blocks(unsigned gx, unsigned gy, unsigned threads, size_t smem_bytes, Body body);

inline float f16_to_float(uint16_t h) {
    _Float16 x;
    std::memcpy(&x, &h, 2);
    return (float)x;
}
inline uint16_t float_to_f16(float f) {
    _Float16 x = (_Float16)f;  // round to nearest even
    uint16_t h;
    std::memcpy(&h, &x, 2);
    return h;
}
inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if (std::isnan(f)) return 0x7fc0;
    u += 0x7fff + ((u >> 16) & 1);  // round to nearest even
    return (uint16_t)(u >> 16);
}

// FP8 E4M3 ("fn": no infinities; NaN is S.1111.111), as the device's
// cvt.rn.satfinite.e4m3x2.f32 and cvt.f16x2.e4m3x2 convert. Written from
// the format's definition (by scaling, not bit fields as src/kv/fp8.rs does).
inline float fp8_e4m3_to_float(uint8_t b) {
    const float sign = (b & 0x80) ? -1.0f : 1.0f;
    const int e = (b >> 3) & 0xF, m = b & 7;
    if (e == 0xF && m == 7) return std::copysign(NAN, sign);
    if (e == 0) return sign * std::ldexp((float)m, -9);
    return sign * std::ldexp((float)(8 + m), e - 10);
}
inline uint8_t float_to_fp8_e4m3(float x) {
    if (std::isnan(x)) return 0x7F;
    const uint8_t sign = std::signbit(x) ? 0x80 : 0;
    const double a = std::fabs((double)x);
    if (a >= 448.0) return sign | 0x7E;
    // The spacing of E4M3 values around a: 2^(e - 3) for a in [2^e, 2^(e+1)),
    // 2^-9 below 2^-6. Dividing by a power of two is exact; nearbyint
    // rounds to nearest even (the default rounding mode).
    int e;
    std::frexp(a, &e);  // a in [2^(e-1), 2^e)
    const int step = e - 1 < -6 ? -9 : e - 1 - 3;
    const double q = std::nearbyint(std::ldexp(a, -step));  // steps of 2^step
    const double v = std::ldexp(q, step);  // the rounded value (at most 448)
    if (v == 0.0) return sign;
    if (v < 1.0 / 64.0) return sign | (uint8_t)q;  // subnormal: m = q
    int ve;
    const double f = std::frexp(v, &ve);  // v = f 2^ve, f in [0.5, 1)
    const int m = (int)std::ldexp(f, 4) - 8;  // 1.mmm = 2f
    return sign | (uint8_t)((ve - 1 + 7) << 3 | m);
}

template <typename T> struct Conv;
template <> struct Conv<__half> {
    static float to(uint16_t h) { return f16_to_float(h); }
    static uint16_t from(float f) { return float_to_f16(f); }
};
template <> struct Conv<__nv_bfloat16> {
    static float to(uint16_t h) { return bf16_to_float(h); }
    static uint16_t from(float f) { return float_to_bf16(f); }
};

// D = A B + C for one warp, this lane's part: see the header comment.
template <typename T>
inline void mma_m16n8k16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    Warp& w = *ctx.warp;
    const int lane = threadIdx.x & 31;
    std::memcpy(w.a[lane], a, sizeof(w.a[lane]));
    w.b[lane][0] = b0;
    w.b[lane][1] = b1;
    w.bar.arrive_and_wait();
    float A[16][16], B[16][8];
    for (int l = 0; l < 32; ++l) {
        const int group = l >> 2, tid = l % 4;
        for (int i = 0; i < 8; ++i) {  // a_i: register i / 2, half i % 2
            const uint16_t bits = (uint16_t)(w.a[l][i / 2] >> (16 * (i % 2)));
            const int row = (i < 2 || (i >= 4 && i < 6)) ? group : group + 8;
            const int col = tid * 2 + (i & 1) + (i >= 4 ? 8 : 0);
            A[row][col] = Conv<T>::to(bits);
        }
        for (int i = 0; i < 4; ++i) {  // b_i
            const uint16_t bits = (uint16_t)(w.b[l][i / 2] >> (16 * (i % 2)));
            const int row = tid * 2 + (i & 1) + (i >= 2 ? 8 : 0);
            B[row][group] = Conv<T>::to(bits);
        }
    }
    const int group = lane >> 2, tid = lane % 4;
    for (int i = 0; i < 4; ++i) {  // c_i
        const int row = i < 2 ? group : group + 8;
        const int col = tid * 2 + (i & 1);
        float acc = c[i];
        for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
        c[i] = acc;
    }
    w.bar.arrive_and_wait();  // nobody overwrites operands still being read
}

// SplitMix64 test data for the emulated programs.
struct Rng {
    uint64_t s;
    uint64_t next() {
        s += 0x9E3779B97F4A7C15ull;
        uint64_t z = s;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
    float uniform() { return (float)(next() >> 40) / (float)(1u << 23) - 1.0f; }  // [-1, 1)
};

}  // namespace sim

template <typename V>
inline V __shfl_xor_sync(unsigned /*mask*/, V v, int lane_mask) {
    static_assert(sizeof(V) <= 8, "shuffled values fit 8 bytes");
    sim::Warp& w = *sim::ctx.warp;
    const int lane = threadIdx.x & 31;
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(V));
    w.word[lane] = bits;
    w.bar.arrive_and_wait();
    const uint64_t other = w.word[lane ^ lane_mask];
    w.bar.arrive_and_wait();
    V out;
    std::memcpy(&out, &other, sizeof(V));
    return out;
}

inline void __syncthreads() { sim::ctx.block->arrive_and_wait(); }
inline void __syncwarp(unsigned /*mask*/ = 0xffffffffu) { sim::ctx.warp->bar.arrive_and_wait(); }

// Nonzero on every lane when `pred` is nonzero on any lane of the warp.
inline int __any_sync(unsigned /*mask*/, int pred) {
    sim::Warp& w = *sim::ctx.warp;
    const int lane = threadIdx.x & 31;
    w.word[lane] = pred != 0;
    w.bar.arrive_and_wait();
    int any = 0;
    for (int l = 0; l < 32; ++l) any |= w.word[l] != 0;
    w.bar.arrive_and_wait();
    return any;
}

// Nonzero on every thread when `pred` is nonzero on any thread of the block.
inline int __syncthreads_or(int pred) {
    static std::atomic<int> any{0};  // one block at a time
    sim::ctx.block->arrive_and_wait();
    if (pred) any.store(1);
    sim::ctx.block->arrive_and_wait();
    const int r = any.load();
    sim::ctx.block->arrive_and_wait();
    if (threadIdx.x == 0) any.store(0);  // before anyone can enter the next call
    return r;
}

// The CUDA conversions, rounding to nearest even as the device does.
inline float __half2float(__half h) { return sim::f16_to_float(h.bits); }
inline float __bfloat162float(__nv_bfloat16 h) { return sim::bf16_to_float(h.bits); }
inline __half __float2half_rn(float f) { return {sim::float_to_f16(f)}; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return {sim::float_to_bf16(f)}; }

// Bit casts, conversions and correctly rounded f64 operations of the CUDA
// math API, as the host computes them (x86-64's SSE2 rounds each one on its
// own; the emulator is built with -ffp-contract=off).
inline uint32_t __float_as_uint(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float __int_as_float(int v) {
    float f;
    std::memcpy(&f, &v, 4);
    return f;
}
inline double __longlong_as_double(long long v) {
    double d;
    std::memcpy(&d, &v, 8);
    return d;
}
inline long long __double_as_longlong(double d) {
    long long v;
    std::memcpy(&v, &d, 8);
    return v;
}
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline unsigned long long __double2ull_rz(double d) { return (unsigned long long)d; }
inline double __ull2double_rn(unsigned long long v) { return (double)v; }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
inline unsigned long long atomicAdd(unsigned long long* at, unsigned long long v) {
    return std::atomic_ref<unsigned long long>(*at).fetch_add(v);
}

namespace handoff {

template <typename T> struct MmaOp {
    static void run(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
        sim::mma_m16n8k16<T>(c, a, b0, b1);
    }
    static uint32_t pack(float lo, float hi) {
        return (uint32_t)sim::Conv<T>::from(lo) | ((uint32_t)sim::Conv<T>::from(hi) << 16);
    }
};

inline unsigned char* dyn_smem() { return sim::ctx.smem; }

inline void cp_async_16(void* dst, const void* src, bool fill) {
    std::memset(dst, 0xff, 16);  // undefined until the wait: NaN here
    sim::async_groups.open.push_back({dst, src, fill});
}

inline void cp_async_commit() {
    auto& g = sim::async_groups;
    g.committed.push_back(std::move(g.open));
    g.open.clear();
}

template <int N>
inline void cp_async_wait() {
    auto& g = sim::async_groups;
    while (g.committed.size() > (size_t)N) {
        for (const auto& c : g.committed.front()) {
            if (c.fill) std::memcpy(c.dst, c.src, 16);
            else std::memset(c.dst, 0, 16);
        }
        g.committed.pop_front();
    }
    // The copies still in flight may land at any moment: their destinations
    // stay NaN (a copy issued into a stage that is still being read, or one
    // an older group's landing overwrote, shows up).
    for (const auto& group : g.committed) {
        for (const auto& c : group) std::memset(c.dst, 0xff, 16);
    }
    for (const auto& c : g.open) std::memset(c.dst, 0xff, 16);
}

// See cuda/pipeline.cuh: matrix i's rows come from lanes 8i..8i+7 (each
// lane publishes its row address, as mma.sync's lanes their fragments);
// lane l takes (l / 4, 2 (l % 4)) and (l / 4, 2 (l % 4) + 1) of each, or,
// transposed, (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4).
inline void ldmatrix_x4_impl(uint32_t r[4], const void* row, bool trans) {
    sim::Warp& w = *sim::ctx.warp;
    const int lane = threadIdx.x & 31;
    w.row[lane] = row;
    w.bar.arrive_and_wait();
    const int a = lane / 4, b = 2 * (lane % 4);  // row, column of the first element
    auto at = [&](int i, int rr, int cc) {
        uint16_t v;
        std::memcpy(&v, static_cast<const uint16_t*>(w.row[8 * i + rr]) + cc, 2);
        return (uint32_t)v;
    };
    for (int i = 0; i < 4; ++i) {
        const uint32_t lo = trans ? at(i, b, a) : at(i, a, b);
        const uint32_t hi = trans ? at(i, b + 1, a) : at(i, a, b + 1);
        r[i] = lo | (hi << 16);
    }
    w.bar.arrive_and_wait();
}

inline void ldmatrix_x4(uint32_t r[4], const void* row) { ldmatrix_x4_impl(r, row, false); }
inline void ldmatrix_x4_trans(uint32_t r[4], const void* row) { ldmatrix_x4_impl(r, row, true); }

}  // namespace handoff

template <typename Body>
void sim::run_blocks(unsigned gx, unsigned gy, unsigned threads, size_t smem_bytes, Body body) {
    for (unsigned by = 0; by < gy; ++by)
        for (unsigned bx = 0; bx < gx; ++bx) {
            std::barrier<> block(threads);
            std::vector<Warp> warps(threads / 32);
            std::vector<unsigned char> smem(smem_bytes, 0xff);
            std::vector<std::thread> ts;
            for (unsigned t = 0; t < threads; ++t)
                ts.emplace_back([&, t] {
                    threadIdx = {t, 0, 0};
                    blockIdx = {bx, by, 0};
                    blockDim = {threads, 1, 1};
                    gridDim = {gx, gy, 1};
                    ctx = {&warps[t / 32], &block, smem.data()};
                    body();
                });
            for (auto& th : ts) th.join();
        }
}
