// Runs cuda/prefill_mma.cuh's kernel on the SIMT emulator (simt_host.h)
// against an f64 reference; driven by tests/prefill_mma_host.rs.
//
// Each case builds a paged KV arena where everything a sequence was not
// given is NaN (other sequences' pages interleaved with its own, free
// pages, unwritten tail slots), ragged (kv_len, q_len) sequences on
// shuffled pages, and checks every output element: finite, and within
// 8 unit roundoffs of the KV dtype of the reference on the |want| + rms
// scale (the tolerance tests/cuda_kernels.rs uses on the GPU).
// Prints one line per case; exit status 0 when all pass.
#include <cstdio>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "prefill_mma.cuh"

using namespace handoff;
using sim::Rng;


enum class Dt { F16, BF16, F8 };

struct Case {
    const char* name;
    Dt dtype;
    int head_dim, page_size, n_kv_heads, group;
    std::vector<std::pair<int, int>> seqs;  // (kv_len, q_len)
};

// The arena's element bits for KV stored as T, their conversions, NaN, and
// the unit roundoff of what the mma multiplies (FP8's tiles in f16).
template <typename T> struct Elem;
template <> struct Elem<__half> {
    using Bits = uint16_t;
    static constexpr Bits NaN = 0x7e00;
    static float to(Bits b) { return sim::Conv<__half>::to(b); }
    static Bits from(float f) { return sim::Conv<__half>::from(f); }
    static double unit() { return std::ldexp(1.0, -11); }
};
template <> struct Elem<__nv_bfloat16> {
    using Bits = uint16_t;
    static constexpr Bits NaN = 0x7fc0;
    static float to(Bits b) { return sim::Conv<__nv_bfloat16>::to(b); }
    static Bits from(float f) { return sim::Conv<__nv_bfloat16>::from(f); }
    static double unit() { return std::ldexp(1.0, -8); }
};
template <> struct Elem<fp8_e4m3> {
    using Bits = uint8_t;
    static constexpr Bits NaN = 0x7f;
    static float to(Bits b) { return sim::fp8_e4m3_to_float(b); }
    static Bits from(float f) { return sim::float_to_fp8_e4m3(f); }
    static double unit() { return std::ldexp(1.0, -11); }
};

