// Runs cuda/linear_f32.cuh's kernel (f32 weights on the SIMT cores) on the
// SIMT emulator (simt_host.h); driven by tests/cuda/linear_f32_host.rs.
//
// Each case draws x and w, runs the kernel over the whole batch as the
// host launches it (src/backend/cuda/launch.rs picks the shape by m),
// checks every output against an f64 reference of the same inputs (within
// f32 rounding of a k-term sum), then requires the bits of the batched run
// from each row alone, from the other two shapes over the whole batch and
// from x one float off 16-byte alignment (element loads instead of 16-byte
// ones). A NaN in one row of x stays in that row; accumulating into a
// residual gives the bits of the product added to it.
//
// Given a file of ggml-block matrices (written by the Rust test with the
// crate's own widening: format, rows, cols, the raw blocks, then the f32
// values QuantMatrix::dequantize gives), runs the block-reading matmul on
// the raw blocks against the f32 matmul on those values: the same bits for
// every shape and with accumulation; and the block-reading embedding
// gather against the values, bit for bit. Prints one line per case; exit
// status 0 when all pass.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <vector>

#include "linear_f32.cuh"

using namespace handoff;
using sim::Rng;

enum Shape { One, Few, Many };

unsigned shape_rows(Shape s) {
    return s == One ? LIN_ROWS_ONE : s == Few ? LIN_ROWS_FEW : LIN_ROWS_MANY;
}

// As the host launches it: one row, up to LIN_ROWS_FEW, or more.
Shape shape_for(uint32_t m) { return m == 1 ? One : m <= (uint32_t)LIN_ROWS_FEW ? Few : Many; }

// Runs `body` as every thread of a 1-D grid of `blocks` LIN_THREADS-thread
// blocks (sim::run_blocks).
template <typename Body>
void run_grid(unsigned blocks, Body body) {
    sim::run_blocks(blocks, 1, LIN_THREADS, sizeof(LinSmem<LIN_ROWS_MANY>), body);
}

void launch_shape(const LinearParams& p, Shape s) {
    const unsigned rows = shape_rows(s);
    const unsigned blocks = ((p.m + rows - 1) / rows) * ((p.n + LIN_COLS - 1) / LIN_COLS);
    run_grid(blocks, [&] {
        if (s == One) linear_one(p);
        else if (s == Few) linear_few(p);
        else linear_many(p);
    });
}

void launch(const LinearParams& p) { launch_shape(p, shape_for(p.m)); }

LinearParams lin(const float* x, const float* w, float* out, uint32_t m, uint32_t n, uint32_t k,
                 uint32_t acc) {
    return LinearParams{x, w, out, m, n, k, acc};
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b, const char* what) {
    for (size_t i = 0; i < a.size(); ++i) {
        if (std::memcmp(&a[i], &b[i], 4) != 0) {
            std::printf("  %s: output %zu is %.9g, the batched run's %.9g\n", what, i, b[i], a[i]);
            return false;
        }
    }
    return true;
}

