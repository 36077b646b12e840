//! Isolation: the incident replayed, fail-closed configuration, page isolation under every interleaving, sizes at the limits.
//!
//! One story per module; the shared rigs are in `tests/support/`.

#[macro_use]
#[path = "../support/mod.rs"]
mod support;

mod device_resident_pages;
mod engine_prefix_cache;
mod incident_config;
mod incident_replay;
mod kv_isolation;
mod prefix_cache_chunked;
mod prefix_cache_eviction;
mod prefix_cache_example;
mod prefix_cache_model;
mod prefix_cache_tenants;
mod service_idle;
mod sizes_at_the_limits;