template <typename T, int D>
bool run_case(const Case& c, Rng& rng) {
    const int n_layers = 2, layer = 1, ps = c.page_size;
    const int kv_dim = c.n_kv_heads * D, n_heads = c.n_kv_heads * c.group;
    int log2 = 0;
    while ((1 << log2) < ps) ++log2;
    // Pages: dealt round-robin from a shuffled list, 3 left to nobody.
    std::vector<int> need;
    int total = 3;
    for (auto& s : c.seqs) {
        need.push_back((s.first + ps - 1) / ps);
        total += need.back();
    }
    std::vector<uint32_t> pool(total);
    for (int i = 0; i < total; ++i) pool[i] = i;
    for (int i = total - 1; i > 0; --i) std::swap(pool[i], pool[rng.next() % (i + 1)]);
    std::vector<std::vector<uint32_t>> pages(c.seqs.size());
    size_t next = 0;
    for (int round = 0;; ++round) {
        bool any = false;
        for (size_t s = 0; s < c.seqs.size(); ++s)
            if (round < need[s]) pages[s].push_back(pool[next++]), any = true;
        if (!any) break;
    }
    const uint64_t page_stride = (uint64_t)n_layers * 2 * ps * kv_dim;
    using E = Elem<T>;
    std::vector<typename E::Bits> arena(page_stride * total, E::NaN);
    auto at = [&](uint32_t page, int l, int kv, int slot, int e) {
        return page * page_stride + ((uint64_t)(l * 2 + kv) * ps + slot) * kv_dim + e;
    };
    for (size_t s = 0; s < c.seqs.size(); ++s)
        for (int pos = 0; pos < c.seqs[s].first; ++pos)
            for (int l = 0; l < n_layers; ++l)
                for (int kv = 0; kv < 2; ++kv)
                    for (int e = 0; e < kv_dim; ++e)
                        arena[at(pages[s][pos / ps], l, kv, pos % ps, e)] =
                            E::from(rng.uniform());
    std::vector<uint32_t> table, page_indptr{0}, q_indptr{0}, kv_len;
    int max_q = 0;
    for (size_t s = 0; s < c.seqs.size(); ++s) {
        table.insert(table.end(), pages[s].begin(), pages[s].end());
        page_indptr.push_back(table.size());
        q_indptr.push_back(q_indptr.back() + c.seqs[s].second);
        kv_len.push_back(c.seqs[s].first);
        max_q = std::max(max_q, c.seqs[s].second);
    }
    const int total_q = q_indptr.back();
    std::vector<float> q((size_t)total_q * n_heads * D), out(q.size(), NAN);
    for (auto& x : q) x = 2.0f * rng.uniform();

    PrefillParams p{};
    p.q = q.data();
    p.kv = arena.data();
    p.page_table = table.data();
    p.page_indptr = page_indptr.data();
    p.q_indptr = q_indptr.data();
    p.kv_len = kv_len.data();
    p.out = out.data();
    p.page_stride = page_stride;
    p.batch = c.seqs.size();
    p.n_heads = n_heads;
    p.n_kv_heads = c.n_kv_heads;
    p.group = c.group;
    p.layer = layer;
    p.page_size_log2 = log2;
    p.sm_scale_log2 = (float)(1.4426950408889634 / std::sqrt((double)D));

    // The launch: grid (q_tiles, n_kv_heads, batch), 128 threads a block;
    // the kernel of 64 rows a block, then the wide one into `wide`.
    auto launch = [&](int bm, int smem_bytes, auto kernel) {
        const int qt = bm / c.group, q_tiles = (max_q + qt - 1) / qt;
        std::vector<unsigned char> smem(smem_bytes + 16);
        unsigned char* smem_base = smem.data() + (16 - (uintptr_t)smem.data() % 16) % 16;
        for (unsigned bz = 0; bz < p.batch; ++bz)
            for (unsigned by = 0; by < p.n_kv_heads; ++by)
                for (unsigned bx = 0; bx < (unsigned)q_tiles; ++bx) {
                    std::fill(smem.begin(), smem.end(), 0xA5);  // stale garbage, not zeros
                    std::barrier<> block(PMMA_THREADS);
                    std::vector<sim::Warp> warps(PMMA_WARPS);
                    std::vector<std::thread> threads;
                    for (unsigned t = 0; t < (unsigned)PMMA_THREADS; ++t)
                        threads.emplace_back([&, t] {
                            threadIdx = {t, 0, 0};
                            blockIdx = {bx, by, bz};
                            sim::ctx = {&warps[t / 32], &block, smem_base};
                            kernel(p);
                        });
                    for (auto& th : threads) th.join();
                }
    };
    launch(PMMA_BM, PmmaCfg<D>::SMEM_BYTES, prefill_mma<T, D>);
    std::vector<float> wide(q.size(), NAN);
    p.out = wide.data();
    launch(PMMA_WIDE_BM, PmmaWideCfg<D>::SMEM_BYTES, prefill_mma_wide<T, D>);
    p.out = out.data();
    // Every row's arithmetic is the same in both kernels: the same bits.
    for (size_t i = 0; i < out.size(); ++i) {
        uint32_t x, y;
        std::memcpy(&x, &out[i], 4);
        std::memcpy(&y, &wide[i], 4);
        if (x != y) {
            std::printf("FAIL %s: the wide kernel's element #%zu is %a, the 64-row kernel's %a\n", c.name, i,
                        wide[i], out[i]);
            return false;
        }
    }

    // Reference (f64) from the stored values.
    std::vector<double> want(out.size());
    const double scale = 1.0 / std::sqrt((double)D);
    int row = 0;
    for (size_t s = 0; s < c.seqs.size(); ++s) {
        const int kvl = c.seqs[s].first, ql = c.seqs[s].second;
        for (int i = 0; i < ql; ++i, ++row) {
            const int n = kvl - ql + i + 1;
            for (int h = 0; h < n_heads; ++h) {
                const int kvh = h / c.group;
                const float* qh = &q[((size_t)row * n_heads + h) * D];
                std::vector<double> w(n);
                double m = -INFINITY;
                for (int t = 0; t < n; ++t) {
                    double dot = 0;
                    for (int d = 0; d < D; ++d)
                        dot += (double)qh[d] *
                               E::to(arena[at(pages[s][t / ps], layer, 0, t % ps, kvh * D + d)]);
                    w[t] = dot * scale;
                    m = std::max(m, w[t]);
                }
                double z = 0;
                for (auto& x : w) z += (x = std::exp(x - m));
                for (int d = 0; d < D; ++d) {
                    double acc = 0;
                    for (int t = 0; t < n; ++t)
                        acc += w[t] * E::to(arena[at(pages[s][t / ps], layer, 1, t % ps, kvh * D + d)]);
                    want[((size_t)row * n_heads + h) * D + d] = acc / z;
                }
            }
        }
    }
    double rms = 0;
    for (double x : want) rms += x * x;
    rms = std::sqrt(rms / want.size());
    const double u = E::unit(), rtol = 8 * u;
    double worst = 0;
    size_t bad = 0, first_bad = 0;
    for (size_t i = 0; i < out.size(); ++i) {
        const double err = std::fabs((double)out[i] - want[i]);
        const double ratio = std::isfinite(out[i]) ? err / (rtol * (std::fabs(want[i]) + rms)) : INFINITY;
        if (!(ratio <= 1.0)) {
            if (bad++ == 0) first_bad = i;
        }
        if (ratio > worst || std::isnan(ratio)) worst = std::isnan(ratio) ? INFINITY : ratio;
    }
    if (bad) {
        std::printf("FAIL %s: %zu of %zu elements out of tolerance; first #%zu got %g want %g\n", c.name, bad,
                    out.size(), first_bad, out[first_bad], want[first_bad]);
        return false;
    }
    std::printf("PASS %s: %zu elements, worst error %.3f of the tolerance (%.2e), wide kernel bit-identical\n",
                c.name, out.size(), worst, rtol);
    return true;
}

