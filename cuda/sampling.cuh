// Token sampling on the device: src/sampling/row.rs's rule, bit for bit, so
// that only token ids cross to the host and a seed picks the same tokens
// on either backend for the same logits.
//
// One block per row. Every quantity is exact or rounded the way the host
// rounds it: keys and weights are integers (a sum of integers does not
// depend on the order a reduction adds them in), and the one f64 formula
// (the weight) uses only correctly rounded operations, each on its own:
// mul_rn/add_rn keep nvcc from fusing a multiply into an add. The passes:
//
//   1. first non-finite logit (the row fails) and the largest key; a greedy
//      row ends here with that key's token;
//   2. top-k: the k-th largest key, by radix selection over the 64-bit keys,
//      8 bits a pass, counting keys per digit;
//   3. the total weight of the kept keys;
//   4. top-p: the key ending the shortest rank-order prefix whose weight
//      reaches ceil(p * total): the same radix descent, summing weights per
//      digit instead of counting;
//   5. the draw: tiles of BLOCK tokens in id order, an inclusive scan of the
//      kept weights per tile; the one thread whose running weight steps over
//      u takes the token.
//
// The body lives in this header so that tests/cuda/sampling_host.rs can run
// it on the host SIMT emulator of tests/support/sim/ against the Rust rule.
#pragma once
#ifdef HANDOFF_SIMT_HOST
#include "simt_host.h"
#endif
#include "params.cuh"

namespace handoff {

constexpr int SAMPLE_THREADS = 256;  // threads per block (one row each)
constexpr uint32_t WEIGHT_BITS = 40;  // src/sampling/row.rs: the top token weighs 2^40
constexpr uint64_t NO_INDEX = ~0ull;

// f64 operations rounded on their own (never contracted into an FMA).
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

__device__ __forceinline__ bool finite_f32(float x) {
    return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
}

// The rank of token `id` (src/sampling/row.rs's `key`).
__device__ __forceinline__ uint64_t sample_key(float logit, uint32_t id) {
    const uint32_t b = __float_as_uint(logit);
    const uint32_t ordered = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((uint64_t)ordered << 32) | (uint64_t)(0xffffffffu - id);
}

__device__ __forceinline__ uint32_t key_id(uint64_t key) { return 0xffffffffu - (uint32_t)key; }

// log2(e) / t: the one division of a row's weights (src/sampling/row.rs's `log2e_over`).
__device__ __forceinline__ double log2e_over(float t) { return 1.4426950408889634 / (double)t; }

// floor(exp((logit - max) / t) * 2^40), scale = log2e_over(t)
// (src/sampling/row.rs's `weight`).
__device__ __forceinline__ uint64_t sample_weight(float logit, float max, double scale) {
    const double y = mul_rn((double)logit - (double)max, scale);
    if (!(y > -(double)(WEIGHT_BITS + 1))) return 0;
    const double n = floor(y);
    const double z = (y - n) * 0.6931471805599453;  // LN_2
    const double c[13] = {1.0,          1.0,           1.0 / 2.0,        1.0 / 6.0,      1.0 / 24.0,
                          1.0 / 120.0,  1.0 / 720.0,   1.0 / 5040.0,     1.0 / 40320.0,  1.0 / 362880.0,
                          1.0 / 3628800.0, 1.0 / 39916800.0, 1.0 / 479001600.0};
    double p = c[12];
#pragma unroll
    for (int k = 11; k >= 0; --k) p = add_rn(mul_rn(p, z), c[k]);
    const double pow2 = __longlong_as_double((long long)(1023 + WEIGHT_BITS + (int)n) << 52);
    return __double2ull_rz(p * pow2);
}

// ceil(p * total), at least 1, at most total (src/sampling/row.rs's `nucleus_need`).
__device__ __forceinline__ uint64_t nucleus_need(float top_p, uint64_t total) {
    const double t = __ull2double_rn(total);
    const double x = ceil((double)top_p * t);
    if (x >= t) return total;
    const uint64_t n = __double2ull_rz(x);
    return n > 0 ? n : 1;
}

// floor(r * kept / 2^53), r the top 53 bits of `random`.
__device__ __forceinline__ uint64_t draw_point(uint64_t random, uint64_t kept) {
    const uint64_t a = random >> 11;
    const uint64_t lo = a * kept, hi = __umul64hi(a, kept);
    return (hi << 11) | (lo >> 53);
}

template <int BLOCK>
struct SampleSmem {
    unsigned long long hist[256];  // per digit: key counts (top-k) or weights (top-p)
    unsigned long long scan[BLOCK];
    uint64_t red[BLOCK / 32];
    uint64_t bcast[2];
    uint32_t found;
};

template <int BLOCK>
__device__ __forceinline__ SampleSmem<BLOCK>& sample_smem() {
#ifdef HANDOFF_SIMT_HOST
    return *reinterpret_cast<SampleSmem<BLOCK>*>(sim::ctx.smem);
#else
    __shared__ SampleSmem<BLOCK> s;
    return s;
#endif
}

struct MaxOp {
    __device__ __forceinline__ uint64_t operator()(uint64_t a, uint64_t b) const { return a > b ? a : b; }
};
struct MinOp {
    __device__ __forceinline__ uint64_t operator()(uint64_t a, uint64_t b) const { return a < b ? a : b; }
};
struct SumOp {
    __device__ __forceinline__ uint64_t operator()(uint64_t a, uint64_t b) const { return a + b; }
};

// `op` over the block's values; every thread returns it.
template <int BLOCK, typename Op>
__device__ __forceinline__ uint64_t block_reduce(uint64_t v, Op op, SampleSmem<BLOCK>& s) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    if ((threadIdx.x & 31) == 0) s.red[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        uint64_t r = s.red[0];
        for (int w = 1; w < BLOCK / 32; ++w) r = op(r, s.red[w]);
        s.bcast[0] = r;
    }
    __syncthreads();
    const uint64_t r = s.bcast[0];
    __syncthreads();  // bcast and red are reused by the next call
    return r;
}

