// Runs cuda/linear_mma.cuh's kernel (bf16 weights on tensor cores) on the
// SIMT emulator (simt_host.h); driven by tests/cuda/linear_mma_host.rs.
//
// Each case draws x (f32) and bf16 weights, runs the kernel over the whole
// batch, checks every output against an f64 reference of the same inputs
// (within 2^-14 of the sum of |x w| plus f32 rounding of the sum), then runs
// each row alone and the batch on the other tile shapes and requires the
// bits of the batched run: a row's result depends neither on the rest of
// the batch nor on the tile. A NaN in one row of x stays in
// that row, and accumulating into a residual gives the bits of the product
// added to it. A group launch (up to three products of one x) gives each
// product the bits of its own launch, on every tile. Prints one line per
// case; exit status 0 when all pass.
#include <cmath>
#include <cstdio>
#include <thread>
#include <vector>

#include "linear_mma.cuh"

using namespace handoff;
using sim::Rng;


// The three tiles, as src/backend/cuda/launch.rs names them.
enum Shape { Small, Wide, Gemm };

// Rows and columns of a tile's block, and its shared memory.
unsigned tile_rows(Shape s) { return s == Gemm ? LGEMM_BM : s == Wide ? LMMA_WIDE_BM : LMMA_BM; }
unsigned tile_cols(Shape s) { return s == Gemm ? LGEMM_BN : s == Wide ? LMMA_WIDE_BN : LMMA_BN; }
size_t tile_smem(Shape s) {
    return s == Gemm ? (size_t)LgemmCfg::SMEM_BYTES
                     : sizeof(LmmaSmem<LMMA_WIDE_BM / 16, LMMA_WIDE_BN / 8>);
}

// Runs `body` as every thread of a gx x gy grid of LMMA_THREADS-thread
// blocks, one block at a time. Shared memory starts as NaN bytes: a read
// of a slot nothing wrote shows.
template <typename Body>
void run_grid(unsigned gx, unsigned gy, size_t smem_bytes, Body body) {
    for (unsigned by = 0; by < gy; ++by)
        for (unsigned bx = 0; bx < gx; ++bx) {
            std::barrier<> block(LMMA_THREADS);
            std::vector<sim::Warp> warps(LMMA_WARPS);
            std::vector<unsigned char> smem(smem_bytes, 0xff);
            std::vector<std::thread> threads;
            for (unsigned t = 0; t < (unsigned)LMMA_THREADS; ++t)
                threads.emplace_back([&, t] {
                    threadIdx = {t, 0, 0};
                    blockIdx = {bx, by, 0};
                    sim::ctx = {&warps[t / 32], &block, smem.data()};
                    body();
                });
            for (auto& th : threads) th.join();
        }
}

// Runs one tile's kernel over the whole grid.
void launch_shape(const LinearMmaParams& p, Shape shape) {
    const unsigned gx = (p.n + tile_cols(shape) - 1) / tile_cols(shape);
    const unsigned gy = (p.m + tile_rows(shape) - 1) / tile_rows(shape);
    run_grid(gx, gy, tile_smem(shape), [&] {
        if (shape == Gemm) linear_mma_gemm_body<__nv_bfloat16>(p);
        else if (shape == Wide) linear_mma_wide_body<__nv_bfloat16>(p);
        else linear_mma_body<__nv_bfloat16>(p);
    });
}

// As the host launches it (src/backend/cuda/launch.rs): the prefill tile
// from 128 rows, the wide one from 32.
Shape shape_for(uint32_t m) {
    return m >= (uint32_t)LGEMM_BM ? Gemm : m >= (uint32_t)LMMA_WIDE_BM ? Wide : Small;
}
void launch(const LinearMmaParams& p) { launch_shape(p, shape_for(p.m)); }

