//! `/metrics` in Prometheus text format, through the `metrics` facade and
//! `metrics-exporter-prometheus`.
//!
//! Series (all prefixed `handoff_`):
//! - `http_requests_total{endpoint,outcome,status}`: every answer, by how
//!   it ended (`finished`, `rejected`, `failed`, `cancelled` for a client
//!   that went away, `invalid`, `unauthorized`) and its HTTP status.
//! - `rejections_total{reason}`: admission refusals by reason.
//! - `client_disconnects_total`, `cancels_confirmed_total`: clients that
//!   went away mid-request, and the engine's confirmations that it ended
//!   them (pages released once no write can land).
//! - `time_to_first_token_seconds`, `inter_token_latency_seconds`:
//!   histograms, measured where the server reads the engine's stream.
//! - `generated_tokens_total`, `prompt_tokens_total`: `rate()` of the first
//!   is tokens/s.
//! - `requests_awaiting_first_token` (queued, prefilling or transferring),
//!   `requests_streaming`: gauges.
//! - `pool_pages{pool,state}` (`free`, `in_use`, `held`, `cached`,
//!   `cached_idle`), `pool_capacity_pages{pool}`, `isolation_violations{pool}`
//!   (must stay 0; counted only with the audit trail, see `audit_enabled`):
//!   read from each KV pool at scrape time.
//! - `prefix_cache_pages_total{pool,event}` (`hit`, `miss`, `published`,
//!   `evicted`) and `prefix_cache_lookups_total{pool}`: each pool's prefix
//!   cache, read at scrape time.
//! - `preemptions_total`, `queue_length` (requests admitted and waiting for
//!   pages), `prefill_tokens_total`, `reused_prompt_tokens_total` (prompt
//!   tokens the prefix cache saved): the engine's (or decode worker's)
//!   counters as its service thread last reported them.
//! - `transfer_kv_bytes_total` (disaggregated: prompt tokens times KV bytes
//!   per token, for each transfer decode verified and generated from),
//!   `transfer_integrity_failures_total` (requests failed by the verifier).

use std::time::Duration;