int main() {
    Rng rng{42};
    const std::vector<Case> cases = {
        // Ragged batch: whole prompt, chunked prefill after earlier positions,
        // one position, a prompt over two 64-key tiles, a chunk starting mid-page.
        {"bf16 hd64 page16 group4", Dt::BF16, 64, 16, 2, 4, {{19, 19}, {80, 33}, {1, 1}, {131, 70}}},
        {"f16 hd64 page64 group1", Dt::F16, 64, 64, 2, 1, {{70, 70}, {9, 9}, {150, 21}}},
        {"bf16 hd128 page64 group3 (odd)", Dt::BF16, 128, 64, 1, 3, {{90, 90}, {5, 2}}},
        {"f16 hd128 page16 group8", Dt::F16, 128, 16, 1, 8, {{40, 40}, {17, 3}}},
        {"bf16 hd64 page16 group64", Dt::BF16, 64, 16, 1, 64, {{3, 3}}},
        // Five K/V tiles: both buffers of the cp.async double buffer reused.
        {"bf16 hd128 page16 group2 (five tiles)", Dt::BF16, 128, 16, 1, 2, {{300, 300}, {260, 40}}},
        // FP8: tiles widened to f16 in shared memory after they land.
        {"fp8 hd128 page16 group4 (five tiles)", Dt::F8, 128, 16, 1, 4, {{300, 300}, {70, 9}}},
        {"fp8 hd64 page64 group2", Dt::F8, 64, 64, 2, 2, {{80, 33}, {1, 1}, {131, 70}}},
    };
    bool ok = true;
    for (const Case& c : cases) {
        bool r;
        const bool d64 = c.head_dim == 64;
        switch (c.dtype) {
            case Dt::BF16:
                r = d64 ? run_case<__nv_bfloat16, 64>(c, rng) : run_case<__nv_bfloat16, 128>(c, rng);
                break;
            case Dt::F16: r = d64 ? run_case<__half, 64>(c, rng) : run_case<__half, 128>(c, rng); break;
            default: r = d64 ? run_case<fp8_e4m3, 64>(c, rng) : run_case<fp8_e4m3, 128>(c, rng); break;
        }
        ok = ok && r;
    }
    return ok ? 0 : 1;
}
