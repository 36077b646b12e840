//! A stranger that writes itself into the deployment's prefix, under a key
//! the operator never trusted, is refused and counted, and never joins the
//! live set; neither does a malformed entry nor one without a lease.

use std::time::Duration;

use etcd_client::PutOptions;
use handoff_cluster::Role;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranger_with_an_unknown_key_is_refused_and_counted() {
    let Some(endpoint) = endpoint() else { return };
    let mut client = client(&endpoint).await;
    let d = deployment("stranger");
    let w = watch(&client, &d, &[1]).await;
    let _p0 = register(&client, &d, "p0", 5, record(Role::Prefill, 1)).await;
    let _s0 = register(&client, &d, "s0", 5, record(Role::Prefill, 9)).await;
    w.wait_until("the stranger refused", Duration::from_secs(5), |m| {
        m.counters().unknown_key == 1
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));

    // Garbage, and a valid-looking record put without a lease.
    let key = |n: &str| d.worker_key(&id(n));
    let put = |k: String, v: Vec<u8>, opts: Option<PutOptions>| {
        let mut c = client.clone();
        async move {
            c.put(k, v, opts)
                .await
                .unwrap_or_else(|e| panic!("put: {e}"))
        }
    };
    put(key("junk"), b"not json".to_vec(), None).await;
    put(key("nolease"), record(Role::Decode, 1).to_json(), None).await;
    w.wait_until("the bad entries refused", Duration::from_secs(5), |m| {
        m.counters().malformed == 2
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    w.wait_until("p0 live", Duration::from_secs(5), |m| {
        m.get(&id("p0")).is_some()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(w.read(live_ids), ["p0"]);
    let counters = w.read(|m| m.counters());
    assert_eq!(counters.foreign_registrations_refused(), 3);

    // A router that starts now refuses them too, from its range read.
    let late = watch(&client, &d, &[1]).await;
    assert_eq!(late.read(live_ids), ["p0"]);
    assert_eq!(
        late.read(|m| m.counters().foreign_registrations_refused()),
        3
    );
    client
        .delete(key("junk"), None)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    client
        .delete(key("nolease"), None)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
}
