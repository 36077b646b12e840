// Runs cuda/linear_mma.cuh's kernel (bf16 or f16 weights on tensor cores)
// on the SIMT emulator (simt_host.h); driven by tests/cuda/linear_mma_host.rs.
// The cases run with bf16 weights, then a set of them with f16 weights
// (split into exact bf16 parts in registers).
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
#include <vector>

#include "linear_mma.cuh"

using namespace handoff;
using sim::Rng;


// The three tiles, as src/backend/cuda/launch.rs names them.
enum Shape { Small, Wide, Gemm };

// Whether the weights are f16 (else bf16): which instantiation runs, how
// weights are drawn and how the reference reads them.
bool g_f16 = false;

float weight_value(uint16_t bits) { return g_f16 ? sim::f16_to_float(bits) : sim::bf16_to_float(bits); }
uint16_t weight_bits(float v) { return g_f16 ? sim::float_to_f16(v) : sim::float_to_bf16(v); }
const char* weight_tag() { return g_f16 ? " (f16 weights)" : ""; }

// Rows and columns of a tile's block, and its shared memory.
unsigned tile_rows(Shape s) { return s == Gemm ? LGEMM_BM : s == Wide ? LMMA_WIDE_BM : LMMA_BM; }
unsigned tile_cols(Shape s) { return s == Gemm ? LGEMM_BN : s == Wide ? LMMA_WIDE_BN : LMMA_BN; }
size_t tile_smem(Shape s) {
    return s == Gemm ? (size_t)LgemmCfg::SMEM_BYTES
                     : sizeof(LmmaSmem<LMMA_WIDE_BM / 16, LMMA_WIDE_BN / 8>);
}

// Runs `body` as every thread of a gx x gy grid of LMMA_THREADS-thread
// blocks (sim::run_blocks).
template <typename Body>
void run_grid(unsigned gx, unsigned gy, size_t smem_bytes, Body body) {
    sim::run_blocks(gx, gy, LMMA_THREADS, smem_bytes, body);
}

// Calls body.template operator()<W>() with the weights' type.
template <typename Body>
void with_weights(Body body) {
    if (g_f16) body.template operator()<__half>();
    else body.template operator()<__nv_bfloat16>();
}

// x · wᵀ into out (out += with acc), nothing carried.
LinearMmaParams lmma(const float* x, const uint16_t* w, float* out, uint32_t m, uint32_t n,
                     uint32_t k, uint32_t acc) {
    return LinearMmaParams{x, w, out, nullptr, nullptr, m, n, k, acc, 0.0f, 0};
}

