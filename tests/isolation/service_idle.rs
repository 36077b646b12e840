//! An idle service must cost nothing: a serving stack keeps one per model
//! around the clock, and a loop that polls its channel burns a core while no
//! client is connected. (Its own test binary: the service thread is found by
//! name among this process's threads.)

use crate::support::pd;

use handoff::Colocated;
use std::time::Duration;

use handoff::model::Model;
use handoff::service::Service;
use handoff::{Engine, Outcome, Request, RequestId, TenantId};

/// CPU time, in nanoseconds, of this process's threads named `name`.
#[cfg(target_os = "linux")]
fn cpu_ns_of(name: &str) -> Option<u64> {
    let mut total = None;
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let dir = task.ok()?.path();
        let comm = std::fs::read_to_string(dir.join("comm")).ok()?;
        if comm.trim() == name {
            let stat = std::fs::read_to_string(dir.join("schedstat")).ok()?;
            let ns: u64 = stat.split_whitespace().next()?.parse().ok()?;
            *total.get_or_insert(0) += ns;
        }
    }
    total
}

#[cfg(target_os = "linux")]
#[test]
fn an_idle_service_sleeps_instead_of_polling() {
    let w = pd::weights();
    let engine = Engine::new(
        Model::cpu(w.clone()).unwrap(),
        pd::engine_config::<Colocated>(&w),
    )
    .unwrap();
    let service = Service::spawn(engine).unwrap();
    // It serves, then goes idle.
    let h = service
        .submit(Request::new(RequestId(1), TenantId(1), vec![1, 2, 3], 8))
        .unwrap();
    let (tokens, outcome) = h.wait_timeout(Duration::from_secs(60));
    assert!(matches!(outcome, Some(Outcome::Finished(_))) && tokens.len() == 8);

    let Some(before) = cpu_ns_of("handoff-service") else {
        eprintln!("skipped: /proc/self/task/*/schedstat is not readable here");
        return;
    };
    std::thread::sleep(Duration::from_millis(300));
    let after = cpu_ns_of("handoff-service").unwrap();
    // A polling loop would spend most of the 300 ms; a sleeping one spends
    // nothing measurable (10 ms leaves room for a slow, shared machine).
    let spent = Duration::from_nanos(after - before);
    assert!(
        spent < Duration::from_millis(10),
        "idle service used {spent:?} of CPU in 300 ms"
    );

    // And it still answers.
    let h = service
        .submit(Request::new(RequestId(2), TenantId(1), vec![4, 5], 3))
        .unwrap();
    assert!(matches!(
        h.wait_timeout(Duration::from_secs(60)).1,
        Some(Outcome::Finished(_))
    ));
    let engine = service.shutdown(Duration::ZERO).unwrap();
    assert!(engine.pool_stats().is_full());
}