bool run_case(uint32_t m, uint32_t n, uint32_t k, bool nan_row, Rng& rng) {
    std::vector<float> x(m * k);
    for (auto& v : x) v = rng.uniform() * 4.0f;
    if (nan_row && m > 1) x[1 * k + k / 2] = NAN;
    std::vector<uint16_t> w(n * k);
    for (auto& v : w) v = sim::float_to_bf16(rng.uniform() * 0.5f);
    std::vector<float> out(m * n, -7.0f);
    LinearMmaParams p{x.data(), w.data(), out.data(), m, n, k, 0};
    launch(p);
    bool ok = true;
    for (uint32_t r = 0; r < m && ok; ++r) {
        const bool poisoned = nan_row && m > 1 && r == 1;
        for (uint32_t j = 0; j < n; ++j) {
            double want = 0, mag = 0;
            for (uint32_t c = 0; c < k; ++c) {
                const double prod = (double)x[r * k + c] * (double)sim::bf16_to_float(w[j * k + c]);
                want += prod;
                mag += std::fabs(prod);
            }
            const float got = out[r * n + j];
            if (poisoned) {
                if (!std::isnan(got)) {
                    std::printf("  row %u col %u: %g, want NaN (its x holds one)\n", r, j, got);
                    ok = false;
                }
                continue;
            }
            const double tol = mag * (std::ldexp(1.0, -14) + k * std::ldexp(1.0, -23)) + 1e-30;
            if (!(std::fabs(got - want) <= tol)) {
                std::printf("  row %u col %u: got %.9g want %.9g (tol %.3g)\n", r, j, got, want, tol);
                ok = false;
                break;
            }
        }
    }
    // Each row alone (from 128 rows, every 16th and the last: the small
    // tile over the whole batch below covers the rest): the same bits.
    for (uint32_t r = 0; r < m && ok; ++r) {
        if (m >= 128 && r % 16 != 0 && r != m - 1) continue;
        std::vector<float> one(n, -7.0f);
        LinearMmaParams q{x.data() + (uint64_t)r * k, w.data(), one.data(), 1, n, k, 0};
        launch(q);
        for (uint32_t j = 0; j < n; ++j) {
            const float a = out[r * n + j], b = one[j];
            if (std::memcmp(&a, &b, 4) != 0) {
                std::printf("  row %u col %u: %.9g in the batch, %.9g alone\n", r, j, a, b);
                ok = false;
                break;
            }
        }
    }
    // Accumulating into a residual: the bits of the product, then of the add.
    if (ok) {
        std::vector<float> res(m * n), acc(m * n);
        for (auto& v : res) v = rng.uniform() * 8.0f;
        acc = res;
        LinearMmaParams q{x.data(), w.data(), acc.data(), m, n, k, 1};
        launch(q);
        for (size_t i = 0; i < acc.size() && ok; ++i) {
            const float want = res[i] + out[i];
            if (std::memcmp(&acc[i], &want, 4) != 0) {
                std::printf("  accumulate at %zu: %.9g, want %.9g + %.9g\n", i, acc[i], res[i], out[i]);
                ok = false;
            }
        }
    }
    // The other tile shapes over the whole batch: the same bits.
    for (Shape other_shape : {Small, Wide, Gemm}) {
        if (!ok || other_shape == shape_for(m)) continue;
        std::vector<float> other(m * n, -7.0f);
        LinearMmaParams q{x.data(), w.data(), other.data(), m, n, k, 0};
        launch_shape(q, other_shape);
        if (std::memcmp(other.data(), out.data(), out.size() * 4) != 0) {
            std::printf("  tile shape %d gave other bits than tile shape %d\n", (int)other_shape,
                        (int)shape_for(m));
            ok = false;
        }
    }
    std::printf("%s m=%u n=%u k=%u%s\n", ok ? "ok" : "FAIL", m, n, k, nan_row ? " (NaN row)" : "");
    return ok;
}

// Runs a group launch (up to three products of one x) on one tile.
void launch_group(const LinearMmaGroupParams& g, Shape shape) {
    const unsigned bn = tile_cols(shape);
    const unsigned blocks2 = g.n_groups == 3 ? (g.n2 + bn - 1) / bn : 0;
    const unsigned gx = g.blocks0 + (g.n_groups >= 2 ? g.blocks1 : 0) + blocks2;
    run_grid(gx, (g.m + tile_rows(shape) - 1) / tile_rows(shape), tile_smem(shape), [&] {
        if (shape == Gemm) linear_mma_gemm_group_body<__nv_bfloat16>(g);
        else if (shape == Wide) linear_mma_wide_group_body<__nv_bfloat16>(g);
        else linear_mma_group_body<__nv_bfloat16>(g);
    });
}

