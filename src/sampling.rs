//! Choosing the next token from logits: greedy, temperature, top-k, top-p,
//! each request with its own seeded random stream.
//!
//! A [`Sampler`] belongs to one request and lives as long as it does (also
//! across a preemption and recompute), so the same seed gives the same
//! output whatever else the engine is serving.

use crate::http::HttpStatus;
use crate::request::SamplingParams;
use crate::rng::SplitMix64;

/// Why no token could be chosen. The request fails; nothing is emitted.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SamplingError {
    #[error("no logits to sample from: the model's vocabulary is empty")]
    Empty,
    #[error(
        "logit {index} is {value}: the forward pass produced a non-finite value; the request failed, check the model's weights"
    )]
    NonFinite { index: usize, value: f32 },
    #[error("invalid sampling parameters: {0}")]
    InvalidParams(&'static str),
}

impl HttpStatus for SamplingError {
    fn http_status(&self) -> u16 {
        match self {
            SamplingError::InvalidParams(_) => 400,
            _ => 500,
        }
    }
}

/// The index of the largest logit (the first on ties).
///
/// Passes the compiler vectorises (the running maximum of eight lanes, then
/// the first chunk of eight holding it) instead of one loop whose every
/// step depends on the last: ~500 -> ~120 ns over a 512-entry vocabulary
/// here, and the same index as the plain loop (tested, ties and signed
/// zeros included).
pub fn argmax(logits: &[f32]) -> Result<u32, SamplingError> {
    check_finite(logits)?;
    let mut lanes = [f32::NEG_INFINITY; 8];
    let mut chunks = logits.chunks_exact(8);
    for c in &mut chunks {
        for (m, &x) in lanes.iter_mut().zip(c) {
            *m = if x > *m { x } else { *m };
        }
    }
    let tail = chunks.remainder().iter();
    let max = lanes
        .iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
    // Every logit is finite, so the maximum is one of them: find its first
    // chunk of eight without branching per element, then its place there.
    let chunk = logits
        .chunks(8)
        .position(|c| c.iter().fold(false, |hit, &x| hit | (x == max)))
        .unwrap_or(0);
    let at = logits[chunk * 8..]
        .iter()
        .position(|&x| x == max)
        .unwrap_or(0);
    Ok((chunk * 8 + at) as u32)
}

fn check_finite(logits: &[f32]) -> Result<(), SamplingError> {
    if logits.is_empty() {
        return Err(SamplingError::Empty);
    }
    // Branch-free first (vectorised); the position only when one is bad.
    if logits.iter().fold(true, |ok, x| ok & x.is_finite()) {
        return Ok(());
    }
    match logits.iter().position(|x| !x.is_finite()) {
        Some(index) => Err(SamplingError::NonFinite {
            index,
            value: logits[index],
        }),
        None => Ok(()),
    }
}

/// One request's token chooser.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: SplitMix64,
    /// Candidate (logit, token) pairs, reused across tokens.
    cand: Vec<(f32, u32)>,
}

impl Sampler {
    /// A sampler for `params`, its stream seeded by `params.seed`.
    pub fn new(params: &SamplingParams) -> Result<Self, SamplingError> {
        params.validate().map_err(SamplingError::InvalidParams)?;
        Ok(Sampler {
            params: params.clone(),
            rng: SplitMix64::new(params.seed),
            cand: Vec::new(),
        })
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// True when `token` ends generation.
    pub fn is_stop(&self, token: u32) -> bool {
        self.params.stop_ids.contains(&token)
    }

    /// Chooses the next token.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32, SamplingError> {
        if self.params.is_greedy() {
            return argmax(logits);
        }
        check_finite(logits)?;
        let t = self.params.temperature;
        let cand = &mut self.cand;
        cand.clear();
        cand.extend(logits.iter().enumerate().map(|(i, &l)| (l, i as u32)));
        if let Some(k) = self.params.top_k.filter(|&k| k < cand.len()) {
            cand.select_nth_unstable_by(k - 1, order);
            cand.truncate(k);
        }
        let max = cand.iter().map(|c| c.0).fold(f32::NEG_INFINITY, f32::max);
        let weight = |logit: f32| ((logit - max) / t).exp();
        if let Some(p) = self.params.top_p.filter(|&p| p < 1.0) {
            let keep = nucleus(cand, p as f64, weight);
            cand.truncate(keep);
        }
        let mut total = 0f64;
        for c in cand.iter_mut() {
            c.0 = weight(c.0);
            total += c.0 as f64;
        }
        let u = self.rng.next_f64() * total;
        let mut acc = 0f64;
        for c in cand.iter() {
            acc += c.0 as f64;
            if u < acc {
                return Ok(c.1);
            }
        }
        // Rounding left u at the very top: the last candidate.
        cand.last().map(|c| c.1).ok_or(SamplingError::Empty)
    }
}

