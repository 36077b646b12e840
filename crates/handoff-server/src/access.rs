//! One structured log line per API request, when it is answered: its
//! tenant, endpoint, outcome and status, prompt and completion tokens, and
//! how long it took, under the target `access` (`RUST_LOG=access=info`
//! keeps these alone). Never the prompt's text or the completion's. The
//! same call counts the answer in `/metrics`.

use std::time::Duration;

use handoff::TenantId;
use tracing::info;

use crate::metrics::Metrics;

/// What one answered request reports.
#[derive(Clone, Copy, Debug)]
pub struct Answered {
    /// `None` when no key identified one (a 401).
    pub tenant: Option<TenantId>,
    pub endpoint: &'static str,
    pub outcome: &'static str,
    pub status: u16,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub elapsed: Duration,
}

impl Answered {
    /// Logs the line and counts the answer.
    pub fn record(&self, metrics: &Metrics) {
        metrics.answered(self.endpoint, self.outcome, self.status);
        let duration_ms = self.elapsed.as_secs_f64() * 1e3;
        let tenant = self
            .tenant
            .map_or_else(|| "none".to_string(), |t| t.0.to_string());
        info!(
            target: "access",
            tenant,
            endpoint = self.endpoint,
            outcome = self.outcome,
            status = self.status,
            prompt_tokens = self.prompt_tokens,
            completion_tokens = self.completion_tokens,
            duration_ms,
            "request"
        );
    }
}
