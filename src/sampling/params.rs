//! What a request asks of its sampler ([`SamplingParams`]), checked before
//! any sampler is built from it.

use crate::sampling::MAX_TOP_LOGPROBS;

/// How the next token is chosen. Greedy when `temperature == 0`.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax); otherwise logits are divided by it.
    pub temperature: f32,
    /// Keep only the `k` most likely tokens (None: all).
    pub top_k: Option<usize>,
    /// Keep the smallest set of tokens whose probability reaches `p`.
    pub top_p: Option<f32>,
    /// Seed of the request's own random stream: same seed, same output.
    pub seed: u64,
    /// Generation stops after emitting any of these.
    pub stop_ids: Vec<u32>,
    /// Report log-probabilities: `Some(n)` streams, after each token, its
    /// log-probability and the `n` most likely tokens' (`n` at most
    /// [`MAX_TOP_LOGPROBS`]; 0: the chosen token's alone) as the engine's
    /// `Event::Logprobs`. They are the model's distribution at temperature
    /// 1, before top-k and top-p. `None` (the default): none, at no cost.
    pub logprobs: Option<u8>,
}

impl SamplingParams {
    /// Checks the parameters a sampler can use: a finite, non-negative
    /// temperature, `top_k >= 1`, `top_p` in (0, 1]. The error names the
    /// parameter at fault (and `logprobs` at most 20).
    pub fn validate(&self) -> Result<(), &'static str> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            Err("temperature must be finite and >= 0")
        } else if self.top_k == Some(0) {
            Err("top_k must be >= 1")
        } else if self.top_p.is_some_and(|p| !(p > 0.0 && p <= 1.0)) {
            Err("top_p must be in (0, 1]")
        } else if self.logprobs.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
            Err("logprobs asks for at most 20 alternatives")
        } else {
            Ok(())
        }
    }

    /// Argmax decoding.
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            seed: 0,
            stop_ids: Vec::new(),
            logprobs: None,
        }
    }

    /// True when sampling is deterministic argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self::greedy()
    }
}