/// Highest logit first; lower token id first among equals.
fn order(a: &(f32, u32), b: &(f32, u32)) -> std::cmp::Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// Top-p: puts the smallest prefix (in [`order`]) of `cand` whose share of
/// the total weight reaches `p` first, sorted, and returns its length.
///
/// Sorting a whole vocabulary per token cost ~4 ms at 128k entries, most
/// of a step's serial time in a batch. A model's distribution puts its
/// mass on few tokens, so this selects and sorts the top 64 first, then
/// the next best of the rest (4x as many in all each round) while the mass
/// falls short: the same prefix as a full sort, usually for one selection
/// pass over the vocabulary and a short sort, and never much more work than
/// the full sort (each round selects from and sorts only what is left).
fn nucleus(cand: &mut [(f32, u32)], p: f64, weight: impl Fn(f32) -> f32) -> usize {
    let total: f64 = cand.iter().map(|c| weight(c.0) as f64).sum();
    let n = cand.len();
    // `cand[..done]` is the best `done`, sorted, and holds less than `p`.
    let (mut done, mut acc) = (0, 0f64);
    let mut k = n.min(64);
    loop {
        if k < n {
            cand[done..].select_nth_unstable_by(k - done - 1, order);
        }
        cand[done..k].sort_unstable_by(order);
        for (i, c) in cand[done..k].iter().enumerate() {
            acc += weight(c.0) as f64 / total;
            if acc >= p {
                return done + i + 1;
            }
        }
        if k == n {
            return n;
        }
        done = k;
        k = n.min(k * 4);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_is_the_first_largest_logit_as_a_plain_loop_finds_it() {
        fn plain(l: &[f32]) -> u32 {
            let mut best = 0;
            for (i, &x) in l.iter().enumerate() {
                if x > l[best] {
                    best = i;
                }
            }
            best as u32
        }
        let mut rng = SplitMix64::new(7);
        for len in [1usize, 2, 7, 8, 9, 31, 64, 512, 1003] {
            for round in 0..50 {
                // Few distinct values, so ties are common; signed zeros too.
                let l: Vec<f32> = (0..len)
                    .map(|_| match rng.next_u64() % 6 {
                        0 => 0.0,
                        1 => -0.0,
                        2 => -1.5,
                        3 if round % 2 == 0 => 2.25,
                        _ => (rng.next_u64() % 5) as f32 - 3.0,
                    })
                    .collect();
                assert_eq!(argmax(&l), Ok(plain(&l)), "{l:?}");
            }
        }
        assert_eq!(argmax(&[]), Err(SamplingError::Empty));
        assert!(matches!(
            argmax(&[1.0, f32::NAN, f32::INFINITY]),
            Err(SamplingError::NonFinite { index: 1, .. })
        ));
    }

    fn params(t: f32, k: Option<usize>, p: Option<f32>, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature: t,
            top_k: k,
            top_p: p,
            seed,
            stop_ids: vec![],
        }
    }

    fn draw(p: &SamplingParams, logits: &[f32], n: usize) -> Vec<u32> {
        let mut s = Sampler::new(p).unwrap();
        (0..n).map(|_| s.sample(logits).unwrap()).collect()
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        assert_eq!(argmax(&[0.0, 3.0, 3.0, -1.0]).unwrap(), 1);
        let mut s = Sampler::new(&SamplingParams::greedy()).unwrap();
        assert_eq!(s.sample(&[0.0, 1.0, 5.0]).unwrap(), 2);
    }

    #[test]
    fn non_finite_logits_are_an_error_not_a_token() {
        assert!(matches!(
            argmax(&[0.0, f32::NAN]),
            Err(SamplingError::NonFinite { index: 1, .. })
        ));
        let mut s = Sampler::new(&params(1.0, None, None, 1)).unwrap();
        assert!(s.sample(&[f32::INFINITY]).is_err());
        assert!(s.sample(&[]).is_err());
    }

    #[test]
    fn same_seed_same_tokens_different_seed_different_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let a = draw(&params(1.0, None, None, 42), &logits, 64);
        assert_eq!(a, draw(&params(1.0, None, None, 42), &logits, 64));
        assert_ne!(a, draw(&params(1.0, None, None, 43), &logits, 64));
    }

    #[test]
    fn top_k_and_top_p_restrict_the_candidates() {
        let logits = [5.0, 4.9, 4.8, 0.0, -1.0, 4.7];
        let k2 = draw(&params(10.0, Some(2), None, 3), &logits, 300);
        assert!(k2.iter().all(|&t| t == 0 || t == 1));
        assert!(k2.contains(&0) && k2.contains(&1));
        // Probabilities ~[.33,.30,.27,0,0,.1] at t=1 for logits shifted; p=0.5
        // keeps the two most likely.
        let p = draw(&params(1.0, None, Some(0.5), 4), &logits, 300);
        assert!(p.iter().all(|&t| t == 0 || t == 1), "{p:?}");
        // Top-p of 1.0 and no top-k can pick anything with mass.
        let all = draw(&params(1.0, None, None, 5), &logits, 2000);
        assert!(all.contains(&5));
    }

    /// Top-p by a full sort of the candidates (the sampler's semantics
    /// written the plain way): the same tokens as the sampler, draw for
    /// draw, whatever the vocabulary, ties and parameters.
    fn full_sort_draws(p: &SamplingParams, logits: &[f32], n: usize) -> Vec<u32> {
        let mut rng = SplitMix64::new(p.seed);
        (0..n)
            .map(|_| {
                let mut cand: Vec<(f32, u32)> = logits
                    .iter()
                    .enumerate()
                    .map(|(i, &l)| (l, i as u32))
                    .collect();
                if let Some(k) = p.top_k.filter(|&k| k < cand.len()) {
                    cand.select_nth_unstable_by(k - 1, order);
                    cand.truncate(k);
                }
                let max = cand.iter().map(|c| c.0).fold(f32::NEG_INFINITY, f32::max);
                let w = |l: f32| ((l - max) / p.temperature).exp();
                let total: f64 = cand.iter().map(|c| w(c.0) as f64).sum();
                if let Some(top_p) = p.top_p.filter(|&x| x < 1.0) {
                    cand.sort_by(order);
                    let mut acc = 0f64;
                    let mut keep = cand.len();
                    for (i, c) in cand.iter().enumerate() {
                        acc += w(c.0) as f64 / total;
                        if acc >= top_p as f64 {
                            keep = i + 1;
                            break;
                        }
                    }
                    cand.truncate(keep);
                }
                let weights: Vec<f64> = cand.iter().map(|c| w(c.0) as f64).collect();
                let kept: f64 = weights.iter().sum();
                let u = rng.next_f64() * kept;
                let mut acc = 0f64;
                for (c, wt) in cand.iter().zip(&weights) {
                    acc += wt;
                    if u < acc {
                        return c.1;
                    }
                }
                cand.last().unwrap().1
            })
            .collect()
    }

    #[test]
    fn top_p_picks_what_a_full_sort_picks_at_every_vocabulary_size() {
        let mut rng = SplitMix64::new(2026);
        for vocab in [1usize, 2, 7, 63, 64, 65, 300, 1000, 5000, 32_000] {
            for case in 0..6u64 {
                // Peaked, flat, and tied distributions.
                let logits: Vec<f32> = (0..vocab)
                    .map(|i| match case % 3 {
                        0 => (rng.next_f64() * 12.0) as f32 - (i % 97) as f32 * 0.05,
                        1 => (rng.next_f64() * 0.01) as f32,
                        _ => (rng.next_u64() % 4) as f32,
                    })
                    .collect();
                for (t, k, top_p) in [
                    (1.0, None, 0.9),
                    (0.7, None, 0.5),
                    (1.3, Some(40), 0.95),
                    (1.0, None, 0.999),
                    (2.0, Some(3), 0.2),
                ] {
                    let prm = params(t, k, Some(top_p), case * 31 + vocab as u64);
                    assert_eq!(
                        draw(&prm, &logits, 40),
                        full_sort_draws(&prm, &logits, 40),
                        "vocab {vocab}, case {case}, t {t}, top_k {k:?}, top_p {top_p}"
                    );
                }
            }
        }
    }

    #[test]
    fn top_p_at_the_extremes_draws_what_a_full_sort_draws_and_never_panics() {
        let mut rng = SplitMix64::new(77);
        let temps = [1e-45f32, 1e-30, 1e-3, 1.0, 1e3, 1e30, f32::MAX];
        let ps = [1e-7f32, 0.5, 0.999_999_9, 0.999_999_94];
        for vocab in [1usize, 2, 3, 63, 64, 65, 255, 256, 257, 1025, 4097] {
            let shapes: [Box<dyn Fn(usize) -> f32>; 4] = [
                Box::new(|_| 0.25),
                Box::new(|i| if i % 5 == 0 { f32::MAX } else { -f32::MAX }),
                Box::new(|i| (i as f32) * 1e-30),
                Box::new(|i| ((i * 2_654_435_761) % 1000) as f32 * 0.01),
            ];
            for (s, shape) in shapes.iter().enumerate() {
                let logits: Vec<f32> = (0..vocab).map(shape).collect();
                for &t in &temps {
                    for &tp in &ps {
                        for k in [None, Some(1), Some(64), Some(65), Some(vocab)] {
                            let prm = params(t, k, Some(tp), rng.next_u64());
                            let got = draw(&prm, &logits, 8);
                            assert_eq!(
                                got,
                                full_sort_draws(&prm, &logits, 8),
                                "vocab {vocab} shape {s} t {t} p {tp} k {k:?}"
                            );
                            assert!(got.iter().all(|&x| (x as usize) < vocab));
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn frequencies_follow_the_softmax() {
        let logits = [0.0f32, (3.0f32).ln()];
        let n = 20_000;
        let ones = draw(&params(1.0, None, None, 9), &logits, n)
            .iter()
            .filter(|&&t| t == 1)
            .count();
        let frac = ones as f64 / n as f64;
        assert!((frac - 0.75).abs() < 0.02, "{frac}");
    }

    #[test]
    fn invalid_params_are_refused() {
        assert!(Sampler::new(&params(-1.0, None, None, 0)).is_err());
        assert!(Sampler::new(&params(1.0, Some(0), None, 0)).is_err());
        assert!(Sampler::new(&params(1.0, None, Some(1.5), 0)).is_err());
    }
}
