//! Choosing the next token from logits: greedy, temperature, top-k, top-p,
//! each request with its own seeded random stream.
//!
//! A [`Sampler`] belongs to one request and lives as long as it does (also
//! across a preemption and recompute), so the same seed gives the same
//! output whatever else the engine is serving. Each token spends one
//! [`Draw`]; the token it picks is defined by [`sample_row`]'s rule, which
//! the CUDA backend's device sampler follows bit for bit (so only token ids
//! cross to the host, and a seed gives the same tokens on either backend
//! for the same logits).

mod logprobs;
mod params;
mod row;
mod simd;
pub mod spec;

pub use logprobs::{
    MAX_TOP_LOGPROBS, TokenLogprobs, log_normaliser, logprob_of, token_logprobs, top_ids,
};

pub use params::SamplingParams;
pub use row::{
    MAX_VOCAB, RowScratch, WEIGHT_BITS, draw_point, key, key_id, log2e_over, nucleus_need,
    sample_row, sample_row_after, weight,
};

use crate::http::HttpStatus;
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
    #[error(
        "the vocabulary has {vocab} tokens, more than the sampler's {max}: sample such a model greedily"
    )]
    VocabularyTooLarge { vocab: usize, max: usize },
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

pub(crate) fn check_finite(logits: &[f32]) -> Result<(), SamplingError> {
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

thread_local! {
    /// [`sample_row`]'s buffers, one set per thread, reused across rows
    /// and steps (a non-greedy row over a large vocabulary needs a few MB).
    static ROW_SCRATCH: std::cell::RefCell<RowScratch> =
        std::cell::RefCell::new(RowScratch::default());
}

/// Runs `f` with this thread's [`RowScratch`].
pub(crate) fn with_row_scratch<R>(f: impl FnOnce(&mut RowScratch) -> R) -> R {
    ROW_SCRATCH.with_borrow_mut(f)
}

/// One row's draw: the parameters a request samples with and, unless it is
/// greedy, the next value of its random stream. Made only from validated
/// parameters ([`Draw::new`], [`Sampler::next_draw`]), so a backend that
/// samples on its device needs no checks of its own.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Draw {
    temperature: f32,
    /// 0: no top-k.
    top_k: u32,
    /// 1.0: no top-p.
    top_p: f32,
    random: u64,
    /// The request's `logprobs` (alternatives asked for), if any.
    logprobs: Option<u8>,
}

impl Draw {
    /// A draw with `params` and the stream value `random`.
    pub fn new(params: &SamplingParams, random: u64) -> Result<Self, SamplingError> {
        params.validate().map_err(SamplingError::InvalidParams)?;
        Ok(Self::of_valid(params, random))
    }

    /// A draw with parameters already validated.
    fn of_valid(params: &SamplingParams, random: u64) -> Self {
        Draw {
            temperature: params.temperature,
            top_k: params
                .top_k
                .map_or(0, |k| u32::try_from(k).unwrap_or(u32::MAX)),
            top_p: params.top_p.unwrap_or(1.0),
            random,
            logprobs: params.logprobs,
        }
    }

    /// Argmax for a greedy request's validated `params`: spends nothing,
    /// keeps what else it asks (log-probabilities).
    pub(crate) fn greedy_for(params: &SamplingParams) -> Self {
        Draw {
            logprobs: params.logprobs,
            ..Draw::greedy()
        }
    }

    /// Argmax, spending nothing.
    pub fn greedy() -> Self {
        Draw {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            random: 0,
            logprobs: None,
        }
    }

    /// True for argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// The temperature (0: greedy).
    pub fn temperature(&self) -> f32 {
        self.temperature
    }

    /// Top-k, if any.
    pub fn top_k(&self) -> Option<usize> {
        (self.top_k > 0).then_some(self.top_k as usize)
    }

    /// Top-p (1.0: all).
    pub fn top_p(&self) -> f32 {
        self.top_p
    }

    /// The stream value this draw spends (unused when greedy).
    pub fn random(&self) -> u64 {
        self.random
    }

    /// The alternatives whose log-probabilities the request asked for
    /// (`None`: none asked, not even the chosen token's).
    pub fn logprobs(&self) -> Option<u8> {
        self.logprobs
    }
}

/// One request's token chooser.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: SplitMix64,
}

impl Sampler {
    /// A sampler for `params`, its stream seeded by `params.seed`.
    pub fn new(params: &SamplingParams) -> Result<Self, SamplingError> {
        params.validate().map_err(SamplingError::InvalidParams)?;
        Ok(Sampler {
            params: params.clone(),
            rng: SplitMix64::new(params.seed),
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

    /// The next token's draw, for a backend that samples where the logits
    /// are ([`sample_row`] on the host): spends one value of the stream
    /// unless greedy.
    pub fn next_draw(&mut self) -> Draw {
        let random = if self.params.is_greedy() {
            0
        } else {
            self.rng.next_u64()
        };
        Draw::of_valid(&self.params, random)
    }

    /// Chooses the next token from `logits` on the host.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32, SamplingError> {
        let d = self.next_draw();
        with_row_scratch(|s| sample_row(logits, &d, s))
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
            logprobs: None,
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

    /// The rule of [`sample_row`] written the plain way (every candidate
    /// sorted, the weights summed in rank order, the draw walked in id
    /// order): the same tokens as the sampler, draw for draw, whatever the
    /// vocabulary, ties and parameters.
    fn full_sort_draws(p: &SamplingParams, logits: &[f32], n: usize) -> Vec<u32> {
        let mut rng = SplitMix64::new(p.seed);
        (0..n)
            .map(|_| {
                let r = rng.next_u64();
                let mut ranked: Vec<usize> = (0..logits.len()).collect();
                ranked.sort_by(|&a, &b| key(logits[b], b).cmp(&key(logits[a], a)));
                if let Some(k) = p.top_k {
                    ranked.truncate(k);
                }
                let max = logits[ranked[0]];
                let w = |i: usize| weight(logits[i], max, p.temperature);
                let total: u64 = ranked.iter().map(|&i| w(i)).sum();
                if let Some(top_p) = p.top_p.filter(|&x| x < 1.0) {
                    let need = nucleus_need(top_p, total);
                    let mut acc = 0;
                    let end = ranked
                        .iter()
                        .position(|&i| {
                            acc += w(i);
                            acc >= need
                        })
                        .unwrap();
                    ranked.truncate(end + 1);
                }
                ranked.sort_unstable();
                let kept: u64 = ranked.iter().map(|&i| w(i)).sum();
                let u = ((r >> 11) as u128 * kept as u128 / (1u128 << 53)) as u64;
                let mut acc = 0;
                *ranked
                    .iter()
                    .find(|&&i| {
                        acc += w(i);
                        acc > u
                    })
                    .unwrap() as u32
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
