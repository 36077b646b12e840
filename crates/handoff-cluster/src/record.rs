//! What a worker registers: its key in etcd and the JSON value under it.
//!
//! `/<deployment>/workers/<worker-id>` holds a [`WorkerRecord`] as JSON. The
//! record is parsed strictly (unknown fields, a key that is not 64 hex
//! digits, more free pages than pages, an unknown dtype are all refused) and
//! its `epoch` must equal the etcd lease the key is attached to: a value put
//! without a lease would never expire, and one that names another lease is
//! not the registration it claims to be.

use std::fmt;

use handoff::KvDtype;
use handoff::fingerprint::ModelFingerprint;
use serde::{Deserialize, Serialize};

use crate::{ClusterError, WorkerKey};

/// Checks a name used as one etcd key segment.
fn valid_segment(s: &str) -> bool {
    (1..=64).contains(&s.len())
        && s.bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-'))
}

/// `s` as one etcd key segment, if it is a valid one.
fn segment(s: &str) -> Option<String> {
    valid_segment(s).then(|| s.to_string())
}

/// At most 80 characters of `s`, for an error message.
fn clipped(s: &str) -> String {
    s.chars().take(80).collect()
}

/// A deployment: the etcd prefix its workers register under.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Deployment(String);

impl Deployment {
    /// A deployment named `name` (1 to 64 of `[A-Za-z0-9._-]`).
    pub fn new(name: &str) -> Result<Self, ClusterError> {
        segment(name)
            .map(Deployment)
            .ok_or_else(|| ClusterError::BadDeployment {
                name: clipped(name),
            })
    }

    /// The prefix every worker key of this deployment starts with.
    pub fn workers_prefix(&self) -> String {
        format!("/{}/workers/", self.0)
    }

    /// The key worker `id` registers under.
    pub fn worker_key(&self, id: &WorkerId) -> String {
        format!("{}{}", self.workers_prefix(), id.0)
    }
}

/// A worker's name in its deployment (1 to 64 of `[A-Za-z0-9._-]`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerId(String);

impl WorkerId {
    /// Validates `id`.
    pub fn new(id: &str) -> Result<Self, ClusterError> {
        segment(id)
            .map(WorkerId)
            .ok_or_else(|| ClusterError::BadWorkerId { id: clipped(id) })
    }

    /// The id as written in etcd.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// One registration's epoch: the id of the etcd lease its key lives on. A
/// worker that re-registers gets a new lease, so a new epoch; plans and
/// receipts that carry an older one are fenced.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Epoch(pub i64);

impl fmt::Display for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:x}", self.0)
    }
}

/// Which half of disaggregated serving a worker runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Prefill,
    Decode,
}

/// How the worker moves KV.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// Authenticated TCP.
    Tcp,
    /// NIXL (UCX) for the bytes, authenticated TCP for the messages.
    Nixl,
}

/// A worker's registration, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerRecord {
    pub role: Role,
    /// `host:port` its transfer link listens on.
    pub address: String,
    pub transport: Transport,
    pub public_key: WorkerKey,
    pub model: ModelFingerprint,
    pub pages_free: u64,
    pub pages_total: u64,
    /// Requests waiting at the worker (the router's second load signal).
    pub queue_depth: u64,
    pub kv_dtype: KvDtype,
    pub epoch: Epoch,
}

/// The JSON form, field for field.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Wire<'a> {
    role: Role,
    address: &'a str,
    transport: Transport,
    public_key: &'a str,
    model_fingerprint: &'a str,
    pages_free: u64,
    pages_total: u64,
    queue_depth: u64,
    kv_dtype: &'a str,
    epoch: i64,
}

fn malformed(reason: impl Into<String>) -> ClusterError {
    ClusterError::Malformed {
        reason: reason.into(),
    }
}

impl WorkerRecord {
    /// The JSON value registered in etcd.
    pub fn to_json(&self) -> Vec<u8> {
        let key = self.public_key.to_string();
        let model = self.model.to_string();
        let wire = Wire {
            role: self.role,
            address: &self.address,
            transport: self.transport,
            public_key: &key,
            model_fingerprint: &model,
            pages_free: self.pages_free,
            pages_total: self.pages_total,
            queue_depth: self.queue_depth,
            kv_dtype: self.kv_dtype.name(),
            epoch: self.epoch.0,
        };
        // Serializing a struct of strings and integers cannot fail.
        serde_json::to_vec(&wire).unwrap_or_default()
    }