// Three products of one x (widths ns) in one group launch, as the host
// launches it for m rows: each product the bits of its own launch.
bool run_group(uint32_t m, const uint32_t ns[3], uint32_t k, uint32_t n_groups, Rng& rng) {
    std::vector<float> x(m * k);
    for (auto& v : x) v = rng.uniform() * 4.0f;
    std::vector<uint16_t> w[3];
    std::vector<float> alone[3], grouped[3];
    for (uint32_t i = 0; i < n_groups; ++i) {
        w[i].resize(ns[i] * k);
        for (auto& v : w[i]) v = sim::float_to_bf16(rng.uniform() * 0.5f);
        alone[i].assign(m * ns[i], -7.0f);
        grouped[i].assign(m * ns[i], -5.0f);
        LinearMmaParams p{x.data(), w[i].data(), alone[i].data(), m, ns[i], k, 0};
        launch(p);
    }
    const Shape shape = shape_for(m);
    const unsigned bn = tile_cols(shape);
    LinearMmaGroupParams g{};
    g.x = x.data();
    g.m = m;
    g.k = k;
    g.n_groups = n_groups;
    g.w0 = w[0].data(), g.out0 = grouped[0].data(), g.n0 = ns[0];
    g.blocks0 = (ns[0] + bn - 1) / bn;
    if (n_groups >= 2) {
        g.w1 = w[1].data(), g.out1 = grouped[1].data(), g.n1 = ns[1];
        g.blocks1 = (ns[1] + bn - 1) / bn;
    }
    if (n_groups == 3) g.w2 = w[2].data(), g.out2 = grouped[2].data(), g.n2 = ns[2];
    launch_group(g, shape);
    bool ok = true;
    for (uint32_t i = 0; i < n_groups; ++i) {
        if (std::memcmp(alone[i].data(), grouped[i].data(), alone[i].size() * 4) != 0) {
            std::printf("  product %u: other bits in the group launch\n", i);
            ok = false;
        }
    }
    std::printf("%s group of %u, m=%u n=%u/%u/%u k=%u\n", ok ? "ok" : "FAIL", n_groups, m, ns[0],
                ns[1], ns[2], k);
    return ok;
}

int main() {
    Rng rng{2026};
    bool ok = true;
    // Depths past one k-block per warp (256), past one unrolled round per
    // warp (1,024), and odd ones that take the element-wise loads.
    // From 32 rows on the batch runs the wide tile, from 128 the prefill
    // tile, and each row alone the small one.
    const uint32_t cases[][3] = {{1, 8, 16},    {3, 130, 48}, {17, 257, 96}, {5, 64, 33},
                                 {16, 128, 160}, {2, 300, 7},  {33, 40, 64},  {3, 16, 520},
                                 {2, 24, 1040},  {1, 8, 2051}, {1, 16, 4096}, {48, 24, 520},
                                 {34, 16, 1100}, {128, 64, 64},  {130, 72, 520}, {129, 40, 33},
                                 {160, 72, 1100}};
    for (auto& c : cases) ok &= run_case(c[0], c[1], c[2], false, rng);
    ok &= run_case(4, 72, 32, true, rng);
    ok &= run_case(33, 16, 96, true, rng);
    ok &= run_case(130, 16, 96, true, rng);
    // Group launches on each tile: q, k, v-like widths (ragged), and two.
    const uint32_t qkv[3] = {40, 24, 130}, two[3] = {72, 16, 0};
    ok &= run_group(3, qkv, 96, 3, rng);
    ok &= run_group(40, qkv, 520, 3, rng);
    ok &= run_group(130, qkv, 64, 3, rng);
    ok &= run_group(5, two, 33, 2, rng);
    return ok ? 0 : 1;
}
