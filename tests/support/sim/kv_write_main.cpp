// Runs cuda/kv_write.cuh's RoPE with its append against RoPE alone followed
// by kv_append, on the SIMT emulator; driven by tests/cuda/kv_write_host.rs.
//
// Each case rotates q (n_heads) and k (k_heads) for ragged positions and
// appends k and v to shuffled slots of layer 1 of an arena that is NaN
// everywhere else. The fused launch must leave q, k and the whole arena
// with the bits of the two launches, and the two launches must have stored
// exactly the rounded rows in exactly the given slots. Prints one line per
// case; exit status 0 when all pass.
//
// `kv_write_sim fp8 FILE`: the FP8 E4M3 conversions instead. FILE holds
// little-endian f32 values; prints the code each converts to (one per
// line), then the f32 bits of each of the 256 codes.
#include <cstdio>
#include <cstring>
#include <vector>

#include "kv_write.cuh"

using namespace handoff;
using sim::Rng;

// A grid-stride kernel over `blocks` blocks of 256 threads, one after another
// (no barriers in these kernels).
template <typename Body>
void launch(unsigned blocks, Body body) {
    for (unsigned b = 0; b < blocks; ++b)
        for (unsigned t = 0; t < 256; ++t) {
            threadIdx = {t, 0, 0};
            blockIdx = {b, 0, 0};
            blockDim = {256, 1, 1};
            gridDim = {blocks, 1, 1};
            body();
        }
}

struct Case {
    const char* name;
    int head_dim, n_heads, k_heads, page_size, style, scaling;
    std::vector<uint32_t> positions;
};

template <typename T> const char* dtype_name();
template <> const char* dtype_name<float>() { return "f32"; }
template <> const char* dtype_name<__half>() { return "f16"; }
template <> const char* dtype_name<__nv_bfloat16>() { return "bf16"; }
template <> const char* dtype_name<fp8_e4m3>() { return "fp8"; }

