//! One row's token, by a rule a GPU follows bit for bit.
//!
//! The device samples on the device (only token ids cross to the host), and
//! a request must get the same tokens from the same seed and logits on
//! either backend. So every quantity here is computed by operations that
//! round the same way on both: integer arithmetic, and f64 multiplies,
//! adds, divides and floors, each rounded on its own (no fused
//! multiply-add; `cuda/sampling.cuh` spells them `__dmul_rn`/`__dadd_rn`).
//! Sums are of integers, so the order of a parallel reduction cannot change
//! them. The rule:
//!
//! 1. Every logit must be finite; greedy (`temperature == 0`) takes the
//!    first largest.
//! 2. Tokens are ranked by [`key`]: higher logit first, lower id first among
//!    equals (each key is distinct). Top-k keeps the `k` highest keys.
//! 3. Each kept token weighs [`weight`]: `exp((logit - max) / temperature)`
//!    in fixed point, `floor(w * 2^40)`; the most likely token weighs
//!    exactly `2^40`, and a token under `2^-40` of it weighs 0 (it cannot be
//!    drawn).
//! 4. Top-p keeps the shortest prefix in rank order whose weight reaches
//!    `ceil(p * total)` ([`nucleus_need`]).
//! 5. The draw: `u = floor(r * kept / 2^53)` with `r` the top 53 bits of the
//!    request stream's next value, then the first kept token, in token id
//!    order, whose running weight exceeds `u`.

use super::{Draw, SamplingError, argmax, check_finite};

/// Fixed-point bits of a weight: the most likely token weighs `2^40`.
pub const WEIGHT_BITS: u32 = 40;

/// The largest vocabulary a row may have: its weights sum within a u64.
pub const MAX_VOCAB: usize = 1 << 23;

/// Taylor coefficients `1/k!` of `e^z`, `k = 0..=12`: each one correctly
/// rounded division of exact integers, in Rust as in C++.
const EXP_TAYLOR: [f64; 13] = [
    1.0,
    1.0,
    1.0 / 2.0,
    1.0 / 6.0,
    1.0 / 24.0,
    1.0 / 120.0,
    1.0 / 720.0,
    1.0 / 5040.0,
    1.0 / 40320.0,
    1.0 / 362880.0,
    1.0 / 3628800.0,
    1.0 / 39916800.0,
    1.0 / 479001600.0,
];

/// A token's rank: the logit's order-preserving bits above the id's
/// complement, so a larger key is a higher logit, then a lower id.
pub fn key(logit: f32, id: usize) -> u64 {
    let b = logit.to_bits();
    let ordered = if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    };
    ((ordered as u64) << 32) | (u32::MAX - id as u32) as u64
}

/// The token id a [`key`] ranks.
pub fn key_id(key: u64) -> usize {
    (u32::MAX - key as u32) as usize
}

/// `floor(exp((logit - max) / temperature) * 2^40)` for `logit <= max`,
/// `temperature > 0`, accurate to about 1e-12 and the same bits on the GPU.
pub fn weight(logit: f32, max: f32, temperature: f32) -> u64 {
    weight_scaled(logit, max, log2e_over(temperature))
}

/// `log2(e) / temperature`, the one division of a row's weights.
pub fn log2e_over(temperature: f32) -> f64 {
    std::f64::consts::LOG2_E / temperature as f64
}

/// 2^52: adding it to a float in [0, 2^51) rounds that to an integer (in
/// the default round-to-nearest mode), which then sits in the low mantissa
/// bits.
const MAGIC: f64 = 4_503_599_627_370_496.0;

/// `floor(x)` for `|x| < 2^51`, in plain float operations (a loop over a row
/// vectorises; `f64::floor` is a library call without SSE4.1). Exact.
#[inline(always)]
fn floor_small(x: f64) -> f64 {
    let r = if x >= 0.0 {
        (x + MAGIC) - MAGIC
    } else {
        (x - MAGIC) + MAGIC
    };
    if r > x { r - 1.0 } else { r }
}