// Runs one tile's kernel over the whole grid (a SwiGLU pair's column
// blocks are half as wide).
void launch_shape(const LinearMmaParams& p, Shape shape) {
    const unsigned bn = p.w_up ? tile_cols(shape) / 2 : tile_cols(shape);
    const unsigned gx = (p.n + bn - 1) / bn;
    const unsigned gy = (p.m + tile_rows(shape) - 1) / tile_rows(shape);
    with_weights([&]<typename W>() {
        run_grid(gx, gy, tile_smem(shape), [&] {
            if (shape == Gemm) linear_mma_gemm_body<W>(p);
            else if (shape == Wide) linear_mma_wide_body<W>(p);
            else linear_mma_body<W>(p);
        });
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
    for (auto& v : w) v = weight_bits(rng.uniform() * 0.5f);
    std::vector<float> out(m * n, -7.0f);
    const LinearMmaParams p = lmma(x.data(), w.data(), out.data(), m, n, k, 0);
    launch(p);
    bool ok = true;
    for (uint32_t r = 0; r < m && ok; ++r) {
        const bool poisoned = nan_row && m > 1 && r == 1;
        for (uint32_t j = 0; j < n; ++j) {
            double want = 0, mag = 0;
            for (uint32_t c = 0; c < k; ++c) {
                const double prod = (double)x[r * k + c] * (double)weight_value(w[j * k + c]);
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
        const LinearMmaParams q = lmma(x.data() + (uint64_t)r * k, w.data(), one.data(), 1, n, k, 0);
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
        const LinearMmaParams q = lmma(x.data(), w.data(), acc.data(), m, n, k, 1);
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
        const LinearMmaParams q = lmma(x.data(), w.data(), other.data(), m, n, k, 0);
        launch_shape(q, other_shape);
        if (std::memcmp(other.data(), out.data(), out.size() * 4) != 0) {
            std::printf("  tile shape %d gave other bits than tile shape %d\n", (int)other_shape,
                        (int)shape_for(m));
            ok = false;
        }
    }
    std::printf("%s m=%u n=%u k=%u%s%s\n", ok ? "ok" : "FAIL", m, n, k, nan_row ? " (NaN row)" : "",
                weight_tag());
    return ok;
}

// Runs a group launch (up to three products of one x) on one tile.
void launch_group(const LinearMmaGroupParams& g, Shape shape) {
    const unsigned bn = tile_cols(shape);
    const unsigned blocks2 = g.n_groups == 3 ? (g.n2 + bn - 1) / bn : 0;
    const unsigned gx = g.blocks0 + (g.n_groups >= 2 ? g.blocks1 : 0) + blocks2;
    const unsigned gy = (g.m + tile_rows(shape) - 1) / tile_rows(shape);
    with_weights([&]<typename W>() {
        run_grid(gx, gy, tile_smem(shape), [&] {
            if (shape == Gemm) linear_mma_gemm_group_body<W>(g);
            else if (shape == Wide) linear_mma_wide_group_body<W>(g);
            else linear_mma_group_body<W>(g);
        });
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
        for (auto& v : w[i]) v = weight_bits(rng.uniform() * 0.5f);
        alone[i].assign(m * ns[i], -7.0f);
        grouped[i].assign(m * ns[i], -5.0f);
        const LinearMmaParams p = lmma(x.data(), w[i].data(), alone[i].data(), m, ns[i], k, 0);
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
    std::printf("%s group of %u, m=%u n=%u/%u/%u k=%u%s\n", ok ? "ok" : "FAIL", n_groups, m, ns[0],
                ns[1], ns[2], k, weight_tag());
    return ok;
}

// RMSNorm of m rows of k as the rms_norm kernel computes it (pointwise.cuh:
// a block of RMS_THREADS per row).
std::vector<float> rms_norm_rows(const std::vector<float>& x, const std::vector<float>& g, uint32_t m,
                                 uint32_t k, float eps) {
    std::vector<float> out(x.size(), -7.0f);
    const RmsNormParams p{x.data(), g.data(), out.data(), m, k, eps, 0};
    run_grid(m, 1, 0, [&] { rms_norm(p); });
    return out;
}

// gate = SwiGLU(gate, up) as the swiglu kernel computes it (one thread).
void swiglu_all(std::vector<float>& gate, const std::vector<float>& up) {
    const SwigluParams p{gate.data(), up.data(), gate.data(), gate.size()};
    threadIdx = {0, 0, 0}, blockIdx = {0, 0, 0}, blockDim = {1, 1, 1}, gridDim = {1, 1, 1};
    swiglu(p);
}

// x with rows of unlike scales (RMSNorm's scale differs row to row), a NaN
// in row 1 when asked.
std::vector<float> draw_rows(uint32_t m, uint32_t k, bool nan_row, Rng& rng) {
    std::vector<float> x(m * k);
    for (uint32_t r = 0; r < m; ++r)
        for (uint32_t c = 0; c < k; ++c) x[r * k + c] = rng.uniform() * (float)(1 + r % 5) * 3.0f;
    if (nan_row && m > 1) x[1 * k + k / 3] = NAN;
    return x;
}

std::vector<uint16_t> draw_weights(uint32_t n, uint32_t k, Rng& rng) {
    std::vector<uint16_t> w(n * k);
    for (auto& v : w) v = weight_bits(rng.uniform() * 0.5f);
    return w;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b, const char* what) {
    for (size_t i = 0; i < a.size(); ++i) {
        if (std::memcmp(&a[i], &b[i], 4) != 0) {
            std::printf("  %s at %zu: %.9g carried, %.9g by separate kernels\n", what, i, a[i], b[i]);
            return false;
        }
    }
    return true;
}

// RMSNorm carried into a group launch (q, k and v) on the decode tile: the
// bits of the rms_norm kernel, then the group launch of its output. Also
// checks the rms_norm kernel against an f64 reference.
bool run_norm_group(uint32_t m, const uint32_t ns[3], uint32_t k, bool nan_row, Rng& rng) {
    const float eps = 1e-5f;
    const std::vector<float> x = draw_rows(m, k, nan_row, rng);
    std::vector<float> g(k);
    for (auto& v : g) v = 0.5f + rng.uniform();
    const std::vector<float> xn = rms_norm_rows(x, g, m, k, eps);
    bool ok = true;
    for (uint32_t r = 0; r < m && ok; ++r) {
        if (nan_row && r == 1) continue;
        double ss = 0;
        for (uint32_t c = 0; c < k; ++c) ss += (double)x[r * k + c] * x[r * k + c];
        const double scale = 1.0 / std::sqrt(ss / k + eps);
        for (uint32_t c = 0; c < k && ok; ++c) {
            const double want = x[r * k + c] * scale * g[c];
            if (!(std::fabs(xn[r * k + c] - want) <= std::fabs(want) * std::ldexp(1.0, -19) + 1e-30)) {
                std::printf("  rms_norm row %u col %u: %.9g, want %.9g\n", r, c, xn[r * k + c], want);
                ok = false;
            }
        }
    }
    std::vector<uint16_t> w[3];
    std::vector<float> split[3], carried[3];
    LinearMmaGroupParams sep{}, fused{};
    for (LinearMmaGroupParams* q : {&sep, &fused}) {
        q->m = m, q->k = k, q->n_groups = 3;
        q->blocks0 = (ns[0] + LMMA_BN - 1) / LMMA_BN;
        q->blocks1 = (ns[1] + LMMA_BN - 1) / LMMA_BN;
        q->n0 = ns[0], q->n1 = ns[1], q->n2 = ns[2];
    }
    for (int i = 0; i < 3; ++i) {
        w[i] = draw_weights(ns[i], k, rng);
        split[i].assign(m * ns[i], -7.0f);
        carried[i].assign(m * ns[i], -5.0f);
    }
    sep.x = xn.data(), sep.w0 = w[0].data(), sep.w1 = w[1].data(), sep.w2 = w[2].data();
    sep.out0 = split[0].data(), sep.out1 = split[1].data(), sep.out2 = split[2].data();
    fused.x = x.data(), fused.w0 = w[0].data(), fused.w1 = w[1].data(), fused.w2 = w[2].data();
    fused.out0 = carried[0].data(), fused.out1 = carried[1].data(), fused.out2 = carried[2].data();
    fused.norm_w = g.data(), fused.norm_eps = eps;
    launch_group(sep, Small);
    launch_group(fused, Small);
    for (int i = 0; i < 3 && ok; ++i) ok = same_bits(carried[i], split[i], "normed product");
    if (ok && nan_row) {
        // The NaN stays in its row.
        for (uint32_t j = 0; j < ns[0] && ok; ++j) {
            ok = std::isnan(carried[0][1 * ns[0] + j]) && !std::isnan(carried[0][j]);
        }
        if (!ok) std::printf("  the NaN of row 1 did not stay in row 1\n");
    }
    std::printf("%s norm carried into a group of 3, m=%u n=%u/%u/%u k=%u%s%s\n", ok ? "ok" : "FAIL", m,
                ns[0], ns[1], ns[2], k, nan_row ? " (NaN row)" : "", weight_tag());
    return ok;
}

// gate and up as one SwiGLU pair (with RMSNorm carried in when `norm`), on
// the decode and on the wide tile: the bits of rms_norm, the two matmuls
// and swiglu as separate kernels.
bool run_pair(uint32_t m, uint32_t n, uint32_t k, bool norm, Rng& rng) {
    const float eps = 1e-6f;
    const std::vector<float> x = draw_rows(m, k, false, rng);
    std::vector<float> g(k);
    for (auto& v : g) v = 0.25f + rng.uniform();
    const std::vector<uint16_t> wg = draw_weights(n, k, rng), wu = draw_weights(n, k, rng);
    const std::vector<float> xn = norm ? rms_norm_rows(x, g, m, k, eps) : x;
    std::vector<float> gate(m * n, -7.0f), up(m * n, -7.0f);
    launch(lmma(xn.data(), wg.data(), gate.data(), m, n, k, 0));
    launch(lmma(xn.data(), wu.data(), up.data(), m, n, k, 0));
    swiglu_all(gate, up);
    bool ok = true;
    for (Shape shape : {Small, Wide}) {
        std::vector<float> out(m * n, -5.0f);
        const LinearMmaParams p{x.data(), wg.data(), out.data(), norm ? g.data() : nullptr, wu.data(),
                                m, n, k, 0, eps, 0};
        launch_shape(p, shape);
        const char* tile = shape == Small ? "pair (decode tile)" : "pair (wide tile)";
        if (!same_bits(out, gate, tile)) ok = false;
    }
    std::printf("%s SwiGLU pair%s, m=%u n=%u k=%u%s\n", ok ? "ok" : "FAIL",
                norm ? " with the norm" : "", m, n, k, weight_tag());
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
    // Carried stages: RMSNorm in the load (decode tile: one and two row
    // tiles, odd and long depths), SwiGLU in the store (decode and wide
    // tiles), both.
    ok &= run_norm_group(1, qkv, 520, false, rng);
    ok &= run_norm_group(3, qkv, 33, false, rng);
    ok &= run_norm_group(20, qkv, 1100, false, rng);
    ok &= run_norm_group(4, qkv, 96, true, rng);
    ok &= run_pair(1, 24, 520, false, rng);
    ok &= run_pair(5, 130, 33, false, rng);
    ok &= run_pair(40, 40, 96, false, rng);
    ok &= run_pair(1, 72, 1100, true, rng);
    ok &= run_pair(17, 24, 64, true, rng);
    // f16 weights (11 significant bits: the split must keep all of them)
    // on each tile, alone, grouped and with both stages carried.
    g_f16 = true;
    const uint32_t f16_cases[][3] = {{1, 8, 16},   {3, 130, 48},  {5, 64, 33},  {1, 16, 2051},
                                     {33, 40, 64}, {130, 72, 520}, {129, 40, 33}};
    for (auto& c : f16_cases) ok &= run_case(c[0], c[1], c[2], false, rng);
    ok &= run_case(33, 16, 96, true, rng);
    ok &= run_group(3, qkv, 96, 3, rng);
    ok &= run_group(130, qkv, 64, 3, rng);
    ok &= run_norm_group(3, qkv, 33, false, rng);
    ok &= run_pair(5, 130, 33, false, rng);
    ok &= run_pair(1, 72, 1100, true, rng);
    return ok ? 0 : 1;
}