use handoff::service::Submitter;
use handoff::{KvPool, Rejection};
use metrics::{counter, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::errors::rejection_reason;

const LATENCY_BUCKETS: &[f64] = &[
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0,
    2.0, 5.0, 10.0, 30.0,
];

/// The recorder's handle and the pools it reports.
pub struct Metrics {
    handle: PrometheusHandle,
    pools: Vec<(&'static str, KvPool)>,
    kv_bytes_per_token: u64,
    /// The service whose counters are read at scrape time.
    server: Submitter,
}

impl Metrics {
    /// Installs the process-wide recorder (once).
    pub fn install(
        pools: Vec<(&'static str, KvPool)>,
        audit: bool,
        kv_bytes_per_token: u64,
        server: Submitter,
    ) -> Result<Metrics, String> {
        let handle = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
            .map_err(|e| e.to_string())?
            .install_recorder()
            .map_err(|e| e.to_string())?;
        metrics::describe_counter!(
            "handoff_http_requests_total",
            "HTTP answers by endpoint, outcome and status"
        );
        metrics::describe_counter!(
            "handoff_rejections_total",
            "requests refused at admission, by reason"
        );
        metrics::describe_counter!(
            "handoff_client_disconnects_total",
            "clients that went away before their answer was complete"
        );
        metrics::describe_counter!(
            "handoff_cancels_confirmed_total",
            "requests the engine ended as cancelled after their client went away"
        );
        metrics::describe_histogram!(
            "handoff_time_to_first_token_seconds",
            "submission to first generated token"
        );
        metrics::describe_histogram!(
            "handoff_inter_token_latency_seconds",
            "time between consecutive generated tokens"
        );
        metrics::describe_gauge!(
            "handoff_isolation_violations",
            "reads the audit trail refused because another request wrote the slot (must be 0)"
        );
        gauge!("handoff_audit_enabled").set(if audit { 1.0 } else { 0.0 });
        // Series that must show from the first scrape, even at zero.
        counter!("handoff_client_disconnects_total").absolute(0);
        counter!("handoff_cancels_confirmed_total").absolute(0);
        counter!("handoff_generated_tokens_total").absolute(0);
        counter!("handoff_transfer_kv_bytes_total").absolute(0);
        counter!("handoff_transfer_integrity_failures_total").absolute(0);
        gauge!("handoff_requests_awaiting_first_token").set(0.0);
        gauge!("handoff_requests_streaming").set(0.0);
        Ok(Metrics {
            handle,
            pools,
            kv_bytes_per_token,
            server,
        })
    }

    /// The text for `/metrics`, with the pools read now.
    pub fn render(&self) -> String {
        for (name, pool) in &self.pools {
            let s = pool.stats();
            let name = *name;
            gauge!("handoff_pool_pages", "pool" => name, "state" => "free").set(s.free as f64);
            gauge!("handoff_pool_pages", "pool" => name, "state" => "in_use").set(s.in_use as f64);
            gauge!("handoff_pool_pages", "pool" => name, "state" => "held").set(s.held as f64);
            gauge!("handoff_pool_pages", "pool" => name, "state" => "cached").set(s.cached as f64);
            gauge!("handoff_pool_pages", "pool" => name, "state" => "cached_idle")
                .set(s.cached_idle as f64);
            let c = pool.cache_counters();
            for (event, n) in [
                ("hit", c.hit_pages),
                ("miss", c.missed_pages),
                ("published", c.published),
                ("evicted", c.evictions),
            ] {
                counter!("handoff_prefix_cache_pages_total", "pool" => name, "event" => event)
                    .absolute(n);
            }
            counter!("handoff_prefix_cache_lookups_total", "pool" => name).absolute(c.lookups);
            gauge!("handoff_pool_capacity_pages", "pool" => name).set(s.capacity as f64);
            gauge!("handoff_isolation_violations", "pool" => name)
                .set(s.isolation_violations as f64);
        }
        let st = self.server.stats();
        counter!("handoff_preemptions_total").absolute(st.tally.preempted);
        counter!("handoff_prefill_tokens_total").absolute(st.tally.prefill_tokens);
        counter!("handoff_reused_prompt_tokens_total").absolute(st.tally.reused_tokens);
        gauge!("handoff_queue_length").set(st.waiting as f64);
        self.handle.run_upkeep();
        self.handle.render()
    }

    pub fn answered(&self, endpoint: &'static str, outcome: &'static str, status: u16) {
        counter!("handoff_http_requests_total", "endpoint" => endpoint, "outcome" => outcome,
            "status" => status.to_string())
        .increment(1);
    }

    pub fn rejected(&self, r: &Rejection) {
        counter!("handoff_rejections_total", "reason" => rejection_reason(r)).increment(1);
    }

    pub fn admitted(&self, prompt_tokens: usize) {
        counter!("handoff_prompt_tokens_total").increment(prompt_tokens as u64);
        gauge!("handoff_requests_awaiting_first_token").increment(1.0);
    }

    /// The first token arrived `ttft` after submission.
    pub fn first_token(&self, ttft: Duration, prompt_tokens: usize, transferred: bool) {
        histogram!("handoff_time_to_first_token_seconds").record(ttft.as_secs_f64());
        gauge!("handoff_requests_awaiting_first_token").decrement(1.0);
        gauge!("handoff_requests_streaming").increment(1.0);
        counter!("handoff_generated_tokens_total").increment(1);
        if transferred {
            counter!("handoff_transfer_kv_bytes_total")
                .increment(prompt_tokens as u64 * self.kv_bytes_per_token);
        }
    }

    pub fn next_token(&self, itl: Duration) {
        histogram!("handoff_inter_token_latency_seconds").record(itl.as_secs_f64());
        counter!("handoff_generated_tokens_total").increment(1);
    }

    /// A request that was admitted has ended (any way); `streamed`: it had
    /// its first token.
    pub fn ended(&self, streamed: bool) {
        if streamed {
            gauge!("handoff_requests_streaming").decrement(1.0);
        } else {
            gauge!("handoff_requests_awaiting_first_token").decrement(1.0);
        }
    }

    pub fn disconnected(&self) {
        counter!("handoff_client_disconnects_total").increment(1);
    }

    pub fn cancel_confirmed(&self) {
        counter!("handoff_cancels_confirmed_total").increment(1);
    }

    pub fn integrity_failure(&self) {
        counter!("handoff_transfer_integrity_failures_total").increment(1);
    }
}

/// A route's path as the metrics' and the access log's endpoint label.
pub fn endpoint_label(path: &str) -> &'static str {
    match path {
        "/v1/completions" => "completions",
        "/v1/chat/completions" => "chat",
        "/v1/models" => "models",
        _ => "other",
    }
}
