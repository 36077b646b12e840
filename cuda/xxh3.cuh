// xxh3-64 (seed 0, default secret), written from the XXH3 algorithm
// description, for the GPU and the host alike: every function here is
// plain C++ marked __host__ __device__ under nvcc, so that the host test
// (tests/xxh3_host.rs) compiles this very header with g++ (and nvcc when
// present) and checks it bit for bit against the `twox-hash` crate the
// transfer layer uses (src/transfer/checksum.rs).
//
// Only seed 0 is implemented: the transfer layer's checksums use no seed,
// and a seeded long hash would need a derived secret.
//
// The long path (> 240 bytes) is written around `BlockDelta`: the sum, over
// the stripes of one 1024-byte block, of what each stripe adds to the 8
// accumulators. Addition is the only thing that combines stripes within a
// block (the scramble comes after the block), so the sum may be formed in
// any order: the scalar version adds stripe after stripe, the warp version
// (checksum.cu) gives each lane half a stripe and reduces with shuffles,
// and `LaneSplitDelta` runs that same per-lane split on the host, 32
// virtual lanes in a loop, for the host test.
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __CUDACC__
#define XXH3_HD __host__ __device__ __forceinline__
#else
#define XXH3_HD inline
#endif

namespace handoff {
namespace xxh3 {

constexpr uint64_t P32_1 = 0x9E3779B1u, P32_2 = 0x85EBCA77u, P32_3 = 0xC2B2AE3Du;
constexpr uint64_t P64_1 = 0x9E3779B185EBCA87ull, P64_2 = 0xC2B2AE3D27D4EB4Full,
                   P64_3 = 0x165667B19E3779F9ull, P64_4 = 0x85EBCA77C2B2AE63ull,
                   P64_5 = 0x27D4EB2F165667C5ull;
constexpr uint64_t PMX_1 = 0x165667919E3779F9ull, PMX_2 = 0x9FB21C651E98DF25ull;

constexpr int SECRET_LEN = 192;
constexpr int STRIPE = 64;
constexpr int STRIPES_PER_BLOCK = (SECRET_LEN - STRIPE) / 8;  // 16
constexpr int BLOCK = STRIPE * STRIPES_PER_BLOCK;             // 1024 bytes
constexpr int MIDSIZE_MAX = 240;

// The default secret (the specification's kSecret).
#define HANDOFF_XXH3_SECRET                                                                     \
    {                                                                                           \
        0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21,     \
            0xad, 0x1c, 0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, \
            0xb7, 0xb3, 0x67, 0x1f, 0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, \
            0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21, 0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, \
            0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, \
            0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3, 0x71, 0x64, 0x48, 0x97, \
            0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8, 0xa8, 0xfa, \
            0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d, \
            0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, \
            0x73, 0x64, 0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, \
            0xfa, 0x13, 0x63, 0xeb, 0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, \
            0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e, 0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, \
            0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce, 0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, \
            0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e                          \
    }

#ifdef __CUDACC__
// Device code reads the secret from constant memory; each .cu that includes
// this header gets its own copy (every .cu is its own module).
static __constant__ uint8_t kSecretDevice[SECRET_LEN] = HANDOFF_XXH3_SECRET;
#endif
static const uint8_t kSecretHost[SECRET_LEN] = HANDOFF_XXH3_SECRET;

XXH3_HD const uint8_t* secret() {
#ifdef __CUDA_ARCH__
    return kSecretDevice;
#else
    return kSecretHost;
#endif
}

// Little-endian loads at any alignment (byte by byte: the compiler merges
// them where it can prove alignment; the warp path uses aligned loads).
XXH3_HD uint32_t read32(const uint8_t* p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
XXH3_HD uint64_t read64(const uint8_t* p) {
    return (uint64_t)read32(p) | ((uint64_t)read32(p + 4) << 32);
}
XXH3_HD uint64_t secret64(int offset) { return read64(secret() + offset); }

XXH3_HD uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
XXH3_HD uint32_t swap32(uint32_t x) {
    return ((x << 24) & 0xff000000u) | ((x << 8) & 0x00ff0000u) | ((x >> 8) & 0x0000ff00u) |
           ((x >> 24) & 0x000000ffu);
}
XXH3_HD uint64_t swap64(uint64_t x) {
    return ((uint64_t)swap32((uint32_t)x) << 32) | swap32((uint32_t)(x >> 32));
}

// Low 64 bits xor high 64 bits of the 128-bit product.
XXH3_HD uint64_t mul128_fold64(uint64_t a, uint64_t b) {
#ifdef __CUDA_ARCH__
    return (a * b) ^ __umul64hi(a, b);
#else
    const unsigned __int128 p = (unsigned __int128)a * b;
    return (uint64_t)p ^ (uint64_t)(p >> 64);
#endif
}

XXH3_HD uint64_t xxh64_avalanche(uint64_t h) {
    h ^= h >> 33;
    h *= P64_2;
    h ^= h >> 29;
    h *= P64_3;
    h ^= h >> 32;
    return h;
}

XXH3_HD uint64_t avalanche(uint64_t h) {
    h ^= h >> 37;
    h *= PMX_1;
    h ^= h >> 32;
    return h;
}

XXH3_HD uint64_t rrmxmx(uint64_t h, uint64_t len) {
    h ^= rotl64(h, 49) ^ rotl64(h, 24);
    h *= PMX_2;
    h ^= (h >> 35) + len;
    h *= PMX_2;
    h ^= h >> 28;
    return h;
}

XXH3_HD uint64_t mix16(const uint8_t* in, int secret_offset) {
    return mul128_fold64(read64(in) ^ secret64(secret_offset),
                         read64(in + 8) ^ secret64(secret_offset + 8));
}

// ------------------------------------------------------------ 0..=240 bytes

XXH3_HD uint64_t hash_0to16(const uint8_t* in, size_t len) {
    if (len > 8) {
        const uint64_t lo = read64(in) ^ (secret64(24) ^ secret64(32));
        const uint64_t hi = read64(in + len - 8) ^ (secret64(40) ^ secret64(48));
        return avalanche(len + swap64(lo) + hi + mul128_fold64(lo, hi));
    }
    if (len >= 4) {
        const uint64_t x = (uint64_t)read32(in + len - 4) + ((uint64_t)read32(in) << 32);
        return rrmxmx(x ^ (secret64(8) ^ secret64(16)), len);
    }
    if (len > 0) {
        const uint32_t c = ((uint32_t)in[0] << 16) | ((uint32_t)in[len >> 1] << 24) |
                           (uint32_t)in[len - 1] | ((uint32_t)len << 8);
        const uint32_t flip = read32(secret()) ^ read32(secret() + 4);
        return xxh64_avalanche((uint64_t)(c ^ flip));
    }
    return xxh64_avalanche(secret64(56) ^ secret64(64));
}

XXH3_HD uint64_t hash_17to128(const uint8_t* in, size_t len) {
    uint64_t acc = len * P64_1;
    if (len > 32) {
        if (len > 64) {
            if (len > 96) {
                acc += mix16(in + 48, 96);
                acc += mix16(in + len - 64, 112);
            }
            acc += mix16(in + 32, 64);
            acc += mix16(in + len - 48, 80);
        }
        acc += mix16(in + 16, 32);
        acc += mix16(in + len - 32, 48);
    }
    acc += mix16(in, 0);
    acc += mix16(in + len - 16, 16);
    return avalanche(acc);
}

XXH3_HD uint64_t hash_129to240(const uint8_t* in, size_t len) {
    uint64_t acc = len * P64_1;
    for (int i = 0; i < 8; ++i) acc += mix16(in + 16 * i, 16 * i);
    acc = avalanche(acc);
    const int rounds = (int)(len / 16);
    for (int i = 8; i < rounds; ++i) acc += mix16(in + 16 * i, 16 * (i - 8) + 3);
    acc += mix16(in + len - 16, 136 - 17);
    return avalanche(acc);
}

XXH3_HD uint64_t hash_short(const uint8_t* in, size_t len) {
    if (len <= 16) return hash_0to16(in, len);
    if (len <= 128) return hash_17to128(in, len);
    return hash_129to240(in, len);
}

// --------------------------------------------------------------- > 240 bytes

// Input word loads for the block loop: any alignment, or 8-byte aligned
// (a plain 64-bit load on the GPU).
struct ByteLoad {
    XXH3_HD uint64_t operator()(const uint8_t* p) const { return read64(p); }
};
struct AlignedLoad {
    XXH3_HD uint64_t operator()(const uint8_t* p) const {
#ifdef __CUDA_ARCH__
        return *reinterpret_cast<const uint64_t*>(p);
#else
        return read64(p);
#endif
    }
};

// One stripe added to the accumulators, its key at secret + secret_offset.
XXH3_HD void accumulate_stripe(uint64_t acc[8], const uint8_t* in, int secret_offset) {
    for (int i = 0; i < 8; ++i) {
        const uint64_t v = read64(in + 8 * i);
        const uint64_t k = v ^ secret64(secret_offset + 8 * i);
        acc[i ^ 1] += v;
        acc[i] += (k & 0xffffffffull) * (k >> 32);
    }
}

XXH3_HD void scramble(uint64_t acc[8]) {
    for (int i = 0; i < 8; ++i) {
        uint64_t a = acc[i];
        a ^= a >> 47;
        a ^= secret64(SECRET_LEN - STRIPE + 8 * i);
        acc[i] = a * P32_1;
    }
}

// Half `half` (words 4*half .. 4*half+3) of stripe `stripe` of a block: its
// additions to acc[4*half .. 4*half+3] (pairs never cross halves).
template <typename Load>
XXH3_HD void half_stripe_delta(const uint8_t* block, int stripe, int half, uint64_t d[4],
                               const Load& load) {
    for (int j = 0; j < 4; ++j) d[j] = 0;
    const int word0 = 4 * half;
    const uint8_t* in = block + STRIPE * stripe + 8 * word0;
    for (int j = 0; j < 4; ++j) {
        const uint64_t v = load(in + 8 * j);
        const uint64_t k = v ^ secret64(8 * stripe + 8 * (word0 + j));
        d[j ^ 1] += v;
        d[j] += (k & 0xffffffffull) * (k >> 32);
    }
}

// BlockDelta policies: delta[0..8] = what the first `stripes` stripes of
// the block at `block` add to the accumulators.
struct ScalarDelta {
    XXH3_HD void operator()(const uint8_t* block, int stripes, uint64_t delta[8]) const {
        for (int i = 0; i < 8; ++i) delta[i] = 0;
        for (int s = 0; s < stripes; ++s) accumulate_stripe(delta, block + STRIPE * s, 8 * s);
    }
};

// The warp split of checksum.cu run by one thread: lane = 2 * stripe + half.
struct LaneSplitDelta {
    XXH3_HD void operator()(const uint8_t* block, int stripes, uint64_t delta[8]) const {
        for (int i = 0; i < 8; ++i) delta[i] = 0;
        for (int lane = 0; lane < 32; ++lane) {
            const int stripe = lane >> 1, half = lane & 1;
            if (stripe >= stripes) continue;
            uint64_t d[4];
            half_stripe_delta(block, stripe, half, d, ByteLoad{});
            for (int j = 0; j < 4; ++j) delta[4 * half + j] += d[j];
        }
    }
};

template <typename BlockDelta>
XXH3_HD uint64_t hash_long(const uint8_t* in, size_t len, const BlockDelta& block_delta) {
    uint64_t acc[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    uint64_t delta[8];
    const size_t blocks = (len - 1) / BLOCK;
    for (size_t b = 0; b < blocks; ++b) {
        block_delta(in + b * BLOCK, STRIPES_PER_BLOCK, delta);
        for (int i = 0; i < 8; ++i) acc[i] += delta[i];
        scramble(acc);
    }
    // The last block: its whole stripes but the final one, then the last 64
    // bytes of the input (overlapping) with the secret at 192 - 64 - 7.
    const int stripes = (int)(((len - 1) - BLOCK * blocks) / STRIPE);
    block_delta(in + blocks * BLOCK, stripes, delta);
    for (int i = 0; i < 8; ++i) acc[i] += delta[i];
    accumulate_stripe(acc, in + len - STRIPE, SECRET_LEN - STRIPE - 7);
    // Merge the accumulators, secret from offset 11.
    uint64_t h = len * P64_1;
    for (int i = 0; i < 4; ++i) {
        h += mul128_fold64(acc[2 * i] ^ secret64(11 + 16 * i), acc[2 * i + 1] ^ secret64(11 + 16 * i + 8));
    }
    return avalanche(h);
}

// xxh3-64 of `len` bytes at `in`, seed 0: the one-thread version.
XXH3_HD uint64_t hash64(const uint8_t* in, size_t len) {
    if (len <= MIDSIZE_MAX) return hash_short(in, len);
    return hash_long(in, len, ScalarDelta{});
}

}  // namespace xxh3
}  // namespace handoff
