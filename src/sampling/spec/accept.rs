//! Which drafted tokens a verify pass keeps.

use crate::sampling::{Draw, RowScratch, SamplingError, sample_row, sample_row_after};

/// The tokens a request emits from one verify pass: `rows(i)` are the
/// target's logits after the last accepted token and the first `i`
/// drafts (`drafts.len() + 1` rows), and `draw()` gives the request's next
/// draw (called once per token emitted, so its random stream advances as
/// undrafted sampling's does). Position `i < drafts.len()` chooses by
/// [`sample_row_after`] with `drafts[i]` (greedy: the argmax); a token that
/// differs from the draft is the last one, and when every draft is kept
/// the last row adds the target's own next token ([`sample_row`]). So the
/// result is one to `drafts.len() + 1` tokens, the last possibly an error
/// (nothing after it).
pub fn accept<'l>(
    rows: impl Fn(usize) -> &'l [f32],
    drafts: &[u32],
    mut draw: impl FnMut() -> Draw,
    scratch: &mut RowScratch,
) -> Vec<Result<u32, SamplingError>> {
    let mut out = Vec::with_capacity(drafts.len() + 1);
    for (i, &d) in drafts.iter().enumerate() {
        let t = sample_row_after(rows(i), &draw(), d, scratch);
        let kept = t.as_ref().is_ok_and(|&t| t == d);
        out.push(t);
        if !kept {
            return out;
        }
    }
    out.push(sample_row(rows(drafts.len()), &draw(), scratch));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;
    use crate::sampling::{Sampler, SamplingParams};

    fn sampled(t: f32, top_k: Option<usize>, top_p: Option<f32>, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature: t,
            top_k,
            top_p,
            seed,
            ..SamplingParams::greedy()
        }
    }

    #[test]
    fn greedy_keeps_the_drafts_that_are_the_argmax_and_adds_the_targets_next() {
        let rows = [
            vec![0.0, 5.0, 1.0],
            vec![3.0, 0.0, 1.0],
            vec![0.0, 0.0, 9.0],
        ];
        let greedy = || Draw::greedy();
        let mut s = RowScratch::default();
        // Both drafts right: three tokens.
        let all = accept(|i| &rows[i], &[1, 0], greedy, &mut s);
        assert_eq!(all, [Ok(1), Ok(0), Ok(2)]);
        // The second wrong: the target's token replaces it, nothing after.
        let some = accept(|i| &rows[i], &[1, 2], greedy, &mut s);
        assert_eq!(some, [Ok(1), Ok(0)]);
        // No drafts: one token, the argmax of row 0.
        assert_eq!(accept(|i| &rows[i], &[], greedy, &mut s), [Ok(1)]);
        // A non-finite row is an error, and the last token.
        let bad = [vec![0.0, f32::NAN, 1.0], vec![1.0, 0.0, 0.0]];
        let r = accept(|i| &bad[i], &[2], greedy, &mut s);
        assert_eq!(r.len(), 1);
        assert!(r[0].is_err());
    }

    #[test]
    fn one_draw_is_spent_per_token_emitted() {
        let rows = [
            vec![0.0, 5.0, 1.0],
            vec![3.0, 0.0, 1.0],
            vec![0.0, 0.0, 9.0],
        ];
        let mut sampler = Sampler::new(&sampled(0.01, None, None, 3)).unwrap();
        let mut spent = 0;
        let mut s = RowScratch::default();
        let out = accept(
            |i| &rows[i],
            &[1, 0],
            || {
                spent += 1;
                sampler.next_draw()
            },
            &mut s,
        );
        // At temperature 0.01 the argmax is all but certain.
        assert_eq!(out, [Ok(1), Ok(0), Ok(2)]);
        assert_eq!(spent, out.len());
    }

    /// Pearson's statistic of `counts` against `weights` (expected counts
    /// proportional), over the cells expected at least 5 times.
    fn chi_square(counts: &[u64], probs: &[f64]) -> (f64, usize) {
        let n: u64 = counts.iter().sum();
        let mut stat = 0.0;
        let mut cells = 0;
        for (&c, &p) in counts.iter().zip(probs) {
            let e = p * n as f64;
            if e >= 5.0 {
                stat += (c as f64 - e).powi(2) / e;
                cells += 1;
            }
        }
        (stat, cells)
    }

    /// The rejection rule's token has the sampler's distribution, whatever
    /// was drafted (the argmax, a likely token, an unlikely one, one outside
    /// top-k): its frequencies pass a chi-square test against the kept
    /// weights, at a fixed seed.
    #[test]
    fn the_rejection_rule_draws_the_targets_distribution_whatever_the_draft() {
        let logits = [1.0f32, 2.5, 0.3, 2.0, -1.0, 1.7, 0.0, 2.4];
        let n = 40_000;
        for (t, k, p) in [
            (1.0, None, None),
            (0.8, Some(5), None),
            (1.2, None, Some(0.9)),
        ] {
            let params = sampled(t, k, p, 11);
            // The reference: plain sampling's frequencies.
            let mut plain = vec![0u64; logits.len()];
            let mut sampler = Sampler::new(&params).unwrap();
            for _ in 0..n {
                plain[sampler.sample(&logits).unwrap() as usize] += 1;
            }
            let probs: Vec<f64> = plain.iter().map(|&c| c as f64 / n as f64).collect();
            for draft in [1u32, 3, 4, 6] {
                let mut counts = vec![0u64; logits.len()];
                let mut rng = SplitMix64::new(1000 + u64::from(draft));
                let mut s = RowScratch::default();
                for _ in 0..n {
                    let d = Draw::new(&params, rng.next_u64()).unwrap();
                    let tok = sample_row_after(&logits, &d, draft, &mut s).unwrap();
                    counts[tok as usize] += 1;
                }
                // Tokens plain sampling never drew (outside top-k/top-p)
                // are never drawn here either.
                for (c, pc) in counts.iter().zip(&plain) {
                    assert!(*pc > 0 || *c == 0, "{t} {k:?} {p:?} draft {draft}");
                }
                let (stat, cells) = chi_square(&counts, &probs);
                // Two samples of n each: the statistic against the other's
                // frequencies is about twice a one-sample chi-square's;
                // 2x its 99.9th percentile at 7 degrees of freedom (24.3).
                assert!(
                    stat < 2.0 * 24.3,
                    "t {t} k {k:?} p {p:?} draft {draft}: chi2 {stat} over {cells} cells"
                );
            }
        }
    }

    #[test]
    fn a_draft_is_kept_exactly_when_the_draw_falls_in_its_weight() {
        // Two tokens of equal weight: the draw point's lower half keeps the
        // draft whichever token it is; the upper half gives the other.
        let params = sampled(1.0, None, None, 0);
        let mut s = RowScratch::default();
        for draft in [0u32, 1] {
            let low = Draw::new(&params, 0).unwrap();
            let high = Draw::new(&params, u64::MAX).unwrap();
            assert_eq!(
                sample_row_after(&[1.0, 1.0], &low, draft, &mut s),
                Ok(draft)
            );
            assert_eq!(
                sample_row_after(&[1.0, 1.0], &high, draft, &mut s),
                Ok(1 - draft)
            );
        }
        // A draft outside the vocabulary weighs nothing: never kept.
        let d = Draw::new(&params, 0).unwrap();
        assert_eq!(sample_row_after(&[1.0, 1.0], &d, 7, &mut s), Ok(0));
    }
}