/// [`weight`] with `log2e_over(temperature)` given: `2^y` in fixed point
/// for `y = (logit - max) * scale`, written so that a loop over a row
/// vectorises: no branch, no library call, no float-to-integer conversion
/// (integers in [0, 2^51) are read from the mantissa after adding 2^52).
/// The same value as `floor(e^(z) * 2^(40 + n))` computed with a float
/// floor and casts, as the GPU does.
#[inline(always)]
pub(super) fn weight_scaled(logit: f32, max: f32, scale: f64) -> u64 {
    let y = (logit as f64 - max as f64) * scale;
    // Under 2^-41 of the top (or -inf, or NaN): weighs 0.
    let live = y > -(WEIGHT_BITS as f64 + 1.0);
    let y = if live { y } else { 0.0 };
    let n = floor_small(y);
    // 2^y = 2^n * e^z, z in [0, ln 2).
    let z = (y - n) * std::f64::consts::LN_2;
    let mut p = EXP_TAYLOR[12];
    for &c in EXP_TAYLOR[..12].iter().rev() {
        p = p * z + c;
    }
    // 2^(40 + n), n in [-41, 0]: the biased exponent 1023 + 40 + n >= 1022.
    let biased = ((1023.0 + WEIGHT_BITS as f64 + n) + MAGIC).to_bits() - MAGIC.to_bits();
    let pow2 = f64::from_bits(biased << 52);
    let w = floor_small(p * pow2);
    let w = (w + MAGIC).to_bits() - MAGIC.to_bits();
    if live { w } else { 0 }
}

/// `e^x` for `x <= 0` (0 below `-700`, where it is under 2^-1009 of 1),
/// accurate to about 1e-12 (far below the f32 log-probabilities it
/// serves), in plain float operations so that a loop of it
/// vectorises (as [`weight_scaled`]: the same range reduction and Taylor
/// polynomial).
#[inline(always)]
pub(super) fn exp_nonpositive(x: f64) -> f64 {
    let live = x > -700.0;
    let y = if live {
        x * std::f64::consts::LOG2_E
    } else {
        0.0
    };
    let n = floor_small(y);
    let z = (y - n) * std::f64::consts::LN_2;
    let mut p = EXP_TAYLOR[12];
    for &c in EXP_TAYLOR[..12].iter().rev() {
        p = p * z + c;
    }
    // 2^n, n in [-1010, 0]: the biased exponent 1023 + n >= 13.
    let biased = ((1023.0 + n) + MAGIC).to_bits() - MAGIC.to_bits();
    let e = p * f64::from_bits(biased << 52);
    if live { e } else { 0.0 }
}

/// Reused buffers of [`sample_row`].
#[derive(Clone, Debug, Default)]
pub struct RowScratch {
    keys: Vec<u64>,
    weights: Vec<u64>,
}

/// The weight top-p must reach: `ceil(p * total)`, at least 1, at most
/// `total`.
pub fn nucleus_need(top_p: f32, total: u64) -> u64 {
    let x = (top_p as f64 * total as f64).ceil();
    if x >= total as f64 {
        total
    } else {
        (x as u64).max(1)
    }
}

/// `floor(r * kept / 2^53)` with `r` the top 53 bits of `random`: in
/// `[0, kept)`.
pub fn draw_point(random: u64, kept: u64) -> u64 {
    (((random >> 11) as u128 * kept as u128) >> 53) as u64
}

/// The token `d` chooses from `logits` (see the module doc). `scratch` is
/// reused across calls.
pub fn sample_row(
    logits: &[f32],
    d: &Draw,
    scratch: &mut RowScratch,
) -> Result<u32, SamplingError> {
    sample_row_with(logits, d, None, scratch)
}

/// The token `d` chooses from `logits` at a position where a drafter
/// proposed `draft`: the speculative rejection rule for a drafter that
/// proposes one token for sure (its distribution a point mass). The draft
/// is kept with probability `p(draft)` (its kept weight over the kept
/// total); otherwise the token comes from `p` with the draft removed and
/// the rest renormalised (`max(0, p - q)`, normalised). One draw decides
/// both: the draw point `u` ([`draw_point`]) falls in the draft's weight
/// first, then walks the other kept tokens in id order. So the token has
/// exactly [`sample_row`]'s distribution (a permutation of the same
/// weights over the same draw point), and the same draw gives the same
/// token. Greedy keeps the draft only when it is the argmax.
pub fn sample_row_after(
    logits: &[f32],
    d: &Draw,
    draft: u32,
    scratch: &mut RowScratch,
) -> Result<u32, SamplingError> {
    sample_row_with(logits, d, Some(draft), scratch)
}

