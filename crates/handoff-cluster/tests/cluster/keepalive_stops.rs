//! A worker whose keep-alive stops (as under SIGSTOP) leaves the live set
//! within its lease TTL + 1 s of its last keep-alive, and its epoch is
//! fenced; its peers are not told, they see it go.

use std::time::{Duration, Instant};

use handoff_cluster::{ClusterError, Fence, Role};

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_worker_leaves_within_ttl_plus_one_second() {
    let Some(endpoint) = endpoint() else { return };
    let client = client(&endpoint).await;
    let d = deployment("silent");
    let ttl = Duration::from_secs(2);
    let w = watch(&client, &d, &[1, 2]).await;
    let d0 = register(&client, &d, "d0", ttl.as_secs(), record(Role::Decode, 2)).await;
    let _p0 = register(&client, &d, "p0", ttl.as_secs(), record(Role::Prefill, 1)).await;
    w.wait_until("both live", Duration::from_secs(5), |m| {
        m.live().count() == 2
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    // Past two TTLs, keep-alives hold both registrations.
    tokio::time::sleep(ttl * 2).await;
    assert_eq!(w.read(live_ids), ["d0", "p0"]);

    d0.pause_keep_alive();
    let last = d0.last_keep_alive();
    w.wait_until("d0 out", ttl * 4, |m| m.get(&id("d0")).is_none())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let out_after = last.elapsed();
    println!("d0 left {out_after:?} after its last keep-alive (TTL {ttl:?})");
    assert!(
        out_after <= ttl + Duration::from_secs(1),
        "left after {out_after:?}"
    );
    assert!(
        out_after >= ttl / 2,
        "left after {out_after:?}: before its lease could expire"
    );
    assert_eq!(w.read(|m| m.fence(&id("d0"), d0.epoch())), Fence::Fenced);
    assert_eq!(w.read(live_ids), ["p0"], "the live worker stays");
    assert_eq!(w.read(|m| m.counters().left), 1);

    // Resumed, it finds its lease gone and cannot publish under it.
    d0.resume_keep_alive();
    let start = Instant::now();
    while !d0.is_lost() && start.elapsed() < ttl * 3 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(d0.is_lost(), "the keep-alive saw the lease gone");
    assert!(matches!(
        d0.update_load(1, 0).await,
        Err(ClusterError::LeaseLost { .. })
    ));
    assert!(w.read(|m| m.get(&id("d0")).is_none()));
}