bool run_case(uint32_t m, uint32_t n, uint32_t k, bool nan_row, Rng& rng) {
    std::vector<float> x(m * k);
    for (auto& v : x) v = rng.uniform() * 4.0f;
    if (nan_row && m > 1) x[1 * k + k / 2] = NAN;
    std::vector<float> w(n * k);
    for (auto& v : w) v = rng.uniform() * 0.5f;
    std::vector<float> out(m * n, -7.0f);
    launch(lin(x.data(), w.data(), out.data(), m, n, k, 0));
    bool ok = true;
    for (uint32_t r = 0; r < m && ok; ++r) {
        const bool poisoned = nan_row && m > 1 && r == 1;
        for (uint32_t j = 0; j < n; ++j) {
            double want = 0, mag = 0;
            for (uint32_t c = 0; c < k; ++c) {
                const double prod = (double)x[r * k + c] * (double)w[j * k + c];
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
            const double tol = mag * (k + 40) * std::ldexp(1.0, -24) + 1e-30;
            if (!(std::fabs(got - want) <= tol)) {
                std::printf("  row %u col %u: got %.9g want %.9g (tol %.3g)\n", r, j, got, want, tol);
                ok = false;
                break;
            }
        }
        // A row that holds no NaN gives none, whatever its neighbours hold.
        for (uint32_t j = 0; j < n && !poisoned; ++j) {
            if (std::isnan(out[r * n + j])) {
                std::printf("  row %u col %u: NaN from another row\n", r, j);
                ok = false;
                break;
            }
        }
    }
    // Each row alone: the bits of the batch.
    for (uint32_t r = 0; r < m && ok; ++r) {
        std::vector<float> one(n, -7.0f);
        launch(lin(x.data() + (uint64_t)r * k, w.data(), one.data(), 1, n, k, 0));
        std::vector<float> batched(out.begin() + (uint64_t)r * n, out.begin() + (uint64_t)(r + 1) * n);
        if (!same_bits(batched, one, "a row alone")) ok = false;
    }
    // The other shapes over the whole batch: the same bits.
    for (Shape s : {One, Few, Many}) {
        if (!ok || s == shape_for(m)) continue;
        std::vector<float> other(m * n, -7.0f);
        launch_shape(lin(x.data(), w.data(), other.data(), m, n, k, 0), s);
        char what[64];
        std::snprintf(what, sizeof what, "%u rows a block", shape_rows(s));
        if (!same_bits(out, other, what)) ok = false;
    }
    // x one float off 16-byte alignment (every load element by element).
    if (ok) {
        std::vector<float> shifted(m * k + 4);
        float* xs = shifted.data() + 1;
        std::memcpy(xs, x.data(), x.size() * 4);
        std::vector<float> other(m * n, -7.0f);
        launch(lin(xs, w.data(), other.data(), m, n, k, 0));
        if (!same_bits(out, other, "unaligned x")) ok = false;
    }
    // Accumulating into a residual: the bits of the product, then the add.
    if (ok) {
        std::vector<float> res(m * n), acc(m * n);
        for (auto& v : res) v = rng.uniform() * 8.0f;
        acc = res;
        launch(lin(x.data(), w.data(), acc.data(), m, n, k, 1));
        for (size_t i = 0; i < acc.size() && ok; ++i) {
            const float want = res[i] + out[i];
            if (std::memcmp(&acc[i], &want, 4) != 0) {
                std::printf("  accumulate at %zu: %.9g, want %.9g + %.9g\n", i, acc[i], res[i], out[i]);
                ok = false;
            }
        }
    }
    std::printf("%s m=%u n=%u k=%u%s\n", ok ? "ok" : "FAIL", m, n, k, nan_row ? " (NaN row)" : "");
    return ok;
}

// The block-reading matmul as the host launches it for m rows.
void launch_q(const LinearQParams& p) {
    const Shape s = shape_for(p.m);
    const unsigned rows = shape_rows(s);
    const unsigned blocks = ((p.m + rows - 1) / rows) * ((p.n + LIN_COLS - 1) / LIN_COLS);
    run_grid(blocks, [&] {
        if (s == One) linear_q_one(p);
        else if (s == Few) linear_q_few(p);
        else linear_q_many(p);
    });
}

template <typename T>
bool read_vec(std::ifstream& in, std::vector<T>& v, size_t n) {
    v.resize(n);
    return (bool)in.read(reinterpret_cast<char*>(v.data()), (std::streamsize)(n * sizeof(T)));
}

// One ggml-block matrix [n, k] (raw blocks `w`, the crate's widened values
// `wf`) at m rows: the bits of the f32 matmul on wf, alone and accumulating;
// then every row gathered as an embedding.
bool run_quant(uint32_t fmt, uint32_t n, uint32_t k, const std::vector<uint8_t>& w,
               const std::vector<float>& wf, Rng& rng) {
    bool ok = true;
    for (uint32_t m : {1u, 3u, 6u}) {
        std::vector<float> x(m * k);
        for (auto& v : x) v = rng.uniform() * 4.0f;
        for (uint32_t acc : {0u, 1u}) {
            std::vector<float> want(m * n), got(m * n);
            for (size_t i = 0; i < want.size(); ++i) want[i] = got[i] = rng.uniform();
            launch(lin(x.data(), wf.data(), want.data(), m, n, k, acc));
            launch_q(LinearQParams{x.data(), w.data(), got.data(), m, n, k, acc, fmt, 0});
            char what[64];
            std::snprintf(what, sizeof what, "blocks at m=%u%s", m, acc ? ", accumulating" : "");
            if (!same_bits(want, got, what)) ok = false;
        }
    }
    std::vector<uint32_t> tokens(n);
    for (uint32_t t = 0; t < n; ++t) tokens[t] = n - 1 - t;
    std::vector<float> rows(n * k, -7.0f);
    const EmbeddingQParams e{w.data(), tokens.data(), rows.data(), n, k, n, fmt};
    run_grid(2, [&] { embedding_q(e); });
    std::vector<float> want(n * k);
    for (uint32_t t = 0; t < n; ++t)
        std::memcpy(&want[t * k], &wf[(size_t)tokens[t] * k], k * 4);
    if (!same_bits(want, rows, "embedding gather")) ok = false;
    std::printf("%s ggml blocks, format %u, n=%u k=%u\n", ok ? "ok" : "FAIL", fmt, n, k);
    return ok;
}

// The file's cases: [u32 count] then per case [u32 format, rows, cols,
// bytes][bytes][rows * cols f32].
bool run_quant_file(const char* path, Rng& rng) {
    std::ifstream in(path, std::ios::binary);
    uint32_t count = 0;
    if (!in.read(reinterpret_cast<char*>(&count), 4)) {
        std::printf("FAIL cannot read %s\n", path);
        return false;
    }
    bool ok = true;
    for (uint32_t c = 0; c < count; ++c) {
        std::vector<uint32_t> head;
        std::vector<uint8_t> w;
        std::vector<float> wf;
        if (!read_vec(in, head, 4) || !read_vec(in, w, head[3]) ||
            !read_vec(in, wf, (size_t)head[1] * head[2])) {
            std::printf("FAIL truncated case %u in %s\n", c, path);
            return false;
        }
        ok &= run_quant(head[0], head[1], head[2], w, wf, rng);
    }
    return ok;
}

int main(int argc, char** argv) {
    Rng rng{41};
    bool all = true;
    // (m, n, k): one element; k inside one k-block, across several, not a
    // multiple of 4 or of 128, more k-blocks than warps (the unrolled loads
    // of a warp past the last); n not a multiple of the block's columns;
    // each shape's boundary (1 | 2..4 | 5..).
    const uint32_t cases[][3] = {
        {1, 1, 1},    {1, 37, 200},  {1, 6, 2053}, {2, 9, 130},  {3, 5, 77},
        {4, 12, 256}, {5, 17, 129},  {8, 8, 1000}, {9, 7, 300},  {13, 3, 64},
    };
    for (const auto& c : cases) all &= run_case(c[0], c[1], c[2], false, rng);
    all &= run_case(6, 10, 517, true, rng);
    all &= run_case(3, 4, 96, true, rng);
    if (argc > 1) all &= run_quant_file(argv[1], rng);
    return all ? 0 : 1;
}
