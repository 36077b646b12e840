//! A cluster of handoff workers: discovery and membership on etcd, and the
//! router's choice of a prefill and a decode worker per request.
//!
//! - [`registration`]: a worker puts a JSON [`WorkerRecord`] under
//!   `/<deployment>/workers/<worker-id>`, attached to an etcd lease it keeps
//!   alive from a tokio task; the lease id is the registration's [`Epoch`].
//! - [`membership`]: a pure state machine, fed by an initial range read and
//!   by watch events, that keeps the live set and refuses (and counts)
//!   entries signed by keys outside the operator's allowlist, malformed
//!   entries and entries for another model. [`watch`] drives it from etcd.
//! - [`router`]: given the live set and a [`router::PrefixIndex`] keyed by the
//!   workers' own tenant-salted page keys, picks a prefill worker by the
//!   tenant's cached prefix, then by load, and a decode worker by load.
//!
//! The library `handoff` knows nothing of this crate and stays free of tokio.

pub mod error;
pub mod membership;
pub mod record;
pub mod registration;
pub mod router;
pub mod watch;
pub mod worker_key;

pub use error::ClusterError;
pub use membership::{Change, Fence, Member, Membership, MembershipCounters, WatchEvent};
pub use record::{Deployment, Epoch, Role, Transport, WorkerId, WorkerRecord};
pub use registration::{Registration, RegistrationConfig};
pub use router::{PrefixIndex, Route, choose};
pub use watch::MembershipWatch;
pub use worker_key::{TrustedKeys, WorkerKey};
