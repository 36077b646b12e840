//! The IO driver of [`Membership`]: a range read of the deployment's prefix,
//! then a watch from the next revision, each event applied in order. A
//! broken or cancelled watch (etcd restarted, history compacted) is followed
//! by a fresh range read, which [`Membership::reset`] reconciles.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use etcd_client::{Client, EventType, GetOptions, WatchOptions};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::{ClusterError, Membership, WatchEvent};

struct Shared {
    state: Mutex<Membership>,
    /// Bumped after every batch of events applied.
    applied: watch::Sender<u64>,
}

impl Shared {
    fn with<R>(&self, f: impl FnOnce(&mut Membership) -> R) -> R {
        let r = f(&mut self.state.lock().unwrap_or_else(|p| p.into_inner()));
        self.applied.send_modify(|n| *n += 1);
        r
    }
}

/// A live set kept current from etcd by a tokio task. Dropping it stops
/// the task.
pub struct MembershipWatch {
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

/// Pause before a re-sync after the watch broke.
const RETRY: Duration = Duration::from_millis(200);

impl MembershipWatch {
    /// Reads the deployment's current workers into `membership`, then keeps
    /// it current. The first read's errors come back here; later ones are
    /// retried. Needs a tokio runtime.
    pub async fn start(client: &Client, membership: Membership) -> Result<Self, ClusterError> {
        let mut client = client.clone();
        let prefix = membership.prefix().to_string();
        let (applied, _) = watch::channel(0);
        let shared = Arc::new(Shared {
            state: Mutex::new(membership),
            applied,
        });
        let revision = resync(&mut client, &prefix, &shared).await?;
        let task = tokio::spawn(drive(client, prefix, shared.clone(), revision));
        Ok(MembershipWatch { shared, task })
    }

    /// Reads the live set (and counters, fences) under its lock. Keep `f`
    /// short: the driver waits for it.
    pub fn read<R>(&self, f: impl FnOnce(&Membership) -> R) -> R {
        f(&self.shared.state.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Waits until `done` holds of the live set, or `timeout` passes.
    pub async fn wait_until(
        &self,
        what: &str,
        timeout: Duration,
        done: impl Fn(&Membership) -> bool,
    ) -> Result<(), ClusterError> {
        let start = Instant::now();
        let mut rx = self.shared.applied.subscribe();
        loop {
            if self.read(&done) {
                return Ok(());
            }
            let left = timeout.saturating_sub(start.elapsed());
            let timed_out = || ClusterError::Timeout {
                what: what.to_string(),
                waited: timeout,
            };
            match tokio::time::timeout(left, rx.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return Err(ClusterError::WatchStopped),
                Err(_) => return Err(timed_out()),
            }
        }
    }
}

impl Drop for MembershipWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A range read of `prefix` into the live set; returns its revision.
async fn resync(client: &mut Client, prefix: &str, shared: &Shared) -> Result<i64, ClusterError> {
    let resp = client
        .get(prefix, Some(GetOptions::new().with_prefix()))
        .await
        .map_err(ClusterError::etcd("range read"))?;
    let revision = resp.header().map_or(0, |h| h.revision());
    let entries = resp
        .kvs()
        .iter()
        .map(|kv| (kv.key().to_vec(), kv.value().to_vec(), kv.lease()))
        .collect();
    shared.with(|m| m.reset(entries, revision));
    Ok(revision)
}

/// Watches from `revision + 1`, applying events; on any break, re-reads
/// (which reconciles whatever the break hid) and watches again.
async fn drive(mut client: Client, prefix: String, shared: Arc<Shared>, mut revision: i64) {
    loop {
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision + 1);
        if let Ok(mut stream) = client.watch(prefix.as_str(), Some(options)).await {
            while let Ok(Some(resp)) = stream.message().await {
                if resp.canceled() {
                    break;
                }
                let events: Vec<WatchEvent> = resp
                    .events()
                    .iter()
                    .filter_map(|ev| {
                        let kv = ev.kv()?;
                        Some(match ev.event_type() {
                            EventType::Put => WatchEvent::Put {
                                key: kv.key().to_vec(),
                                value: kv.value().to_vec(),
                                lease: kv.lease(),
                                revision: kv.mod_revision(),
                            },
                            EventType::Delete => WatchEvent::Delete {
                                key: kv.key().to_vec(),
                                revision: kv.mod_revision(),
                            },
                        })
                    })
                    .collect();
                if !events.is_empty() {
                    shared.with(|m| {
                        for e in events {
                            m.apply(e);
                        }
                    });
                }
            }
        }
        tokio::time::sleep(RETRY).await;
        loop {
            match resync(&mut client, &prefix, &shared).await {
                Ok(r) => {
                    revision = r;
                    break;
                }
                Err(_) => tokio::time::sleep(RETRY).await,
            }
        }
    }
}
