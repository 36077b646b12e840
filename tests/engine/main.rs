//! The colocated engine and the service: request lifecycles, batching, preemption, shutdown, and the examples that serve.
//!
//! One story per module; the shared rigs are in `tests/support/`.

#[macro_use]
#[path = "../support/mod.rs"]
mod support;

mod cancel_storm;
mod engine_batching_invariance;
mod engine_interleavings;
mod engine_logprobs;
mod engine_poisoned_request;
mod engine_preemption;
mod engine_request_lifecycle;
mod example_generate;
mod example_serve;
mod handle_outcome_is_final;
mod service_threads;
mod spec_cancel;
mod spec_disaggregated;
mod spec_greedy_matches;
mod spec_prefix_cache;
mod spec_rollback;
mod spec_sampled;
mod threaded_passes;
