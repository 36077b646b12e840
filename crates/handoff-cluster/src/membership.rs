//! The live set of a deployment's workers, as a pure state machine.
//!
//! Fed by an initial range read ([`Membership::reset`]) and then by watch
//! events in revision order ([`Membership::apply`]); it does no IO, so every
//! rule is tested here alone and [`crate::watch`] only moves events in. etcd
//! turns a lease's expiry into a delete of every key on it, so a worker whose
//! keep-alive stopped leaves through [`WatchEvent::Delete`].
//!
//! An entry joins only if its key is a valid worker key, its value parses as
//! a [`WorkerRecord`] whose epoch is its lease, its public key is on the
//! operator's allowlist and its model fingerprint is the deployment's.
//! Anything else is refused and counted; a refused put for a worker that was
//! live takes it out, so a registration that turns bad stops taking work.

use std::collections::{BTreeMap, HashMap};

use handoff::fingerprint::ModelFingerprint;

use crate::{Deployment, Epoch, TrustedKeys, WorkerId, WorkerRecord};

/// One change etcd reported under the deployment's prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WatchEvent {
    /// A key was put (registered or updated) on `lease`.
    Put {
        key: Vec<u8>,
        value: Vec<u8>,
        lease: i64,
        revision: i64,
    },
    /// A key was deleted, or its lease expired or was revoked.
    Delete { key: Vec<u8>, revision: i64 },
}

/// A live worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    pub id: WorkerId,
    pub record: WorkerRecord,
    /// The etcd revision that last changed it.
    pub revision: i64,
}

/// Why an entry was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Its public key is not on the operator's allowlist.
    UnknownKey,
    /// Its key or value does not parse, or its epoch is not its lease.
    Malformed,
    /// It serves another model.
    OtherModel,
}

/// What one event did to the live set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// A worker entered the live set.
    Joined(WorkerId),
    /// A live worker's record changed within its epoch (load, address).
    Updated(WorkerId),
    /// A live worker re-registered: `old` is fenced from now on.
    Reregistered {
        id: WorkerId,
        old: Epoch,
        new: Epoch,
    },
    /// A worker left the live set (deleted, expired, or refused on update).
    Left { id: WorkerId, epoch: Epoch },
    /// An entry was refused.
    Refused { key: String, why: Refusal },
    /// Nothing changed (an event for a key outside the workers' prefix, or a
    /// delete of an entry that was never live).
    Nothing,
}

/// Whether a plan or receipt stamped with some epoch may still act.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fence {
    /// The worker is live at exactly this epoch.
    Current,
    /// The epoch is not the worker's live one: the worker left, or
    /// re-registered since. Its transfers must fail typed.
    Fenced,
}

/// Counters a deployment exports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MembershipCounters {
    /// Entries refused because their key is not on the allowlist.
    pub unknown_key: u64,
    /// Entries refused because they do not parse or hold together.
    pub malformed: u64,
    /// Entries refused because they serve another model.
    pub other_model: u64,
    /// Workers that left the live set.
    pub left: u64,
}

impl MembershipCounters {
    /// Every refused registration, whatever the reason.
    pub fn foreign_registrations_refused(&self) -> u64 {
        self.unknown_key + self.malformed + self.other_model
    }
}

/// The live set of one deployment.
#[derive(Clone, Debug)]
pub struct Membership {
    prefix: String,
    trusted: TrustedKeys,
    model: ModelFingerprint,
    live: BTreeMap<WorkerId, Member>,
    counters: MembershipCounters,
    /// The last revision applied.
    revision: i64,
    /// The revision of the last range read: events up to it are in it.
    synced: i64,
}

impl Membership {
    /// An empty live set for `deployment`, trusting `trusted` keys, for the
    /// model `model`.
    pub fn new(deployment: &Deployment, trusted: TrustedKeys, model: ModelFingerprint) -> Self {
        Membership {
            prefix: deployment.workers_prefix(),
            trusted,
            model,
            live: BTreeMap::new(),
            counters: MembershipCounters::default(),
            revision: 0,
            synced: 0,
        }
    }

