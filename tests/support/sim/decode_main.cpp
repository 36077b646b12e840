// Runs decode attention (cuda/decode_attention.cuh's scalar kernel or
// cuda/decode_mma.cuh's tensor-core kernel, then the split-KV merge when
// there is more than one chunk) on the SIMT emulator (simt_host.h); driven
// by tests/cuda/decode_host.rs, which checks the outputs against an f64
// reference.
//
// Usage: decode_sim INPUT
//   INPUT, little-endian: u32 dtype (0 f32, 1 f16, 2 bf16, 3 fp8 e4m3),
//   u32 head_dim (64 or 128; 8, 16 and 256 scalar only), u32 GROUP (the
//   instantiation: 1, 4 or 8 scalar, 8 or 16 tensor-core), u32 kernel (0
//   scalar, 1 tensor-core, 2 the wide tensor-core one; f16, bf16, FP8), then
//   DecodeParams' scalars: u32 batch, n_heads, n_kv_heads, group, layer,
//   page_size_log2, num_splits, chunk_tokens, auto_max_splits, f32
//   sm_scale_log2, u64 page_stride, u64 arena elements; then q (f32),
//   the arena (KV dtype), page_indptr, page_table (u32: its length is
//   page_indptr[batch]) and kv_len (u32).
// Prints every output element's f32 bits, one per line.
#include <cstdio>
#include <thread>
#include <vector>

#include "decode_attention.cuh"
#include "decode_mma.cuh"

using namespace handoff;

// Every block of the grid in turn, `threads` OS threads each, with `smem`
// bytes of dynamic shared memory.
template <typename Body>
void launch(SimDim3 grid, unsigned threads, Body body, size_t smem = 0) {
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                std::barrier<> block(threads);
                std::vector<sim::Warp> warps(threads / 32);
                std::vector<uint4> shared((smem + 15) / 16);
                std::vector<std::thread> ts;
                for (unsigned t = 0; t < threads; ++t)
                    ts.emplace_back([&, t] {
                        threadIdx = {t, 0, 0};
                        blockIdx = {x, y, z};
                        blockDim = {threads, 1, 1};
                        sim::ctx = {&warps[t / 32], &block,
                                    reinterpret_cast<unsigned char*>(shared.data())};
                        body();
                    });
                for (auto& th : ts) th.join();
            }
}

template <typename T>
std::vector<T> read_vec(FILE* f, size_t n) {
    std::vector<T> v(n);
    if (n && std::fread(v.data(), sizeof(T), n, f) != n) std::exit(5);
    return v;
}

// WARPS: the tensor-core kernel's warps a block; 0 for the scalar kernel.
template <typename T, int HD, int G, int WARPS>
std::vector<float> run(FILE* f, DecodeParams p, uint64_t arena) {
    const auto q = read_vec<float>(f, (size_t)p.batch * p.n_heads * HD);
    const auto kv = read_vec<T>(f, arena);
    const auto indptr = read_vec<uint32_t>(f, p.batch + 1);
    const auto table = read_vec<uint32_t>(f, indptr[p.batch]);
    const auto len = read_vec<uint32_t>(f, p.batch);
    std::vector<float> out((size_t)p.batch * p.n_heads * HD, -1.0f);
    std::vector<float> part_o((size_t)p.batch * p.n_heads * p.num_splits * HD);
    std::vector<float> part_lse((size_t)p.batch * p.n_heads * p.num_splits);
    p.q = q.data();
    p.kv = kv.data();
    p.page_indptr = indptr.data();
    p.page_table = table.data();
    p.kv_len = len.data();
    p.out = out.data();
    p.part_o = part_o.data();
    p.part_lse = part_lse.data();
    const unsigned slices = (p.group + G - 1) / G;
    if constexpr (WARPS != 0) {
        launch({p.num_splits, p.n_kv_heads * slices, p.batch}, WARPS * 32,
               [&] { decode_mma<T, HD, G, WARPS>(p); }, DmmaCfg<HD, WARPS>::SMEM_BYTES);
    } else {
        launch({p.num_splits, p.n_kv_heads * slices, p.batch}, DECODE_THREADS,
               [&] { decode_attention<T, HD, G>(p); });
    }
    if (p.num_splits > 1) {
        MergeParams m{part_o.data(), part_lse.data(), out.data(), p.batch, p.n_heads, (uint32_t)HD,
                      p.num_splits};
        launch({p.n_heads, p.batch, 1}, 128, [&] { decode_merge_impl(m); });
    }
    return out;
}

