// Runs cuda/sampling.cuh's kernel on the SIMT emulator (simt_host.h);
// driven by tests/cuda/sampling_host.rs, which compares its tokens with the
// host's rule (src/sampling/row.rs).
//
// Usage: sampling_sim ROWS BLOCK
//   ROWS: binary, per row: u32 vocab, f32 temperature, u32 top_k, f32 top_p,
//   u32 logprobs (SampleDraw's), u64 random, then vocab f32 logits
//   (little-endian). BLOCK: threads per block, 32, 64 or 256. Prints
//   "<status> <token> <weights>" per row, where <weights> is the sum of
//   sample_weight over the row's finite logits against its largest (at
//   temperature 1 for greedy rows): the weight function itself, bit for bit,
//   whatever the draw picked. A row whose draw asks for log-probabilities
//   (and sampled) then runs row_logprobs on the same out buffer, and the
//   line goes on with "<logprob bits>" and "<id> <logprob bits>" per
//   alternative.
#include <algorithm>
#include <cstdio>
#include <thread>
#include <vector>

#include "sampling.cuh"

using namespace handoff;

template <int BLOCK, typename Body>
void run(unsigned n_rows, Body body) {
    std::vector<unsigned char> smem(sizeof(SampleSmem<BLOCK>));
    for (unsigned b = 0; b < n_rows; ++b) {
        std::barrier<> block(BLOCK);
        std::vector<sim::Warp> warps(BLOCK / 32);
        std::vector<std::thread> threads;
        for (unsigned t = 0; t < (unsigned)BLOCK; ++t)
            threads.emplace_back([&, t] {
                threadIdx = {t, 0, 0};
                blockIdx = {b, 0, 0};
                sim::ctx = {&warps[t / 32], &block, smem.data()};
                body();
            });
        for (auto& th : threads) th.join();
    }
}

int main(int argc, char** argv) {
    if (argc != 3) return 2;
    FILE* f = std::fopen(argv[1], "rb");
    if (!f) return 3;
    // Rows of different vocabularies: each row is its own launch.
    struct Row {
        SampleDraw draw;
        std::vector<float> logits;
    };
    std::vector<Row> rows;
    for (;;) {
        uint32_t vocab;
        if (std::fread(&vocab, 4, 1, f) != 1) break;
        Row r{};
        if (std::fread(&r.draw.temperature, 4, 1, f) != 1 || std::fread(&r.draw.top_k, 4, 1, f) != 1 ||
            std::fread(&r.draw.top_p, 4, 1, f) != 1 || std::fread(&r.draw.logprobs, 4, 1, f) != 1 ||
            std::fread(&r.draw.random, 8, 1, f) != 1)
            return 4;
        r.logits.resize(vocab);
        if (std::fread(r.logits.data(), 4, vocab, f) != vocab) return 5;
        rows.push_back(std::move(r));
    }
    std::fclose(f);
    const int block = std::atoi(argv[2]);
    for (auto& r : rows) {
        uint32_t out[2 + LOGPROB_STRIDE] = {};  // token, status, then the row's log-probabilities
        SampleParams p{r.logits.data(), &r.draw, out, 1, (uint32_t)r.logits.size()};
        LogprobParams lp{r.logits.data(), &r.draw, out, 1, (uint32_t)r.logits.size()};
        switch (block) {
            case 32:
                run<32>(1, [&] { sample_rows_body<32>(p); });
                run<32>(1, [&] { row_logprobs_body<32>(lp); });
                break;
            case 64:
                run<64>(1, [&] { sample_rows_body<64>(p); });
                run<64>(1, [&] { row_logprobs_body<64>(lp); });
                break;
            case 256:
                run<256>(1, [&] { sample_rows_body<256>(p); });
                run<256>(1, [&] { row_logprobs_body<256>(lp); });
                break;
            default: return 6;
        }
        float max = -INFINITY;
        for (float l : r.logits)
            if (finite_f32(l) && l > max) max = l;
        const float t = r.draw.temperature == 0.0f ? 1.0f : r.draw.temperature;
        unsigned long long weights = 0;
        for (float l : r.logits)
            if (finite_f32(l)) weights += sample_weight(l, max, log2e_over(t));
        std::printf("%u %u %llu", out[1], out[0], weights);
        if (r.draw.logprobs != 0 && out[1] == 0) {
            const uint32_t n = std::min<uint32_t>(std::min<uint32_t>(r.draw.logprobs - 1, LOGPROB_TOP_MAX),
                                                  (uint32_t)r.logits.size());
            std::printf(" %u", out[2]);
            for (uint32_t j = 0; j < n; ++j) std::printf(" %u %u", out[3 + 2 * j], out[4 + 2 * j]);
        }
        std::printf("\n");
    }
    return 0;
}