    /// The etcd prefix this set watches.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The last etcd revision applied.
    pub fn revision(&self) -> i64 {
        self.revision
    }

    /// Replaces the live set with a range read at `revision`: `(key, value,
    /// lease)` for every key under the prefix. Workers no longer present
    /// leave; the rest are (re)admitted under the same rules as a put.
    pub fn reset(&mut self, entries: Vec<(Vec<u8>, Vec<u8>, i64)>, revision: i64) -> Vec<Change> {
        let mut old: HashMap<WorkerId, Member> =
            std::mem::take(&mut self.live).into_iter().collect();
        let mut changes = Vec::new();
        for (key, value, lease) in entries {
            let previous = self.id_of(&key).and_then(|id| old.remove(&id));
            changes.push(self.admit(&key, &value, lease, revision, previous));
        }
        for (id, m) in old {
            self.counters.left += 1;
            changes.push(Change::Left {
                id,
                epoch: m.record.epoch,
            });
        }
        self.revision = revision;
        self.synced = revision;
        changes
    }

    /// Whether an event at `revision` is already reflected: it is in the
    /// last range read, or older than an event applied since (one etcd
    /// transaction's events share a revision, so equal ones still apply).
    fn stale(&self, revision: i64) -> bool {
        revision <= self.synced || revision < self.revision
    }

    /// Applies one watch event. Events already reflected (a replay after a
    /// re-sync) change nothing.
    pub fn apply(&mut self, event: WatchEvent) -> Change {
        match event {
            WatchEvent::Put {
                key,
                value,
                lease,
                revision,
            } => {
                if self.stale(revision) {
                    return Change::Nothing;
                }
                self.revision = revision;
                let previous = self.id_of(&key).and_then(|id| self.live.remove(&id));
                self.admit(&key, &value, lease, revision, previous)
            }
            WatchEvent::Delete { key, revision } => {
                if self.stale(revision) {
                    return Change::Nothing;
                }
                self.revision = revision;
                match self.id_of(&key).and_then(|id| self.live.remove_entry(&id)) {
                    Some((id, m)) => {
                        self.counters.left += 1;
                        Change::Left {
                            id,
                            epoch: m.record.epoch,
                        }
                    }
                    None => Change::Nothing,
                }
            }
        }
    }

    /// The worker id a key names, if it is a worker key of this deployment.
    fn id_of(&self, key: &[u8]) -> Option<WorkerId> {
        let key = std::str::from_utf8(key).ok()?;
        WorkerId::new(key.strip_prefix(self.prefix.as_str())?).ok()
    }

    /// Admits or refuses one entry; `previous` is the live member it
    /// replaces, already taken out of the set.
    fn admit(
        &mut self,
        key: &[u8],
        value: &[u8],
        lease: i64,
        revision: i64,
        previous: Option<Member>,
    ) -> Change {
        let key_text = String::from_utf8_lossy(key)
            .chars()
            .take(200)
            .collect::<String>();
        let Some(id) = self.id_of(key) else {
            if key_text.starts_with(self.prefix.as_str()) {
                self.counters.malformed += 1;
                return Change::Refused {
                    key: key_text,
                    why: Refusal::Malformed,
                };
            }
            return Change::Nothing;
        };
        let refusal = match WorkerRecord::parse(value, lease) {
            Err(_) => Err(Refusal::Malformed),
            Ok(r) if !self.trusted.contains(&r.public_key) => Err(Refusal::UnknownKey),
            Ok(r) if r.model != self.model => Err(Refusal::OtherModel),
            Ok(r) => Ok(r),
        };
        match refusal {
            Err(why) => {
                match why {
                    Refusal::UnknownKey => self.counters.unknown_key += 1,
                    Refusal::Malformed => self.counters.malformed += 1,
                    Refusal::OtherModel => self.counters.other_model += 1,
                }
                if previous.is_some() {
                    self.counters.left += 1;
                }
                Change::Refused { key: key_text, why }
            }
            Ok(record) => {
                let epoch = record.epoch;
                self.live.insert(
                    id.clone(),
                    Member {
                        id: id.clone(),
                        record,
                        revision,
                    },
                );
                match previous {
                    None => Change::Joined(id),
                    Some(p) if p.record.epoch == epoch => Change::Updated(id),
                    Some(p) => Change::Reregistered {
                        id,
                        old: p.record.epoch,
                        new: epoch,
                    },
                }
            }
        }
    }