// The key at which the rank-order running `value` (1 per key: a count; or
// the key's weight) of the keys >= floor first reaches `need` (>= 1, and at
// most their total), and that running value there. Keys are distinct, so
// eight digit passes pin it exactly.
template <int BLOCK, bool WEIGHTED>
__device__ __forceinline__ uint64_t radix_select(const float* x, uint32_t vocab, uint64_t floor_key, float max,
                                                 double scale, uint64_t need, SampleSmem<BLOCK>& s,
                                                 uint64_t* reached) {
    uint64_t prefix = 0, above = 0;
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += BLOCK) s.hist[b] = 0;
        __syncthreads();
        const uint64_t hi_mask = shift == 56 ? 0 : (~0ull << (shift + 8));
        for (uint32_t i = threadIdx.x; i < vocab; i += BLOCK) {
            const float l = x[i];
            const uint64_t k = sample_key(l, i);
            if (k >= floor_key && (k & hi_mask) == prefix) {
                const unsigned long long v = WEIGHTED ? sample_weight(l, max, scale) : 1ull;
                if (v) atomicAdd(&s.hist[(k >> shift) & 255], v);
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int b = 255; b >= 0; --b) {
                if (above + s.hist[b] >= need || b == 0) {
                    prefix |= (uint64_t)b << shift;
                    if (shift == 0) above += s.hist[b];
                    break;
                }
                above += s.hist[b];
            }
            s.bcast[0] = prefix;
            s.bcast[1] = above;
        }
        __syncthreads();
        prefix = s.bcast[0];
        above = s.bcast[1];
        __syncthreads();
    }
    *reached = above;
    return prefix;
}

