//! A worker that comes back re-registers under a new epoch; its old epoch is
//! fenced for good, so a transfer stamped with it cannot finish, and the old
//! registration's handle cannot publish.

use std::time::Duration;

use handoff_cluster::{ClusterError, Fence, Role};

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reregistration_gets_a_new_epoch_and_the_old_one_is_fenced() {
    let Some(endpoint) = endpoint() else { return };
    let client = client(&endpoint).await;
    let d = deployment("again");
    let w = watch(&client, &d, &[1]).await;

    let first = register(&client, &d, "p0", 2, record(Role::Prefill, 1)).await;
    let old = first.epoch();
    w.wait_until("p0 live", Duration::from_secs(5), |m| {
        m.fence(&id("p0"), old) == Fence::Current
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));

    // Stopped past its TTL, it is out.
    first.pause_keep_alive();
    w.wait_until("p0 out", Duration::from_secs(8), |m| {
        m.get(&id("p0")).is_none()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    first.resume_keep_alive();

    // Back, it registers again: a new lease, so a new epoch.
    let second = register(&client, &d, "p0", 2, record(Role::Prefill, 1)).await;
    let new = second.epoch();
    assert_ne!(new, old);
    w.wait_until("p0 back", Duration::from_secs(5), |m| {
        m.fence(&id("p0"), new) == Fence::Current
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(w.read(|m| m.fence(&id("p0"), old)), Fence::Fenced);

    // The old handle's publish is refused: its lease is gone.
    let stale = first.update_load(5, 0).await;
    assert!(
        matches!(stale, Err(ClusterError::LeaseLost { epoch }) if epoch == old.0),
        "{stale:?}"
    );
    assert_eq!(
        w.read(|m| m.get(&id("p0")).map(|m| m.record.epoch)),
        Some(new)
    );

    // A re-registration while the old lease still lives fences it too.
    let third = register(&client, &d, "p0", 2, record(Role::Prefill, 1)).await;
    w.wait_until("p0 third", Duration::from_secs(5), |m| {
        m.fence(&id("p0"), third.epoch()) == Fence::Current
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(w.read(|m| m.fence(&id("p0"), new)), Fence::Fenced);
    // Dropping the superseded registration does not take the worker out:
    // its key lives on the new lease.
    drop(second);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        w.read(|m| m.fence(&id("p0"), third.epoch())),
        Fence::Current
    );
}