    /// Parses and checks a registered value. `lease` is the etcd lease the
    /// key is attached to (0 for none), which the record's epoch must name.
    pub fn parse(value: &[u8], lease: i64) -> Result<Self, ClusterError> {
        let w: Wire<'_> = serde_json::from_slice(value).map_err(|e| malformed(e.to_string()))?;
        let public_key = WorkerKey::parse_hex(w.public_key)?;
        let model = u64::from_str_radix(w.model_fingerprint, 16)
            .ok()
            .filter(|_| w.model_fingerprint.len() == 16)
            .map(ModelFingerprint::from_u64)
            .ok_or_else(|| malformed("model_fingerprint is not 16 hex digits"))?;
        let kv_dtype = KvDtype::parse(w.kv_dtype)
            .ok_or_else(|| malformed("kv_dtype is not f32, f16, bf16 or fp8"))?;
        let record = WorkerRecord {
            role: w.role,
            address: w.address.to_string(),
            transport: w.transport,
            public_key,
            model,
            pages_free: w.pages_free,
            pages_total: w.pages_total,
            queue_depth: w.queue_depth,
            kv_dtype,
            epoch: Epoch(w.epoch),
        };
        record.check()?;
        if lease == 0 {
            return Err(malformed(
                "the key is not attached to a lease, so it would never expire",
            ));
        }
        if record.epoch.0 != lease {
            return Err(malformed(format!(
                "epoch {} is not the lease {lease:x} the key lives on",
                record.epoch
            )));
        }
        Ok(record)
    }

    /// The checks a record must pass before it is registered or accepted.
    pub fn check(&self) -> Result<(), ClusterError> {
        if self.pages_total == 0 {
            return Err(malformed("pages_total is 0"));
        }
        if self.pages_free > self.pages_total {
            return Err(malformed("pages_free exceeds pages_total"));
        }
        let port_ok = self.address.rsplit_once(':').is_some_and(|(host, port)| {
            !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p != 0)
        });
        if !port_ok || self.address.len() > 255 {
            return Err(malformed("address is not host:port"));
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A valid record for tests.
    pub(crate) fn record(role: Role, key: u8, epoch: i64) -> WorkerRecord {
        WorkerRecord {
            role,
            address: "127.0.0.1:7000".into(),
            transport: Transport::Tcp,
            public_key: WorkerKey::from_bytes([key; 32]),
            model: ModelFingerprint::from_u64(0xfeed),
            pages_free: 60,
            pages_total: 64,
            queue_depth: 0,
            kv_dtype: KvDtype::F16,
            epoch: Epoch(epoch),
        }
    }

    #[test]
    fn a_record_round_trips_through_json() {
        let r = record(Role::Decode, 3, 77);
        assert_eq!(WorkerRecord::parse(&r.to_json(), 77).ok(), Some(r));
    }

    #[test]
    fn values_that_do_not_hold_together_are_malformed() {
        let r = record(Role::Prefill, 3, 77);
        let json = String::from_utf8(r.to_json()).unwrap_or_default();
        let cases = [
            (json.replace("\"pages_free\":60", "\"pages_free\":65"), 77),
            (json.replace("\"pages_total\":64", "\"pages_total\":0"), 77),
            (json.replace("f16", "int4"), 77),
            (json.replace("127.0.0.1:7000", "nowhere"), 77),
            (json.replace("prefill", "both"), 77),
            (
                json.replace("\"epoch\":77", "\"epoch\":77,\"admin\":true"),
                77,
            ),
            (json.clone(), 0),
            (json.clone(), 78),
            ("{".to_string(), 77),
        ];
        for (value, lease) in cases {
            assert!(
                matches!(
                    WorkerRecord::parse(value.as_bytes(), lease),
                    Err(ClusterError::Malformed { .. })
                ),
                "{value} under lease {lease}"
            );
        }
        let bad_key = json.replace(&"03".repeat(32), &"03".repeat(31));
        assert!(matches!(
            WorkerRecord::parse(bad_key.as_bytes(), 77),
            Err(ClusterError::BadPublicKey { .. })
        ));
    }

    #[test]
    fn names_are_single_key_segments() {
        assert!(WorkerId::new("prefill-0").is_ok());
        for bad in ["", "a/b", "../x", &"x".repeat(65), "sp ace"] {
            assert!(WorkerId::new(bad).is_err(), "{bad:?}");
            assert!(Deployment::new(bad).is_err(), "{bad:?}");
        }
        let d = Deployment::new("prod").unwrap_or_else(|e| panic!("{e}"));
        let id = WorkerId::new("p0").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(d.worker_key(&id), "/prod/workers/p0");
    }
}