// One row per block; BLOCK threads (a multiple of 32, at most 1024).
template <int BLOCK>
__device__ __forceinline__ void sample_rows_body(const SampleParams& p) {
    SampleSmem<BLOCK>& s = sample_smem<BLOCK>();
    const uint32_t row = blockIdx.x;
    if (row >= p.n_rows) return;  // block-uniform
    const float* x = p.logits + (uint64_t)row * p.vocab;
    const SampleDraw d = p.draws[row];
    const uint32_t V = p.vocab;

    // 1. Non-finite logits fail the row; the largest key.
    uint64_t bad = NO_INDEX, top = 0;
    for (uint32_t i = threadIdx.x; i < V; i += BLOCK) {
        const float l = x[i];
        if (!finite_f32(l)) {
            bad = bad < i ? bad : i;
        } else {
            const uint64_t k = sample_key(l, i);
            top = top > k ? top : k;
        }
    }
    bad = block_reduce<BLOCK>(bad, MinOp{}, s);
    top = block_reduce<BLOCK>(top, MaxOp{}, s);
    if (bad != NO_INDEX) {
        if (threadIdx.x == 0) {
            p.out[row] = __float_as_uint(x[bad]);  // the culprit's bits
            p.out[p.n_rows + row] = 1 + (uint32_t)bad;
        }
        return;
    }
    if (d.temperature == 0.0f) {
        if (threadIdx.x == 0) {
            p.out[row] = key_id(top);
            p.out[p.n_rows + row] = 0;
        }
        return;
    }
    const float max = x[key_id(top)];
    const double scale = log2e_over(d.temperature);

    // 2. Top-k: keys >= the k-th largest.
    uint64_t floor_key = 0, unused = 0;
    if (d.top_k != 0 && d.top_k < V)
        floor_key = radix_select<BLOCK, false>(x, V, 0, max, scale, d.top_k, s, &unused);

    // 3. Their total weight.
    uint64_t w_sum = 0;
    for (uint32_t i = threadIdx.x; i < V; i += BLOCK) {
        const float l = x[i];
        if (sample_key(l, i) >= floor_key) w_sum += sample_weight(l, max, scale);
    }
    const uint64_t total = block_reduce<BLOCK>(w_sum, SumOp{}, s);

    // 4. Top-p: the shortest rank-order prefix reaching ceil(p * total).
    uint64_t kept = total;
    if (d.top_p < 1.0f)
        floor_key = radix_select<BLOCK, true>(x, V, floor_key, max, scale, nucleus_need(d.top_p, total), s,
                                              &kept);

    // 5. The draw, in token id order.
    const uint64_t u = draw_point(d.random, kept);
    if (threadIdx.x == 0) s.found = 0;
    __syncthreads();
    uint64_t carry = 0;
    for (uint32_t base = 0; base < V; base += BLOCK) {
        const uint32_t i = base + threadIdx.x;
        uint64_t w = 0;
        if (i < V) {
            const float l = x[i];
            if (sample_key(l, i) >= floor_key) w = sample_weight(l, max, scale);
        }
        s.scan[threadIdx.x] = w;
        __syncthreads();
        for (int off = 1; off < BLOCK; off <<= 1) {
            const uint64_t add = threadIdx.x >= (unsigned)off ? s.scan[threadIdx.x - off] : 0;
            __syncthreads();
            s.scan[threadIdx.x] += add;
            __syncthreads();
        }
        const uint64_t incl = carry + s.scan[threadIdx.x];
        if (w > 0 && incl - w <= u && u < incl) {
            p.out[row] = i;
            p.out[p.n_rows + row] = 0;
            s.found = 1;
        }
        carry += s.scan[BLOCK - 1];
        __syncthreads();
        if (s.found) return;  // block-uniform
    }
    // Unreachable: the kept weights sum to kept > u (the host says the same).
    if (threadIdx.x == 0) {
        p.out[row] = key_id(top);
        p.out[p.n_rows + row] = 0;
    }
}

// The launched instantiation. grid (n_rows); block SAMPLE_THREADS.
__device__ __forceinline__ void sample_rows(const SampleParams& p) { sample_rows_body<SAMPLE_THREADS>(p); }

// Log-probabilities (src/sampling/logprobs.rs): the model's distribution,
// log_softmax at temperature 1, whatever the row sampled with.
constexpr uint32_t LOGPROB_TOP_MAX = 20;                       // src/sampling: MAX_TOP_LOGPROBS
constexpr uint32_t LOGPROB_STRIDE = 1 + 2 * LOGPROB_TOP_MAX;  // u32 words per row

