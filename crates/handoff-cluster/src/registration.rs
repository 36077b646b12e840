//! A worker's registration: its record put under an etcd lease, kept alive
//! from a tokio task, and updated as its free pages and queue change.
//!
//! The lease id is the registration's [`Epoch`]. If the worker stops
//! keeping it alive (it crashed, or was stopped past its TTL), etcd deletes
//! the key and every watcher sees the worker leave; when it comes back its
//! lease is gone, [`Registration::update_load`] says so
//! ([`ClusterError::LeaseLost`]), and it must register again, under a new
//! epoch, before it takes work.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_client::{Client, LeaseKeepAliveStream, LeaseKeeper, PutOptions};
use tokio::task::JoinHandle;

use crate::{ClusterError, Deployment, Epoch, WorkerId, WorkerRecord};

/// Where and how long a worker registers.
#[derive(Clone, Debug)]
pub struct RegistrationConfig {
    pub deployment: Deployment,
    pub worker: WorkerId,
    /// The lease's time to live: a worker silent this long is out. Whole
    /// seconds, 2 to 3600. Keep-alives go every third of it.
    pub ttl: Duration,
}

/// What the keep-alive task and the handle share.
#[derive(Debug)]
struct KeepAlive {
    paused: AtomicBool,
    lost: AtomicBool,
    /// When the last keep-alive that etcd acknowledged was sent.
    last: Mutex<Instant>,
}

/// A live registration. Dropping it stops the keep-alive (the lease then
/// expires after its TTL); [`Registration::deregister`] revokes it at once.
pub struct Registration {
    client: Client,
    key: String,
    record: Mutex<WorkerRecord>,
    keep_alive: Arc<KeepAlive>,
    task: JoinHandle<()>,
}

fn ttl_secs(ttl: Duration) -> Result<i64, ClusterError> {
    let secs = ttl.as_secs();
    if ttl.subsec_nanos() == 0 && (2..=3600).contains(&secs) {
        Ok(secs as i64)
    } else {
        Err(ClusterError::BadTtl { ttl })
    }
}

impl Registration {
    /// Grants a lease, puts `record` (its epoch set to the lease) under the
    /// worker's key on it, and starts keeping it alive. Needs a tokio runtime.
    pub async fn register(
        client: &Client,
        config: &RegistrationConfig,
        mut record: WorkerRecord,
    ) -> Result<Self, ClusterError> {
        let ttl = ttl_secs(config.ttl)?;
        let mut client = client.clone();
        let lease = client
            .lease_grant(ttl, None)
            .await
            .map_err(ClusterError::etcd("lease grant"))?
            .id();
        record.epoch = Epoch(lease);
        record.check()?;
        let key = config.deployment.worker_key(&config.worker);
        client
            .put(
                key.as_str(),
                record.to_json(),
                Some(PutOptions::new().with_lease(lease)),
            )
            .await
            .map_err(ClusterError::etcd("put registration"))?;
        let sent = Instant::now();
        let (keeper, stream) = client
            .lease_keep_alive(lease)
            .await
            .map_err(ClusterError::etcd("lease keep-alive"))?;
        let keep_alive = Arc::new(KeepAlive {
            paused: AtomicBool::new(false),
            lost: AtomicBool::new(false),
            last: Mutex::new(sent),
        });
        let task = tokio::spawn(keep_alive_loop(
            client.clone(),
            lease,
            keeper,
            stream,
            keep_alive.clone(),
            config.ttl / 3,
        ));
        Ok(Registration {
            client,
            key,
            record: Mutex::new(record),
            keep_alive,
            task,
        })
    }

    /// This registration's epoch (its lease id).
    pub fn epoch(&self) -> Epoch {
        self.record().epoch
    }

    /// The record as last put.
    pub fn record(&self) -> WorkerRecord {
        self.record
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The etcd key it lives under.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Publishes the worker's free pages and queue depth.
    pub async fn update_load(&self, pages_free: u64, queue_depth: u64) -> Result<(), ClusterError> {
        let record = {
            let mut r = self.record.lock().unwrap_or_else(|p| p.into_inner());
            let mut next = r.clone();
            next.pages_free = pages_free;
            next.queue_depth = queue_depth;
            next.check()?;
            *r = next.clone();
            next
        };
        if self.keep_alive.lost.load(Ordering::Acquire) {
            return Err(ClusterError::LeaseLost {
                epoch: record.epoch.0,
            });
        }
        let lease = record.epoch.0;
        self.client
            .clone()
            .put(
                self.key.as_str(),
                record.to_json(),
                Some(PutOptions::new().with_lease(lease)),
            )
            .await
            .map_err(|e| match e {
                // etcd refuses a put on a lease it no longer has.
                etcd_client::Error::GRpcStatus(s) if s.message().contains("lease not found") => {
                    self.keep_alive.lost.store(true, Ordering::Release);
                    ClusterError::LeaseLost { epoch: lease }
                }
                e => ClusterError::Etcd {
                    op: "put registration",
                    source: e,
                },
            })?;
        Ok(())
    }

    /// When the last keep-alive etcd acknowledged was sent.
    pub fn last_keep_alive(&self) -> Instant {
        *self
            .keep_alive
            .last
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Whether etcd has reported the lease gone.
    pub fn is_lost(&self) -> bool {
        self.keep_alive.lost.load(Ordering::Acquire)
    }

    /// Stops sending keep-alives while the process goes on, as a process
    /// stopped by SIGSTOP would: past the TTL, etcd expires the lease.
    pub fn pause_keep_alive(&self) {
        self.keep_alive.paused.store(true, Ordering::Release);
    }

    /// Sends keep-alives again; if the lease expired meanwhile, the next one
    /// finds it gone and the registration is lost.
    pub fn resume_keep_alive(&self) {
        self.keep_alive.paused.store(false, Ordering::Release);
    }

    /// Revokes the lease: the worker leaves the live set at once.
    pub async fn deregister(self) -> Result<(), ClusterError> {
        self.task.abort();
        let lease = self.epoch().0;
        self.client
            .clone()
            .lease_revoke(lease)
            .await
            .map_err(ClusterError::etcd("lease revoke"))?;
        Ok(())
    }
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("key", &self.key)
            .field("epoch", &self.epoch())
            .field("lost", &self.is_lost())
            .finish()
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Sends a keep-alive every `every` unless paused. A response with TTL 0
/// means etcd no longer has the lease: the registration is lost for good.
/// A broken stream (etcd restarted, connection lost) is reopened.
async fn keep_alive_loop(
    mut client: Client,
    lease: i64,
    keeper: LeaseKeeper,
    stream: LeaseKeepAliveStream,
    state: Arc<KeepAlive>,
    every: Duration,
) {
    let mut link = Some((keeper, stream));
    loop {
        tokio::time::sleep(every).await;
        if state.paused.load(Ordering::Acquire) {
            continue;
        }
        let (keeper, stream) = match link.as_mut() {
            Some(l) => l,
            None => match client.lease_keep_alive(lease).await {
                Ok(l) => link.insert(l),
                Err(_) => continue,
            },
        };
        let sent = Instant::now();
        let answer = match keeper.keep_alive().await {
            Ok(()) => stream.message().await,
            Err(e) => Err(e),
        };
        match answer {
            Ok(Some(resp)) if resp.ttl() > 0 => {
                *state.last.lock().unwrap_or_else(|p| p.into_inner()) = sent;
            }
            Ok(Some(_)) => {
                state.lost.store(true, Ordering::Release);
                return;
            }
            Ok(None) | Err(_) => link = None,
        }
    }
}