/// The token whose running weight first exceeds `u` among `kept` (id,
/// weight) pairs in id order, with `draft` (id, weight) walked first.
fn walk(
    mut u: u64,
    draft: Option<(u32, u64)>,
    kept: impl Iterator<Item = (u32, u64)>,
) -> Option<u32> {
    let skip = match draft {
        Some((id, w)) if u < w => return Some(id),
        Some((id, w)) => {
            u -= w;
            Some(id)
        }
        None => None,
    };
    let mut acc = 0u64;
    for (id, w) in kept.filter(|&(id, _)| Some(id) != skip) {
        acc += w;
        if acc > u {
            return Some(id);
        }
    }
    None
}

fn sample_row_with(
    logits: &[f32],
    d: &Draw,
    draft: Option<u32>,
    scratch: &mut RowScratch,
) -> Result<u32, SamplingError> {
    if d.is_greedy() {
        return argmax(logits);
    }
    check_finite(logits)?;
    let n = logits.len();
    if n > MAX_VOCAB {
        return Err(SamplingError::VocabularyTooLarge {
            vocab: n,
            max: MAX_VOCAB,
        });
    }
    let scale = log2e_over(d.temperature());
    let RowScratch { keys, weights } = scratch;
    match d.top_k() {
        // Top-k: only the k best weigh anything; walk them in id order.
        Some(k) if k < n => {
            keys.clear();
            keys.extend(logits.iter().enumerate().map(|(i, &l)| key(l, i)));
            keys.select_nth_unstable_by(k - 1, |a, b| b.cmp(a));
            keys.truncate(k);
            let top = keys.iter().copied().max().unwrap_or(0);
            let max = logits[key_id(top)];
            let w = |k: u64| weight_scaled(logits[key_id(k)], max, scale);
            let total: u64 = keys.iter().map(|&k| w(k)).sum();
            let (floor, kept) = if d.top_p() < 1.0 {
                nucleus(keys, nucleus_need(d.top_p(), total), w)
            } else {
                (0, total)
            };
            let u = draw_point(d.random(), kept);
            keys.sort_unstable_by_key(|&k| key_id(k));
            let kept_weight = |id: u32| {
                let k = key(*logits.get(id as usize)?, id as usize);
                (k >= floor
                    && keys
                        .binary_search_by_key(&(id as usize), |&k| key_id(k))
                        .is_ok())
                .then(|| (id, w(k)))
            };
            let draft = draft.map(|x| kept_weight(x).unwrap_or((x, 0)));
            let kept = keys
                .iter()
                .filter(|&&k| k >= floor)
                .map(|&k| (key_id(k) as u32, w(k)));
            // Unreachable fallback: the kept weights sum to `kept > u`.
            Ok(walk(u, draft, kept).unwrap_or(key_id(top) as u32))
        }
        // Every token weighs: one pass over the row computes them all.
        _ => {
            let top = argmax(logits)?;
            let max = logits[top as usize];
            super::simd::weights_into(logits, max, scale, weights);
            let total: u64 = weights.iter().sum();
            let (floor, kept) = if d.top_p() < 1.0 {
                heavy_nucleus(logits, weights, keys, nucleus_need(d.top_p(), total))
            } else {
                (0, total)
            };
            let u = draw_point(d.random(), kept);
            let draft = draft.map(|x| {
                let i = x as usize;
                match (logits.get(i), weights.get(i)) {
                    (Some(&l), Some(&w)) if key(l, i) >= floor => (x, w),
                    _ => (x, 0),
                }
            });
            let kept = logits
                .iter()
                .zip(weights.iter())
                .enumerate()
                .filter(|&(i, (&l, _))| key(l, i) >= floor)
                .map(|(i, (_, &w))| (i as u32, w));
            // Unreachable fallback: the kept weights sum to `kept > u`.
            Ok(walk(u, draft, kept).unwrap_or(top))
        }
    }
}

/// Top-p over a whole row whose `weights` are computed: the same answer as
/// [`nucleus`] over every key, without ranking the vocabulary. Weights
/// never rise as keys fall, so the tokens weighing at least `floor` are a
/// prefix in rank order; when they alone reach `need`, the nucleus ends
/// among them, and only they are ranked. The floor starts at 1/64 of the
/// top token's weight (a model's distribution usually puts its mass
/// there: one pass over the weights and a short sort) and falls 16-fold
/// while the mass falls short, to 0 (every token).
fn heavy_nucleus(logits: &[f32], weights: &[u64], cand: &mut Vec<u64>, need: u64) -> (u64, u64) {
    let mut floor = (1u64 << WEIGHT_BITS) >> 6;
    loop {
        cand.clear();
        let mut mass = 0u64;
        for (i, (&l, &w)) in logits.iter().zip(weights).enumerate() {
            if w >= floor {
                cand.push(key(l, i));
                mass += w;
            }
        }
        if mass >= need || floor == 0 {
            return nucleus(cand, need, |k| weights[key_id(k)]);
        }
        floor >>= 4;
    }
}

