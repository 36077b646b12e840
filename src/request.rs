//! What a client asks for.

use crate::ids::{RequestId, TenantId};
// Defined with the sampler that follows it; re-exported for `request::SamplingParams`.
pub use crate::sampling::SamplingParams;
pub use crate::sampling::spec::SpecConfig;

/// Scheduling priority: higher is served first; FIFO within one priority.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Priority(pub u8);

/// A generation request.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    pub id: RequestId,
    pub tenant: TenantId,
    /// Prompt token ids. Never truncated, never replaced.
    pub prompt: Vec<u32>,
    /// Upper bound on generated tokens (at least 1).
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    pub priority: Priority,
    /// May this request reuse (and add to) its tenant's cached prompt KV?
    /// True by default; a server without a prefix cache ignores it.
    pub prefix_cache: bool,
    /// Draft tokens and verify them in one pass
    /// ([`crate::sampling::spec`]): `None` (the default) takes the
    /// server's default, which is off unless its options set one. Greedy
    /// output is the same token for token; sampled output has the same
    /// distribution, and a seed still fixes it.
    pub speculative: Option<SpecConfig>,
}

impl Request {
    /// A greedy request with default priority.
    pub fn new(id: RequestId, tenant: TenantId, prompt: Vec<u32>, max_new_tokens: usize) -> Self {
        Request {
            id,
            tenant,
            prompt,
            max_new_tokens,
            sampling: SamplingParams::greedy(),
            priority: Priority::default(),
            prefix_cache: true,
            speculative: None,
        }
    }

    /// Sets the sampling parameters.
    #[must_use]
    pub fn with_sampling(mut self, sampling: SamplingParams) -> Self {
        self.sampling = sampling;
        self
    }

    /// Sets the priority.
    #[must_use]
    pub fn with_priority(mut self, priority: Priority) -> Self {
        self.priority = priority;
        self
    }

    /// Opts this request in or out of the prefix cache (on by default):
    /// out, it computes its whole prompt and publishes nothing.
    #[must_use]
    pub fn with_prefix_cache(mut self, on: bool) -> Self {
        self.prefix_cache = on;
        self
    }

    /// Opts this request into speculative decoding with `spec` (checked
    /// at admission).
    #[must_use]
    pub fn with_speculative(mut self, spec: SpecConfig) -> Self {
        self.speculative = Some(spec);
        self
    }

    /// Prompt plus the most tokens it may generate.
    pub fn max_total_tokens(&self) -> usize {
        self.prompt.len().saturating_add(self.max_new_tokens)
    }
}