template <typename T, int HD, int WARPS>
std::vector<float> by_mma_group(FILE* f, uint32_t g, const DecodeParams& p, uint64_t arena) {
    switch (g) {
        case 8: return run<T, HD, 8, WARPS>(f, p, arena);
        case 16: return run<T, HD, 16, WARPS>(f, p, arena);
        default: std::exit(6);
    }
}

template <typename T, int HD>
std::vector<float> by_group(FILE* f, uint32_t g, uint32_t kernel, const DecodeParams& p,
                            uint64_t arena) {
    if (kernel != 0) {
        if constexpr (sizeof(T) != 4) {
            if (kernel == 1) return by_mma_group<T, HD, DMMA_WARPS>(f, g, p, arena);
            if (kernel == 2) return by_mma_group<T, HD, DMMA_WIDE_WARPS>(f, g, p, arena);
            std::exit(10);
        }
        std::exit(9);  // tensor cores take f16, bf16 and FP8 only
    }
    switch (g) {
        case 1: return run<T, HD, 1, 0>(f, p, arena);
        case 4: return run<T, HD, 4, 0>(f, p, arena);
        case 8: return run<T, HD, 8, 0>(f, p, arena);
        default: std::exit(6);
    }
}

template <typename T>
std::vector<float> by_dim(FILE* f, uint32_t hd, uint32_t g, uint32_t kernel, const DecodeParams& p,
                          uint64_t arena) {
    switch (hd) {
        case 64: return by_group<T, 64>(f, g, kernel, p, arena);
        case 128: return by_group<T, 128>(f, g, kernel, p, arena);
        // Rows narrower than a 16-byte load in FP8 (8) or exactly one (16).
        case 8:
            if (kernel == 0 && g == 4) return run<T, 8, 4, 0>(f, p, arena);
            std::exit(6);
        case 16:
            if (kernel == 0 && g == 1) return run<T, 16, 1, 0>(f, p, arena);
            std::exit(6);
        // 256: the scalar kernel, group 1 only (two dims per merge thread).
        case 256:
            if (kernel == 0 && g == 1) return run<T, 256, 1, 0>(f, p, arena);
            std::exit(6);
        default: std::exit(7);
    }
}

int main(int argc, char** argv) {
    if (argc != 2) return 2;
    FILE* f = std::fopen(argv[1], "rb");
    if (!f) return 3;
    uint32_t head[4], s[9];
    float scale;
    uint64_t stride, arena;
    if (std::fread(head, 4, 4, f) != 4 || std::fread(s, 4, 9, f) != 9 || std::fread(&scale, 4, 1, f) != 1 ||
        std::fread(&stride, 8, 1, f) != 1 || std::fread(&arena, 8, 1, f) != 1)
        return 4;
    DecodeParams p{};
    p.batch = s[0];
    p.n_heads = s[1];
    p.n_kv_heads = s[2];
    p.group = s[3];
    p.layer = s[4];
    p.page_size_log2 = s[5];
    p.num_splits = s[6];
    p.chunk_tokens = s[7];
    p.auto_max_splits = s[8];
    p.sm_scale_log2 = scale;
    p.page_stride = stride;
    std::vector<float> out;
    switch (head[0]) {
        case 0: out = by_dim<float>(f, head[1], head[2], head[3], p, arena); break;
        case 1: out = by_dim<__half>(f, head[1], head[2], head[3], p, arena); break;
        case 2: out = by_dim<__nv_bfloat16>(f, head[1], head[2], head[3], p, arena); break;
        case 3: out = by_dim<fp8_e4m3>(f, head[1], head[2], head[3], p, arena); break;
        default: return 8;
    }
    std::fclose(f);
    for (float x : out) std::printf("%u\n", __float_as_uint(x));
    return 0;
}
