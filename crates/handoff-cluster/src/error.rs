//! The cluster layer's one error type. Each message says what to do.

use std::time::Duration;

/// What can go wrong talking to etcd or reading what is registered there.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// etcd could not be reached or refused a request.
    #[error(
        "etcd {op} failed: {source}; check that etcd runs at the configured endpoint (scripts/etcd.sh start prints one) and is reachable"
    )]
    Etcd {
        op: &'static str,
        #[source]
        source: etcd_client::Error,
    },
    /// A lease time-to-live etcd cannot grant.
    #[error(
        "lease TTL {ttl:?} is not a whole number of seconds from 2 to 3600; pick one in that range"
    )]
    BadTtl { ttl: Duration },
    /// A worker id that cannot be an etcd key segment.
    #[error(
        "worker id {id:?} is not 1 to 64 characters of [A-Za-z0-9._-]; name workers with those characters only"
    )]
    BadWorkerId { id: String },
    /// A deployment name that cannot be an etcd key prefix.
    #[error(
        "deployment name {name:?} is not 1 to 64 characters of [A-Za-z0-9._-]; name the deployment with those characters only"
    )]
    BadDeployment { name: String },
    /// A public key that is not 64 hex digits.
    #[error(
        "public key {given:?} is not 64 hex digits (32 bytes); pass the worker's X25519 static public key in hex"
    )]
    BadPublicKey { given: String },
    /// A registered value that does not parse or does not hold together.
    #[error("malformed worker record: {reason}; the worker must re-register with a valid record")]
    Malformed { reason: String },
    /// etcd reported the lease gone: this registration is fenced.
    #[error(
        "the lease of epoch {epoch} expired or was revoked; the worker is out of the cluster and must re-register (a new epoch) before taking work"
    )]
    LeaseLost { epoch: i64 },
    /// A wait for the live set to reach some state ran out of time.
    #[error(
        "membership did not reach {what} within {waited:?}; check the workers' registrations and etcd"
    )]
    Timeout { what: String, waited: Duration },
    /// No live worker of `role` has room for the request.
    #[error(
        "no live {role:?} worker has {pages_needed} free pages; retry later, add {role:?} workers or shorten the prompt"
    )]
    NoWorker {
        role: crate::Role,
        pages_needed: u64,
    },
    /// The prefix index tracks at most 64 workers.
    #[error(
        "the prefix index already tracks 64 workers; forget workers that left, or shard the router"
    )]
    IndexFull,
    /// The watch driver stopped (its runtime shut down or it panicked).
    #[error("the membership watch stopped; start a new MembershipWatch")]
    WatchStopped,
}

impl ClusterError {
    /// Wraps an etcd client error with the operation that failed.
    pub(crate) fn etcd(op: &'static str) -> impl FnOnce(etcd_client::Error) -> ClusterError {
        move |source| ClusterError::Etcd { op, source }
    }
}