    /// The live workers, by id.
    pub fn live(&self) -> impl Iterator<Item = &Member> {
        self.live.values()
    }

    /// One live worker.
    pub fn get(&self, id: &WorkerId) -> Option<&Member> {
        self.live.get(id)
    }

    /// Whether work stamped with `epoch` by worker `id` may still act.
    pub fn fence(&self, id: &WorkerId, epoch: Epoch) -> Fence {
        match self.live.get(id) {
            Some(m) if m.record.epoch == epoch => Fence::Current,
            _ => Fence::Fenced,
        }
    }

    /// The counters so far.
    pub fn counters(&self) -> MembershipCounters {
        self.counters
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::tests::record;
    use crate::{Role, WorkerKey};

    const MODEL: u64 = 0xfeed;

    fn membership() -> Membership {
        let d = Deployment::new("prod").unwrap_or_else(|e| panic!("{e}"));
        let trusted = TrustedKeys::new([1, 2, 3].map(|b| WorkerKey::from_bytes([b; 32])));
        Membership::new(&d, trusted, ModelFingerprint::from_u64(MODEL))
    }

    fn id(s: &str) -> WorkerId {
        WorkerId::new(s).unwrap_or_else(|e| panic!("{e}"))
    }

    fn put(worker: &str, r: &WorkerRecord, revision: i64) -> WatchEvent {
        WatchEvent::Put {
            key: format!("/prod/workers/{worker}").into_bytes(),
            value: r.to_json(),
            lease: r.epoch.0,
            revision,
        }
    }

    fn delete(worker: &str, revision: i64) -> WatchEvent {
        WatchEvent::Delete {
            key: format!("/prod/workers/{worker}").into_bytes(),
            revision,
        }
    }

    fn live_ids(m: &Membership) -> Vec<String> {
        m.live().map(|w| w.id.to_string()).collect()
    }

    #[test]
    fn a_registration_joins_updates_and_leaves() {
        let mut m = membership();
        let mut r = record(Role::Prefill, 1, 10);
        assert_eq!(m.apply(put("p0", &r, 5)), Change::Joined(id("p0")));
        r.pages_free = 12;
        assert_eq!(m.apply(put("p0", &r, 6)), Change::Updated(id("p0")));
        assert_eq!(m.get(&id("p0")).map(|w| w.record.pages_free), Some(12));
        assert_eq!(
            m.apply(delete("p0", 7)),
            Change::Left {
                id: id("p0"),
                epoch: Epoch(10)
            }
        );
        assert!(live_ids(&m).is_empty());
        assert_eq!(m.counters().left, 1);
        assert_eq!(m.apply(delete("p0", 8)), Change::Nothing);
    }

    #[test]
    fn a_reregistration_fences_the_old_epoch() {
        let mut m = membership();
        m.apply(put("d0", &record(Role::Decode, 2, 10), 3));
        assert_eq!(m.fence(&id("d0"), Epoch(10)), Fence::Current);
        let change = m.apply(put("d0", &record(Role::Decode, 2, 11), 4));
        assert_eq!(
            change,
            Change::Reregistered {
                id: id("d0"),
                old: Epoch(10),
                new: Epoch(11)
            }
        );
        assert_eq!(m.fence(&id("d0"), Epoch(10)), Fence::Fenced);
        assert_eq!(m.fence(&id("d0"), Epoch(11)), Fence::Current);
        m.apply(delete("d0", 5));
        assert_eq!(m.fence(&id("d0"), Epoch(11)), Fence::Fenced);
        assert_eq!(m.fence(&id("nobody"), Epoch(11)), Fence::Fenced);
    }

    #[test]
    fn strangers_malformed_entries_and_other_models_are_refused_and_counted() {
        let mut m = membership();
        let stranger = record(Role::Prefill, 9, 20);
        assert!(matches!(
            m.apply(put("s", &stranger, 2)),
            Change::Refused {
                why: Refusal::UnknownKey,
                ..
            }
        ));
        let mut other = record(Role::Prefill, 1, 21);
        other.model = ModelFingerprint::from_u64(MODEL + 1);
        assert!(matches!(
            m.apply(put("o", &other, 3)),
            Change::Refused {
                why: Refusal::OtherModel,
                ..
            }
        ));
        let raw = |key: &str, lease: i64, revision: i64| WatchEvent::Put {
            key: key.as_bytes().to_vec(),
            value: b"{}".to_vec(),
            lease,
            revision,
        };
        let mut liar = put("l", &record(Role::Prefill, 1, 30), 6);
        if let WatchEvent::Put { lease, .. } = &mut liar {
            *lease = 31; // a record that names a lease other than its own
        }
        for bad in [
            raw("/prod/workers/g", 5, 4),
            raw("/prod/workers/a/b", 5, 5),
            liar,
        ] {
            let refused = m.apply(bad);
            assert!(
                matches!(
                    refused,
                    Change::Refused {
                        why: Refusal::Malformed,
                        ..
                    }
                ),
                "{refused:?}"
            );
        }
        let outside = raw("/other/workers/x", 5, 7);
        assert_eq!(m.apply(outside), Change::Nothing);
        assert!(live_ids(&m).is_empty());
        let c = m.counters();
        assert_eq!((c.unknown_key, c.other_model, c.malformed), (1, 1, 3));
        assert_eq!(c.foreign_registrations_refused(), 5);
    }

    #[test]
    fn a_live_worker_whose_update_is_refused_leaves() {
        let mut m = membership();
        let r = record(Role::Decode, 3, 40);
        m.apply(put("d1", &r, 2));
        let mut bad = r.clone();
        bad.public_key = WorkerKey::from_bytes([8; 32]);
        assert!(matches!(
            m.apply(put("d1", &bad, 3)),
            Change::Refused {
                why: Refusal::UnknownKey,
                ..
            }
        ));
        assert!(live_ids(&m).is_empty());
        assert_eq!(m.fence(&id("d1"), Epoch(40)), Fence::Fenced);
        assert_eq!(m.counters().left, 1);
    }

    #[test]
    fn a_range_read_replaces_the_set_and_replays_change_nothing() {
        let mut m = membership();
        m.apply(put("gone", &record(Role::Prefill, 1, 50), 2));
        m.apply(put("kept", &record(Role::Decode, 2, 51), 3));
        let kept = record(Role::Decode, 2, 51);
        let stranger = record(Role::Decode, 7, 52);
        let changes = m.reset(
            vec![
                (b"/prod/workers/kept".to_vec(), kept.to_json(), 51),
                (b"/prod/workers/new".to_vec(), stranger.to_json(), 52),
            ],
            10,
        );
        assert!(changes.contains(&Change::Updated(id("kept"))));
        assert!(changes.contains(&Change::Left {
            id: id("gone"),
            epoch: Epoch(50)
        }));
        assert_eq!(live_ids(&m), ["kept"]);
        assert_eq!(m.counters().unknown_key, 1);
        // Events from before the range read's revision are already in it.
        assert_eq!(m.apply(delete("kept", 9)), Change::Nothing);
        assert_eq!(live_ids(&m), ["kept"]);
        assert_eq!(m.revision(), 10);
    }
}
