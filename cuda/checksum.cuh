// xxh3-64 on the GPU: the transfer layer's per-page checksums computed over
// KV pages in device memory, bit-identical to src/transfer/checksum.rs.
//
// A region is the K (or V) rows of one page in one layer, slots
// 0..tokens: contiguous bytes of the arena (see params.cuh). A page's
// checksum is xxh3-64 over the little-endian concatenation of its region
// hashes [l0 K, l0 V, l1 K, ...]; u64 in GPU memory is little-endian, so
// that is the region-hash array itself.
//
// One warp hashes one byte range. Inputs up to 240 bytes take the short
// paths, every lane computing the same value. Longer ones go through
// xxh3.cuh's hash_long with WarpDelta: lane 2s+h loads half h of stripe s
// of a 1024-byte block (32 bytes, coalesced across the warp), computes what
// it adds to 4 accumulators, and the warp sums those by shuffles; every lane
// then holds the block's sum and applies it and the scramble. Blocks of a
// range follow each other (the scramble chains them).
//
// The bodies live in this header so that tests/checksum_host.rs can also
// run them on the host against the SIMT emulator of tests/support/sim/.
#pragma once
#ifdef HANDOFF_SIMT_HOST
#include "simt_host.h"
#endif
#include "params.cuh"
#include "xxh3.cuh"

namespace handoff {

constexpr int CHECKSUM_WARPS = 8;  // warps per block (page_checksums, xxh3_ranges)

// BlockDelta of the warp: see the header comment.
template <typename Load>
struct WarpDelta {
    Load load;
    __device__ __forceinline__ void operator()(const uint8_t* block, int stripes,
                                               uint64_t delta[8]) const {
        const int lane = threadIdx.x & 31, stripe = lane >> 1, half = lane & 1;
        uint64_t d[4] = {0, 0, 0, 0};
        if (stripe < stripes) xxh3::half_stripe_delta(block, stripe, half, d, load);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int o = 2; o < 32; o <<= 1) d[j] += __shfl_xor_sync(0xffffffffu, d[j], o);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const uint64_t other = __shfl_xor_sync(0xffffffffu, d[j], 1);
            delta[j] = half ? other : d[j];
            delta[4 + j] = half ? d[j] : other;
        }
    }
};

// xxh3-64 of `len` bytes at `in`, computed by the whole (converged) warp;
// every lane returns it.
__device__ __forceinline__ uint64_t hash64_warp(const uint8_t* in, uint64_t len) {
    if (len <= (uint64_t)xxh3::MIDSIZE_MAX) return xxh3::hash_short(in, len);
    if (((uintptr_t)in & 7) == 0) return xxh3::hash_long(in, len, WarpDelta<xxh3::AlignedLoad>{});
    return xxh3::hash_long(in, len, WarpDelta<xxh3::ByteLoad>{});
}

// One warp per range. grid (ceil(n / CHECKSUM_WARPS)); block CHECKSUM_WARPS * 32.
__device__ __forceinline__ void xxh3_ranges_body(const HashRangesParams& p) {
    const uint32_t r = blockIdx.x * CHECKSUM_WARPS + (threadIdx.x >> 5);
    if (r >= p.n) return;  // warp-uniform
    const uint64_t h = hash64_warp(p.data + p.offsets[r], p.lens[r]);
    if ((threadIdx.x & 31) == 0) p.out[r] = h;
}

// One block per listed page: its warps hash the page's 2 * n_layers regions,
// then warp 0 hashes the region hashes into the page checksum.
// grid (n_pages); block CHECKSUM_WARPS * 32.
__device__ __forceinline__ void page_checksums_body(const PageChecksumParams& p) {
    const uint32_t i = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const uint8_t* page = p.kv + (uint64_t)p.pages[i] * p.page_bytes;
    const uint64_t region_bytes = (uint64_t)p.page_size * p.row_bytes;
    const uint64_t len = (uint64_t)p.tokens[i] * p.row_bytes;
    const uint32_t n_regions = 2 * p.n_layers;
    uint64_t* regions = p.region_hashes + (uint64_t)i * n_regions;
    for (uint32_t r = warp; r < n_regions; r += CHECKSUM_WARPS) {
        // Region r is (layer r / 2, K or V r % 2): arena order within a page.
        const uint64_t h = hash64_warp(page + r * region_bytes, len);
        if (lane == 0) regions[r] = h;
    }
    __syncthreads();  // the block's global writes are visible to the block
    if (warp == 0) {
        const uint64_t h = hash64_warp(reinterpret_cast<const uint8_t*>(regions), 8ull * n_regions);
        if (lane == 0) p.page_checksums[i] = h;
    }
}

}  // namespace handoff
