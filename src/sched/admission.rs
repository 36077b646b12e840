use crate::config::{EngineConfig, RoleKind};
use crate::request::Request;
use crate::sampling::{Sampler, SamplingError};
use crate::sched::Rejection;

/// The limits admission checks a request against. Normally derived from a
/// validated [`EngineConfig`]; tests that need a deployment the config would
/// refuse may build one directly, and admission still protects the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdmissionLimits {
    max_context: usize,
    pool_pages: usize,
    page_size: usize,
    vocab_size: Option<usize>,
    max_queue: usize,
}

impl AdmissionLimits {
    /// Limits for a pool of `pool_pages` pages of `page_size` tokens.
    pub fn new(max_context: usize, pool_pages: usize, page_size: usize) -> Self {
        AdmissionLimits {
            max_context,
            pool_pages,
            page_size: page_size.max(1),
            vocab_size: None,
            max_queue: crate::config::DEFAULT_MAX_QUEUE,
        }
    }
    /// Limits of a validated configuration.
    pub fn from_config<R: RoleKind>(cfg: &EngineConfig<R>) -> Self {
        Self::new(cfg.max_context(), cfg.pool_pages(), cfg.page_size()).max_queue(cfg.max_queue())
    }
    /// These limits bounded by the pool they admit into: its page size,
    /// and no more token slots than it has. Limits written for a larger
    /// pool would admit requests that then wait for pages forever.
    #[must_use]
    pub fn within_pool(mut self, pool_pages: usize, page_size: usize) -> Self {
        let page_size = page_size.max(1);
        let tokens = self.pool_tokens().min(pool_pages.saturating_mul(page_size));
        self.page_size = page_size;
        self.pool_pages = tokens / page_size;
        self
    }
    /// Rejects token ids `>= vocab`.
    #[must_use]
    pub fn vocab(mut self, vocab: usize) -> Self {
        self.vocab_size = Some(vocab);
        self
    }
    /// Waiting requests beyond this are refused with 429 (at least 1: a
    /// queue of 0 would refuse every request for ever).
    #[must_use]
    pub fn max_queue(mut self, n: usize) -> Self {
        self.max_queue = n.max(1);
        self
    }
    pub fn max_context(&self) -> usize {
        self.max_context
    }
    pub fn pool_tokens(&self) -> usize {
        self.pool_pages.saturating_mul(self.page_size)
    }
    pub fn page_size(&self) -> usize {
        self.page_size
    }
    pub fn queue_limit(&self) -> usize {
        self.max_queue
    }
    pub fn vocab_size(&self) -> Option<usize> {
        self.vocab_size
    }

    /// Checks a request that could ever be served here. Pure: looks at
    /// nothing but the request and the limits, allocates nothing.
    pub fn check(&self, req: &Request) -> Result<(), Rejection> {
        let id = req.id;
        let prompt = req.prompt.len();
        if prompt == 0 {
            return Err(Rejection::EmptyPrompt { id });
        }
        if req.max_new_tokens == 0 {
            return Err(Rejection::ZeroMaxNewTokens { id });
        }
        // Pool first: a prompt the pool can never hold is the incident's
        // failure and must be named as such even if the window is larger.
        let pool_tokens = self.pool_tokens();
        if prompt > pool_tokens {
            return Err(Rejection::ExceedsPool {
                id,
                tokens: prompt,
                pool_tokens,
            });
        }
        if prompt > self.max_context {
            return Err(Rejection::PromptTooLong {
                id,
                prompt,
                max_context: self.max_context,
            });
        }
        if req.max_total_tokens() > self.max_context {
            return Err(Rejection::ExceedsWindow {
                id,
                prompt,
                max_new: req.max_new_tokens,
                max_context: self.max_context,
            });
        }
        let total = req.max_total_tokens();
        if crate::kv::pages_for(total, self.page_size) > self.pool_pages {
            return Err(Rejection::ExceedsPool {
                id,
                tokens: total,
                pool_tokens,
            });
        }
        if let Some(vocab) = self.vocab_size
            && let Some((index, &token)) = req
                .prompt
                .iter()
                .enumerate()
                .find(|&(_, &t)| t as usize >= vocab)
        {
            return Err(Rejection::InvalidToken {
                id,
                index,
                token,
                vocab,
            });
        }
        if let Err(reason) = req.sampling.validate() {
            return Err(Rejection::InvalidSampling { id, reason });
        }
        Ok(())
    }
}

/// The sampler for an admitted request, or its typed rejection
/// ([`Rejection::InvalidSampling`], 400) when the parameters are unusable:
/// the same check as [`AdmissionLimits::check`], so a request that passed
/// admission always gets its sampler.
pub fn sampler_for(req: &Request) -> Result<Sampler, Rejection> {
    if let Some(spec) = &req.speculative {
        spec.validate()
            .map_err(|reason| Rejection::InvalidSampling { id: req.id, reason })?;
    }
    Sampler::new(&req.sampling).map_err(|e| Rejection::InvalidSampling {
        id: req.id,
        reason: match e {
            SamplingError::InvalidParams(r) => r,
            _ => "invalid sampling parameters",
        },
    })
}