/// Top-p over the keys in `cand`: the key that ends the shortest prefix, in
/// rank order, whose weight reaches `need`, and that prefix's weight.
///
/// Sorting a whole vocabulary per token cost ~4 ms at 128k entries. A
/// model's distribution puts its mass on few tokens, so this selects and
/// sorts the top 64 first, then the next best of the rest (4x as many in all
/// each round) while the weight falls short: the same prefix as a full
/// sort, usually for one selection pass and a short sort.
fn nucleus(cand: &mut [u64], need: u64, w: impl Fn(u64) -> u64) -> (u64, u64) {
    let n = cand.len();
    let (mut done, mut acc) = (0, 0u64);
    let mut k = n.min(64);
    loop {
        if k < n {
            cand[done..].select_nth_unstable_by(k - done - 1, |a, b| b.cmp(a));
        }
        cand[done..k].sort_unstable_by(|a, b| b.cmp(a));
        for &c in &cand[done..k] {
            acc += w(c);
            if acc >= need {
                return (c, acc);
            }
        }
        if k == n {
            // Unreachable: `need <= total`. Keep everything.
            return (cand.last().copied().unwrap_or(0), acc);
        }
        done = k;
        k = n.min(k * 4);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_rank_higher_logits_then_lower_ids_first() {
        let l = [-1.0f32, 2.0, 2.0, -0.0, 0.0, f32::MAX, -f32::MAX, 1e-30];
        let mut ids: Vec<usize> = (0..l.len()).collect();
        ids.sort_by(|&a, &b| key(l[b], b).cmp(&key(l[a], a)));
        assert_eq!(ids, [5, 1, 2, 7, 4, 3, 0, 6]);
        for (i, &x) in l.iter().enumerate() {
            assert_eq!(key_id(key(x, i)), i);
        }
    }

    #[test]
    fn weights_follow_exp_in_fixed_point() {
        let one = 1u64 << WEIGHT_BITS;
        assert_eq!(weight(3.0, 3.0, 0.7), one);
        assert_eq!(weight(-1e30, 1e30, 1.0), 0);
        assert_eq!(weight(0.0, 1.0, 1e-45), 0);
        for (l, m, t) in [
            (0.0f32, 1.0f32, 1.0f32),
            (-3.5, 2.0, 0.7),
            (-20.0, 0.0, 1.0),
            (5.0, 5.5, 3.0),
        ] {
            let want = (((l as f64 - m as f64) / t as f64).exp() * one as f64).floor();
            let got = weight(l, m, t) as f64;
            assert!((got - want).abs() <= want * 1e-11 + 1.0, "{l} {m} {t}");
        }
        // Just above the cutoff (2^-40 of the top) still weighs something.
        assert!(weight(-27.0, 0.0, 1.0) > 0);
        assert_eq!(weight(-29.0, 0.0, 1.0), 0);
    }

    #[test]
    fn a_draw_on_a_boundary_takes_the_next_token() {
        let params = crate::SamplingParams {
            temperature: 1.0,
            ..crate::SamplingParams::greedy()
        };
        let mut scratch = RowScratch::default();
        let at = |r: u64, scratch: &mut RowScratch| {
            sample_row(&[1.0, 1.0], &Draw::new(&params, r).unwrap(), scratch).unwrap()
        };
        // Two tokens of 2^40 each: r = 2^63 draws u = 2^40, token 0's end.
        assert_eq!(at(1 << 63, &mut scratch), 1);
        assert_eq!(at((1 << 63) - (1 << 11), &mut scratch), 0);
        assert_eq!(at(u64::MAX, &mut scratch), 1);
        assert_eq!(at(0, &mut scratch), 0);
    }

    #[test]
    fn the_draw_point_spans_the_kept_weight() {
        assert_eq!(draw_point(0, 1000), 0);
        assert_eq!(draw_point(u64::MAX, 1000), 999);
        assert_eq!(draw_point(1 << 63, 1000), 500);
        assert_eq!(nucleus_need(0.5, 1001), 501);
        assert_eq!(nucleus_need(1e-30, 1001), 1);
        assert_eq!(nucleus_need(0.999_999_94, 3), 3);
    }
}
