//! Stories against a real etcd, one per file. The endpoint comes from
//! `HANDOFF_ETCD` (`eval "$(bash scripts/etcd.sh start)"`, as `.ci/run`
//! does); without it, the stories start one through that script. Only where
//! etcd cannot run at all does a story print `SKIP:`, and never when
//! `HANDOFF_REQUIRE_ETCD=1`.

mod support;

mod keepalive_stops;
mod registers_and_is_seen;
mod reregistration_fenced;
mod stranger_refused;
