// Runs cuda/checksum.cuh's kernels (xxh3 over ranges, per-page checksums)
// on the SIMT emulator (simt_host.h); driven by tests/checksum_host.rs,
// which compares the output with twox-hash.
//
// Usage: checksum_sim DATA RANGES PAGES PAGE_BYTES N_LAYERS PAGE_SIZE ROW_BYTES
//   DATA: bytes (also the KV arena for the pages); RANGES: "offset len"
//   lines; PAGES: "page tokens" lines. Prints "R <hex>" per range, then
//   "P <checksum> <region hashes...>" per page.
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "checksum.cuh"

using namespace handoff;

// Runs `body` over `blocks` blocks of CHECKSUM_WARPS * 32 emulated threads.
template <typename Body>
void launch(unsigned blocks, Body body) {
    for (unsigned b = 0; b < blocks; ++b) {
        std::barrier<> block(CHECKSUM_WARPS * 32);
        std::vector<sim::Warp> warps(CHECKSUM_WARPS);
        std::vector<std::thread> threads;
        for (unsigned t = 0; t < CHECKSUM_WARPS * 32u; ++t)
            threads.emplace_back([&, t] {
                threadIdx = {t, 0, 0};
                blockIdx = {b, 0, 0};
                sim::ctx = {&warps[t / 32], &block, nullptr};
                body();
            });
        for (auto& th : threads) th.join();
    }
}

int main(int argc, char** argv) {
    if (argc != 8) return 2;
    FILE* f = std::fopen(argv[1], "rb");
    if (!f) return 3;
    std::vector<uint8_t> data;
    for (int c; (c = std::fgetc(f)) != EOF;) data.push_back((uint8_t)c);
    std::fclose(f);
    std::vector<uint64_t> offsets, lens;
    FILE* r = std::fopen(argv[2], "r");
    if (!r) return 4;
    for (unsigned long long o, l; std::fscanf(r, "%llu %llu", &o, &l) == 2;) {
        if (o + l > data.size()) return 5;
        offsets.push_back(o);
        lens.push_back(l);
    }
    std::fclose(r);
    std::vector<uint32_t> pages, tokens;
    FILE* pf = std::fopen(argv[3], "r");
    if (!pf) return 6;
    for (unsigned pg, t; std::fscanf(pf, "%u %u", &pg, &t) == 2;) {
        pages.push_back(pg);
        tokens.push_back(t);
    }
    std::fclose(pf);

    std::vector<uint64_t> out(offsets.size());
    HashRangesParams hp{data.data(), offsets.data(), lens.data(), out.data(), (uint32_t)offsets.size(), 0};
    launch((hp.n + CHECKSUM_WARPS - 1) / CHECKSUM_WARPS, [&] { xxh3_ranges_body(hp); });
    for (uint64_t h : out) std::printf("R %016llx\n", (unsigned long long)h);

    PageChecksumParams pp{};
    pp.kv = data.data();
    pp.pages = pages.data();
    pp.tokens = tokens.data();
    pp.page_bytes = std::strtoull(argv[4], nullptr, 10);
    pp.n_layers = std::strtoul(argv[5], nullptr, 10);
    pp.page_size = std::strtoul(argv[6], nullptr, 10);
    pp.row_bytes = std::strtoul(argv[7], nullptr, 10);
    pp.n_pages = pages.size();
    for (size_t i = 0; i < pages.size(); ++i)
        if ((pages[i] + 1) * pp.page_bytes > data.size() || tokens[i] > pp.page_size) return 7;
    std::vector<uint64_t> regions(pages.size() * 2 * pp.n_layers), sums(pages.size());
    pp.region_hashes = regions.data();
    pp.page_checksums = sums.data();
    launch(pp.n_pages, [&] { page_checksums_body(pp); });
    for (size_t i = 0; i < pages.size(); ++i) {
        std::printf("P %016llx", (unsigned long long)sums[i]);
        for (uint32_t j = 0; j < 2 * pp.n_layers; ++j)
            std::printf(" %016llx", (unsigned long long)regions[i * 2 * pp.n_layers + j]);
        std::printf("\n");
    }
    return 0;
}
