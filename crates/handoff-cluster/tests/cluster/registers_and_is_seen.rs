//! A worker registers and every watcher sees it, with the record it put;
//! its load updates reach them; a revoked registration leaves at once.

use std::time::Duration;

use handoff_cluster::Role;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registered_worker_is_seen_with_its_record_and_load() {
    let Some(endpoint) = endpoint() else { return };
    let client = client(&endpoint).await;
    let d = deployment("seen");
    let early = watch(&client, &d, &[1, 2]).await;
    let p0 = register(&client, &d, "p0", 5, record(Role::Prefill, 1)).await;
    let epoch = p0.epoch();
    assert_ne!(epoch.0, 0, "the epoch is the lease");
    early
        .wait_until("p0 live", Duration::from_secs(5), |m| {
            m.get(&id("p0")).is_some_and(|w| w.record == p0.record())
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"));

    // A watcher that starts later finds it through the range read.
    let late = watch(&client, &d, &[1, 2]).await;
    assert_eq!(late.read(live_ids), ["p0"]);

    p0.update_load(40, 3)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    early
        .wait_until("p0's new load", Duration::from_secs(5), |m| {
            m.get(&id("p0"))
                .is_some_and(|w| (w.record.pages_free, w.record.queue_depth) == (40, 3))
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        early.read(|m| m.get(&id("p0")).map(|w| w.record.epoch)),
        Some(epoch)
    );
    // A load the record cannot hold is refused before it reaches etcd.
    assert!(p0.update_load(129, 0).await.is_err());

    p0.deregister().await.unwrap_or_else(|e| panic!("{e}"));
    for w in [&early, &late] {
        w.wait_until("p0 gone", Duration::from_secs(5), |m| {
            m.live().next().is_none()
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(w.read(|m| m.counters().foreign_registrations_refused()), 0);
    }
}
