//! Token choice on the device: greedy argmax, and sampling by each row's
//! draw with the log-probabilities asked for.

use cudarc::driver::DevicePtr;

use crate::backend::cuda::kernels;
use crate::backend::cuda::params::{ArgmaxParams, LogprobParams, SampleDraw, SampleParams};
use crate::backend::cuda::plan::to_u32;
use crate::backend::cuda::table::LOGPROB_STRIDE;
use crate::backend::cuda::{CudaDevice, CudaError};
use crate::sampling::{Draw, MAX_TOP_LOGPROBS, MAX_VOCAB, SamplingError, TokenLogprobs};

impl CudaDevice {
    /// Greedy argmax of each row of `logits` `[n_rows, vocab]` (lowest index
    /// on ties). A row holding any NaN fails with [`CudaError::NanLogits`]:
    /// poisoned or corrupt data never becomes a token.
    pub fn argmax(
        &self,
        logits: &impl DevicePtr<f32>,
        vocab: usize,
    ) -> Result<Vec<u32>, CudaError> {
        if vocab == 0 || !logits.len().is_multiple_of(vocab) || logits.is_empty() {
            return Err(CudaError::Shape {
                what: "logits (a non-empty multiple of vocab)",
                expected: vocab,
                got: logits.len(),
            });
        }
        let n_rows = logits.len() / vocab;
        let mut idx = self.zeros::<u32>(n_rows)?;
        let mut nans = self.zeros::<u32>(n_rows)?;
        let (n_rows, vocab) = (to_u32("logit rows", n_rows)?, to_u32("vocab", vocab)?);
        let (out_index, out_nans) = (&mut idx, &mut nans);
        // Launch contract: logits hold n_rows*vocab f32, idx and nans n_rows
        // u32 each; one block of exactly 256 threads per row (the kernel's
        // shared arrays).
        self.launch_bound(kernels::argmax(), (n_rows, 1, 1), move |a| ArgmaxParams {
            logits: a.read(logits),
            out_index: a.write(out_index),
            out_nans: a.write(out_nans),
            n_rows,
            vocab,
        })?;
        let nans = self.download(&nans)?;
        if let Some((row, &n)) = nans.iter().enumerate().find(|(_, n)| **n > 0) {
            return Err(CudaError::NanLogits { row, nans: n });
        }
        self.download(&idx)
    }

    /// One token per row of `logits` `[draws.len(), vocab]`, each by its
    /// draw and [`crate::sampling::sample_row`]'s rule, bit for bit, and,
    /// when any draw asks ([`Draw::logprobs`]), each asking row's
    /// log-probabilities ([`crate::sampling::token_logprobs`]: the same
    /// ids, values within about an f32 ulp; `None` for the other rows, and
    /// an empty list when none asks). Only the token ids (or, for a row
    /// holding a non-finite logit, that logit) and the log-probabilities
    /// asked for come back to the host, in one download: one sync.
    #[allow(clippy::type_complexity)]
    pub fn sample_rows(
        &self,
        logits: &impl DevicePtr<f32>,
        vocab: usize,
        draws: &[Draw],
    ) -> Result<(Vec<Result<u32, SamplingError>>, Vec<Option<TokenLogprobs>>), CudaError> {
        if vocab == 0 || logits.len() != draws.len().saturating_mul(vocab) || draws.is_empty() {
            return Err(CudaError::Shape {
                what: "logits ([draws, vocab], at least one row)",
                expected: draws.len().saturating_mul(vocab.max(1)),
                got: logits.len(),
            });
        }
        if vocab > MAX_VOCAB {
            let e = SamplingError::VocabularyTooLarge {
                vocab,
                max: MAX_VOCAB,
            };
            return Ok((vec![Err(e); draws.len()], Vec::new()));
        }
        let asked = draws.iter().any(|d| d.logprobs().is_some());
        let host: Vec<SampleDraw> = draws
            .iter()
            .map(|d| SampleDraw {
                temperature: d.temperature(),
                top_k: d
                    .top_k()
                    .map_or(0, |k| u32::try_from(k).unwrap_or(u32::MAX)),
                top_p: d.top_p(),
                logprobs: d
                    .logprobs()
                    .map_or(0, |n| 1 + u32::from(n.min(MAX_TOP_LOGPROBS))),
                random: d.random(),
            })
            .collect();
        let n = draws.len();
        let dev_draws = self.upload(&host)?;
        let mut out = self.zeros::<u32>(2 * n + if asked { n * LOGPROB_STRIDE } else { 0 })?;
        let (n_rows, vocab32) = (to_u32("sampled rows", n)?, to_u32("vocab", vocab)?);
        let (dev_draws, dev_out) = (&dev_draws, &mut out);
        // Launch contract: logits hold n_rows*vocab f32 (checked), vocab is
        // within MAX_VOCAB (checked: the weights' sums fit u64), draws hold
        // n_rows entries and out at least 2 * n_rows; one block of exactly
        // SAMPLE_THREADS threads per row (its shared arrays).
        self.launch_bound(kernels::sample_rows(), (n_rows, 1, 1), |a| SampleParams {
            logits: a.read(logits),
            draws: a.read(dev_draws),
            out: a.write(dev_out),
            n_rows,
            vocab: vocab32,
        })?;
        if asked {
            // Launch contract: as sample_rows, queued after it on the same
            // stream (it reads the tokens and statuses sample_rows wrote),
            // and out holds 2 * n_rows + n_rows * LOGPROB_STRIDE words.
            self.launch_bound(kernels::row_logprobs(), (n_rows, 1, 1), |a| LogprobParams {
                logits: a.read(logits),
                draws: a.read(dev_draws),
                out: a.write(dev_out),
                n_rows,
                vocab: vocab32,
            })?;
        }
        // The step's one wait for the device: tokens, statuses and the
        // log-probabilities asked for, together.
        let out = self.download(&out)?;
        let (token, rest) = out.split_at(n);
        let (status, lps) = rest.split_at(n);
        let tokens: Vec<Result<u32, SamplingError>> = token
            .iter()
            .zip(status)
            .map(|(&t, &s)| match s {
                0 => Ok(t),
                s => Err(SamplingError::NonFinite {
                    index: s as usize - 1,
                    value: f32::from_bits(t),
                }),
            })
            .collect();
        let logprobs = if asked {
            draws
                .iter()
                .zip(&tokens)
                .zip(lps.chunks_exact(LOGPROB_STRIDE))
                .map(|((d, t), w)| {
                    let (top, &Ok(token)) = (d.logprobs()?, t) else {
                        return None;
                    };
                    let top = usize::from(top.min(MAX_TOP_LOGPROBS)).min(vocab);
                    Some(TokenLogprobs {
                        token,
                        logprob: f32::from_bits(w[0]),
                        top: w[1..1 + 2 * top]
                            .chunks_exact(2)
                            .map(|p| (p[0], f32::from_bits(p[1])))
                            .collect(),
                    })
                })
                .collect()
        } else {
            Vec::new()
        };
        Ok((tokens, logprobs))
    }
}