template <typename T>
bool run_case(const Case& c, Rng& rng) {
    const int n_layers = 2, layer = 1, hd = c.head_dim, kv_dim = c.k_heads * hd;
    const int n = (int)c.positions.size();
    const int n_pages = (n + c.page_size - 1) / c.page_size + 3;
    // Shuffled slots: every token its own (page, slot).
    std::vector<uint32_t> all(n_pages * c.page_size);
    for (size_t i = 0; i < all.size(); ++i) all[i] = i;
    for (size_t i = all.size() - 1; i > 0; --i) std::swap(all[i], all[rng.next() % (i + 1)]);
    std::vector<uint32_t> dst_page(n), dst_slot(n);
    for (int t = 0; t < n; ++t) dst_page[t] = all[t] / c.page_size, dst_slot[t] = all[t] % c.page_size;
    int log2 = 0;
    while ((1 << log2) < c.page_size) ++log2;
    const uint64_t page_stride = (uint64_t)n_layers * 2 * c.page_size * kv_dim;
    std::vector<T> arena1(page_stride * n_pages), arena2;
    for (auto& x : arena1) x = from_float<T>(NAN);
    arena2 = arena1;
    std::vector<float> q1((size_t)n * c.n_heads * hd), k1((size_t)n * kv_dim), v((size_t)n * kv_dim);
    for (auto& x : q1) x = 4.0f * rng.uniform() - 2.0f;
    for (auto& x : k1) x = 4.0f * rng.uniform() - 2.0f;
    for (auto& x : v) x = 4.0f * rng.uniform() - 2.0f;
    auto q2 = q1, k2 = k1;

    RopeParams r{};
    r.positions = c.positions.data();
    r.theta = 500000.0;
    r.n_tokens = n;
    r.n_heads = c.n_heads;
    r.head_dim = hd;
    r.style = c.style;
    r.n_heads2 = c.k_heads;
    if (c.scaling == 2) {
        r.scaling = 2;
        r.factor = 32.0;
        r.low_freq_factor = 1.0;
        r.high_freq_factor = 4.0;
        r.original_max_position = 8192.0;
    }
    // RoPE alone, then kv_append (two launches).
    RopeParams alone = r;
    alone.x = q1.data();
    alone.x2 = k1.data();
    launch(3, [&] { rope<float>(alone); });
    KvAppendParams a{k1.data(), v.data(), dst_page.data(), dst_slot.data(), arena1.data(),
                     page_stride,     (uint32_t)n, (uint32_t)kv_dim, (uint32_t)layer, (uint32_t)log2};
    launch(2, [&] { kv_append<T>(a); });
    // RoPE with its append (one launch).
    RopeParams fused = r;
    fused.x = q2.data();
    fused.x2 = k2.data();
    fused.v = v.data();
    fused.dst_page = dst_page.data();
    fused.dst_slot = dst_slot.data();
    fused.kv = arena2.data();
    fused.page_stride = page_stride;
    fused.kv_dim = kv_dim;
    fused.layer = layer;
    fused.page_size_log2 = log2;
    launch(3, [&] { rope<T>(fused); });

    auto same = [](const void* x, const void* y, size_t bytes) { return std::memcmp(x, y, bytes) == 0; };
    if (!same(q1.data(), q2.data(), q1.size() * 4) || !same(k1.data(), k2.data(), k1.size() * 4)) {
        std::printf("FAIL %s: the fused launch rotated q or k to other bits\n", c.name);
        return false;
    }
    if (!same(arena1.data(), arena2.data(), arena1.size() * sizeof(T))) {
        std::printf("FAIL %s: the fused launch left the arena with other bits\n", c.name);
        return false;
    }
    // The two launches stored exactly the rounded rows in the given slots.
    size_t stored = 0;
    for (int t = 0; t < n; ++t)
        for (int kv = 0; kv < 2; ++kv)
            for (int e = 0; e < kv_dim; ++e) {
                const uint64_t off = (uint64_t)dst_page[t] * page_stride +
                                     ((uint64_t)(layer * 2 + kv) * c.page_size + dst_slot[t]) * kv_dim + e;
                const float want = (kv == 0 ? k1 : v)[(size_t)t * kv_dim + e];
                const T got = arena1[off];
                const T round = from_float<T>(want);
                if (std::memcmp(&got, &round, sizeof(T)) != 0) {
                    std::printf("FAIL %s: token %d %s element %d not the rounded row\n", c.name, t, kv ? "v" : "k", e);
                    return false;
                }
                ++stored;
            }
    size_t finite = 0;
    for (const T& x : arena1) finite += !std::isnan(to_float(x));
    // Rows of other slots and of layer 0 stay NaN (random rows hold no NaN).
    if (finite != stored) {
        std::printf("FAIL %s: %zu non-NaN elements in the arena, %zu stored\n", c.name, finite, stored);
        return false;
    }
    std::printf("PASS %s %s: %d tokens, q, k and %zu arena elements bit-identical\n", dtype_name<T>(), c.name, n,
                arena1.size());
    return true;
}

int fp8_conversions(const char* path) {
    FILE* f = std::fopen(path, "rb");
    if (!f) return 3;
    float x;
    while (std::fread(&x, 4, 1, f) == 1) std::printf("%u\n", (unsigned)from_float<fp8_e4m3>(x).bits);
    std::fclose(f);
    for (unsigned b = 0; b < 256; ++b) std::printf("%u\n", __float_as_uint(to_float(fp8_e4m3{(uint8_t)b})));
    return 0;
}

int main(int argc, char** argv) {
    if (argc == 3 && std::strcmp(argv[1], "fp8") == 0) return fp8_conversions(argv[2]);
    Rng rng{7};
    const std::vector<Case> cases = {
        {"hd64 rotate-half page16", 64, 8, 2, 16, 1, 0, {0, 1, 2, 3, 17, 18, 40}},
        {"hd128 interleaved page1 llama3", 128, 4, 1, 1, 0, 2, {5, 100000, 7, 8}},
        {"hd64 rotate-half page64 one token", 64, 32, 8, 64, 1, 2, {131071}},
    };
    bool ok = true;
    for (const Case& c : cases) {
        ok = run_case<float>(c, rng) && ok;
        ok = run_case<__half>(c, rng) && ok;
        ok = run_case<__nv_bfloat16>(c, rng) && ok;
        ok = run_case<fp8_e4m3>(c, rng) && ok;
    }
    return ok ? 0 : 1;
}
