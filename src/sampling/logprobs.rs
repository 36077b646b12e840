//! Log-probabilities of the chosen token and of the most likely
//! alternatives, for requests that ask (`SamplingParams::logprobs`).
//!
//! They are the model's own distribution, `log_softmax(logits)` at
//! temperature 1 before top-k and top-p (what OpenAI's API and vLLM's
//! default report), whatever the request samples with: a client scores a
//! completion by them. The alternatives are ranked by [`key`] (higher logit
//! first, the lower id among equals), so the list is the same on every
//! backend; the values are f32, computed from an f64 sum of `exp(l - max)`
//! (backends that sum in another order agree to about 1e-6).

use super::row::{key, key_id};

/// The most alternatives a request may ask for (OpenAI's `top_logprobs`
/// limit).
pub const MAX_TOP_LOGPROBS: u8 = 20;

/// One generated token's log-probability and the `n` most likely tokens at
/// its position with theirs (most likely first; the chosen token is among
/// them when it ranks in the top `n`).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    /// The token generated.
    pub token: u32,
    /// `ln p(token)` under the model's distribution (<= 0).
    pub logprob: f32,
    /// The most likely tokens, `(id, ln p)`, highest first.
    pub top: Vec<(u32, f32)>,
}

/// A row's log-normaliser: `max` and `ln Σ exp(l - max)`, each difference
/// taken in f64 (so extreme logits cannot overflow), each exponential to
/// about 1e-12 and the sum in f64 (eight interleaved partial sums, on the
/// CPU's widest vectors: the same bits at every width). `logits` must be
/// non-empty and finite (as a row is once it has been sampled).
pub fn log_normaliser(logits: &[f32]) -> (f32, f64) {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    (max, super::simd::exp_sum(logits, max).ln())
}

/// `ln p(logit)` given a row's [`log_normaliser`], rounded to f32; a value
/// below f32's range reads `f32::MIN` (so every reported value is finite).
pub fn logprob_of(logit: f32, max: f32, ln_sum: f64) -> f32 {
    (((logit as f64 - max as f64) - ln_sum) as f32).max(f32::MIN)
}

/// Logits per block of [`top_ids`]' vectorised pre-check.
const TOP_BLOCK: usize = 64;

/// The `n` highest-ranked token ids of a row by [`key`], highest first.
pub fn top_ids(logits: &[f32], n: usize) -> Vec<u32> {
    let n = n.min(logits.len());
    if n == 0 {
        return Vec::new();
    }
    // Keys ascending in `best`, so the smallest kept key is best[0].
    let mut best: Vec<u64> = Vec::with_capacity(n + 1);
    for (b, block) in logits.chunks(TOP_BLOCK).enumerate() {
        // Once n are kept, a later token enters only with a logit above
        // the smallest kept one (an equal logit at a higher id ranks
        // lower): most blocks are passed over by one vectorised check.
        if best.len() == n {
            let floor = logits[key_id(best[0])];
            if !block.iter().fold(false, |any, &l| any | (l > floor)) {
                continue;
            }
        }
        for (j, &l) in block.iter().enumerate() {
            let k = key(l, b * TOP_BLOCK + j);
            if best.len() == n {
                if k <= best[0] {
                    continue;
                }
                best.remove(0);
            }
            let at = best.partition_point(|&b| b < k);
            best.insert(at, k);
        }
    }
    best.iter().rev().map(|&k| key_id(k) as u32).collect()
}

/// `token`'s log-probability and the `top` most likely tokens' in `logits`
/// (one row, non-empty and finite; `token < logits.len()`).
pub fn token_logprobs(logits: &[f32], token: u32, top: usize) -> TokenLogprobs {
    let (max, ln_sum) = log_normaliser(logits);
    // An id outside the row (a caller's bug) reads NaN, never a value.
    let lp = |id: u32| {
        logprob_of(
            logits.get(id as usize).copied().unwrap_or(f32::NAN),
            max,
            ln_sum,
        )
    };
    TokenLogprobs {
        token,
        logprob: lp(token),
        top: top_ids(logits, top)
            .into_iter()
            .map(|id| (id, lp(id)))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    #[test]
    fn logprobs_are_the_log_softmax_and_sum_to_one() {
        let logits = [1.0f32, 2.0, 3.0, 0.5];
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        let t = token_logprobs(&logits, 1, 4);
        assert!((t.logprob as f64 - (2.0 - z.ln())).abs() < 1e-6);
        assert_eq!(
            t.top.iter().map(|&(id, _)| id).collect::<Vec<_>>(),
            [2, 1, 0, 3]
        );
        let total: f64 = t.top.iter().map(|&(_, lp)| (lp as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
        assert!(t.top.iter().all(|&(_, lp)| lp <= 0.0));
    }

    #[test]
    fn the_top_list_matches_a_full_sort_ties_included() {
        let mut rng = SplitMix64::new(3);
        for len in [1usize, 2, 5, 20, 21, 300, 4099] {
            for n in [0usize, 1, 3, 20] {
                // Few distinct values: ties everywhere.
                let l: Vec<f32> = (0..len)
                    .map(|_| (rng.next_u64() % 7) as f32 - 3.0)
                    .collect();
                let mut want: Vec<u32> = (0..len as u32).collect();
                want.sort_by(|&a, &b| l[b as usize].total_cmp(&l[a as usize]).then(a.cmp(&b)));
                want.truncate(n);
                assert_eq!(top_ids(&l, n), want, "len {len} n {n}");
            }
        }
    }

    #[test]
    fn extreme_logits_give_finite_values() {
        let l = [f32::MAX, -f32::MAX, 0.0];
        let t = token_logprobs(&l, 1, 3);
        assert_eq!(t.logprob, f32::MIN);
        assert_eq!(t.top[0], (0, 0.0));
        assert!(t.top.iter().all(|&(_, x)| x.is_finite()));
    }

    #[test]
    fn a_peaked_row_gives_the_top_token_near_zero_and_the_rest_far_below() {
        let mut l = vec![-10.0f32; 1000];
        l[17] = 30.0;
        let t = token_logprobs(&l, 17, 2);
        assert!(t.logprob > -1e-6 && t.logprob <= 0.0);
        assert_eq!(t.top[0].0, 17);
        assert_eq!(t.top[1].0, 0);
        assert!((t.top[1].1 - (-40.0)).abs() < 1e-3, "{:?}", t.top);
    }
}