// The block's f64 sum; every thread returns it. Lanes, then warps in order:
// a fixed order (the host sums in index order, so the two agree to about an
// ulp of the f64 sum, far below the f32 the values are reported in).
template <int BLOCK>
__device__ __forceinline__ double block_sum_f64(double v, SampleSmem<BLOCK>& s) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) s.red[threadIdx.x >> 5] = (uint64_t)__double_as_longlong(v);
    __syncthreads();
    if (threadIdx.x == 0) {
        double r = __longlong_as_double((long long)s.red[0]);
        for (int w = 1; w < BLOCK / 32; ++w) r += __longlong_as_double((long long)s.red[w]);
        s.bcast[0] = (uint64_t)__double_as_longlong(r);
    }
    __syncthreads();
    const double r = __longlong_as_double((long long)s.bcast[0]);
    __syncthreads();
    return r;
}

// ln p(logit) as f32, differences in f64 (src/sampling's `logprob_of`); below
// f32's range it reads the most negative finite f32.
__device__ __forceinline__ uint32_t logprob_bits(float logit, float max, double ln_sum) {
    const float v = (float)(((double)logit - (double)max) - ln_sum);
    return __float_as_uint(v < -3.4028234663852886e38f ? -3.4028234663852886e38f : v);
}

// One row per block; BLOCK threads (a multiple of 32, at most 1024).
template <int BLOCK>
__device__ __forceinline__ void row_logprobs_body(const LogprobParams& p) {
    SampleSmem<BLOCK>& s = sample_smem<BLOCK>();
    const uint32_t row = blockIdx.x;
    if (row >= p.n_rows) return;  // block-uniform
    const uint32_t ask = p.draws[row].logprobs;
    if (ask == 0 || p.out[p.n_rows + row] != 0) return;  // not asked, or the row failed
    const uint32_t want = ask - 1 < LOGPROB_TOP_MAX ? ask - 1 : LOGPROB_TOP_MAX;
    const float* x = p.logits + (uint64_t)row * p.vocab;
    const uint32_t V = p.vocab;
    uint32_t* o = p.out + 2 * (uint64_t)p.n_rows + (uint64_t)row * LOGPROB_STRIDE;

    // The largest key, then ln Σ exp(l - max).
    uint64_t top = 0;
    for (uint32_t i = threadIdx.x; i < V; i += BLOCK) {
        const uint64_t k = sample_key(x[i], i);
        top = top > k ? top : k;
    }
    top = block_reduce<BLOCK>(top, MaxOp{}, s);
    const float max = x[key_id(top)];
    double sum = 0.0;
    for (uint32_t i = threadIdx.x; i < V; i += BLOCK) sum += exp((double)x[i] - (double)max);
    const double ln_sum = log(block_sum_f64<BLOCK>(sum, s));
    if (threadIdx.x == 0) o[0] = logprob_bits(x[p.out[row]], max, ln_sum);

    // The most likely tokens: each the largest key below the last (keys are
    // distinct and a finite logit's key is never 0).
    uint64_t below = ~0ull;
    for (uint32_t j = 0; j < want && j < V; ++j) {
        uint64_t best = 0;
        for (uint32_t i = threadIdx.x; i < V; i += BLOCK) {
            const uint64_t k = sample_key(x[i], i);
            if (k < below && k > best) best = k;
        }
        best = block_reduce<BLOCK>(best, MaxOp{}, s);
        if (threadIdx.x == 0) {
            o[1 + 2 * j] = key_id(best);
            o[2 + 2 * j] = logprob_bits(x[key_id(best)], max, ln_sum);
        }
        below = best;
    }
}

// The launched instantiation. grid (n_rows); block SAMPLE_THREADS.
__device__ __forceinline__ void row_logprobs(const LogprobParams& p) { row_logprobs_body<SAMPLE_THREADS>(p); }

}  // namespace handoff
