//! Story: every fault, at every step of the handoff, on both transports,
//! against real prefill and decode workers running a model.
//!
//! Each cell starts a prefill worker and a decode worker (a tiny random
//! model), injects one fault at one protocol step, and serves a target
//! request (tenant 1) beside a request of tenant 2 and a canary of tenant
//! 3, then a late request of tenant 2 submitted once the target has ended
//! (so faults at release time meet a request that comes after them). Two
//! scopes: the fault strikes the target's first message at that step (its
//! second write batch for KV writing), or every message of every request
//! at that step.
//! The faults: every message fault (drop, delay, duplicate, reorder,
//! truncate, corrupt, disconnect) and every worker fault (kill the worker,
//! cancel the client, exhaust the pool, make admission reject). Per cell:
//! 1. zero isolation violations in either pool;
//! 2. every request ends either finished with exactly the fault-free
//!    output, or with a typed error (HTTP 4xx/5xx) or a cancel after a
//!    prefix of it: never a wrong token; when only the target is struck,
//!    the canary finishes intact whenever the fault cannot take the link
//!    or a worker down;
//! 3. once every request has ended, both pools return to full capacity
//!    with nothing held, while both workers still run;
//! 4. no panic and no hang: every cell runs under a watchdog.

use crate::support::pd;

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use handoff::model::ModelWeights;
use handoff::transfer::{
    Fault, FaultPlan, FaultRule, InProcess, Step, Tcp, Transfer, TransferConfig,
};
use handoff::{Request, RequestId, TenantId};
use pd::{Pair, Tracked};

const TARGET: RequestId = RequestId(1);
const OTHER: RequestId = RequestId(2);
const CANARY: RequestId = RequestId(3);
const LATE: RequestId = RequestId(4);
/// Receipt, ack and write-credit timeouts.
const TIMEOUT: Duration = Duration::from_millis(800);
const CELL_LIMIT: Duration = Duration::from_secs(30);

fn workload() -> Vec<Request> {
    let prompt =
        |seed: u32, len: u32| -> Vec<u32> { (0..len).map(|i| (seed * 31 + i * 7) % 97).collect() };
    vec![
        Request::new(TARGET, TenantId(1), prompt(1, 30), 5),
        Request::new(OTHER, TenantId(2), prompt(2, 21), 5),
        Request::new(CANARY, TenantId(3), prompt(3, 17), 5),
        Request::new(LATE, TenantId(2), prompt(4, 25), 5),
    ]
}

struct Shared {
    weights: ModelWeights,
    reqs: Vec<Request>,
    want: Vec<Vec<u32>>,
}

fn shared() -> &'static Shared {
    static S: OnceLock<Shared> = OnceLock::new();
    S.get_or_init(|| {
        let weights = pd::weights();
        let reqs = workload();
        let want = pd::reference(&weights, &reqs);
        Shared {
            weights,
            reqs,
            want,
        }
    })
}

fn faults() -> Vec<Fault> {
    let mut all = Fault::all_basic(Duration::from_millis(30));
    all.extend(Fault::all_worker(Duration::from_millis(150)));
    all
}

/// Faults after which a worker or the link may be gone: requests other
/// than the target may end in typed errors too.
fn may_take_others_down(f: &Fault) -> bool {
    matches!(
        f,
        Fault::Disconnect | Fault::Kill | Fault::ExhaustPool(_) | Fault::RejectAdmission
    )
}

/// Which messages a cell's fault strikes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scope {
    /// The target's first message at the step (second write batch).
    Target,
    /// Every message of every request at the step.
    Every,
}

/// Runs one cell; returns each request's result code.
fn cell<T: Transfer + Copy + Send + 'static>(
    t: T,
    step: Step,
    fault: Option<Fault>,
    scope: Scope,
) -> Result<Vec<String>, String> {
    let s = shared();
    let plan = FaultPlan::new();
    let contained = scope == Scope::Target && !fault.as_ref().is_some_and(may_take_others_down);
    let plan = match (fault, scope) {
        // The second write batch: the first has landed by then.
        (Some(f), Scope::Target) if step == Step::KvWriting => {
            plan.with(FaultRule::at(step, f).for_request(TARGET).skip(1))
        }
        (Some(f), Scope::Target) => plan.with(FaultRule::at(step, f).for_request(TARGET)),
        (Some(f), Scope::Every) => plan.with(FaultRule::at(step, f).times(usize::MAX)),
        (None, _) => plan,
    };
    let plan = Arc::new(plan);
    let cfg = TransferConfig::default()
        .with_receipt_timeout(TIMEOUT)
        .with_ack_timeout(TIMEOUT)
        .with_write_timeout(TIMEOUT)
        // Four tokens per write batch: several batches per layer.
        .with_max_batch_bytes(512)
        .with_faults(plan.clone());
    let mut pair = Pair::start(&t, cfg, &s.weights);
    let mut reqs: Vec<Tracked> = s.reqs[..3].iter().map(|r| pair.submit(r.clone())).collect();
    let deadline = Instant::now() + Duration::from_secs(15);
    if !pair.run_until(&mut reqs[..1], deadline) {
        return Err("the target never ended".into());
    }
    reqs.push(pair.submit(s.reqs[3].clone()));
    if !pair.run_until(&mut reqs, deadline) {
        let open: Vec<_> = reqs
            .iter()
            .filter(|r| !r.done())
            .map(|r| r.req.id)
            .collect();
        return Err(format!("requests never ended: {open:?}"));
    }
    let mut codes = Vec::new();
    for (r, want) in reqs.iter().zip(&s.want) {
        let code = r.judge(want)?;
        if r.req.id == CANARY && contained && code != "ok" {
            return Err(format!(
                "the canary was harmed by a contained fault: {code}"
            ));
        }
        codes.push(code);
    }
    pair.pools_return_to_full(3 * TIMEOUT)?;
    pair.stop()?;
    Ok(codes)
}

#[derive(Default)]
struct Tally {
    cells: usize,
    passed: usize,
    failures: Vec<String>,
    outcomes: BTreeMap<String, usize>,
}

fn matrix<T: Transfer + Copy + Send + 'static>(t: T) {
    let started = Instant::now();
    let mut tally = Tally::default();
    // The fault-free run: every request finishes with the reference output.
    let base = pd::watchdog("fault-free", CELL_LIMIT, move || {
        cell(t, Step::PlanSent, None, Scope::Target)
    })
    .and_then(|r| r);
    assert_eq!(
        base,
        Ok(vec!["ok".to_string(); 4]),
        "{}: the fault-free run",
        t.name()
    );
    let mut grid = String::new();
    for (scope, fault) in [Scope::Target, Scope::Every]
        .into_iter()
        .flat_map(|scope| faults().into_iter().map(move |f| (scope, f)))
    {
        let mut row = format!("  {:<7}{:<19}", format!("{scope:?}"), format!("{fault:?}"));
        for step in Step::ALL {
            let name = format!("{} {scope:?} {step:?} {fault:?}", t.name());
            let f = fault.clone();
            tally.cells += 1;
            let result = pd::watchdog(&name, CELL_LIMIT, move || cell(t, step, Some(f), scope))
                .and_then(|r| r);
            match result {
                Ok(codes) => {
                    tally.passed += 1;
                    row.push_str(&format!(" {:<10}", codes[0]));
                    for c in codes {
                        *tally.outcomes.entry(c).or_default() += 1;
                    }
                }
                Err(e) => {
                    row.push_str(&format!(" {:<10}", "FAIL"));
                    tally.failures.push(format!("{name}: {e}"));
                }
            }
        }
        grid.push_str(&row);
        grid.push('\n');
    }
    let steps: String = Step::ALL
        .iter()
        .map(|s| format!(" {:<10}", format!("{s:?}")))
        .collect();
    let _ = writeln!(
        std::io::stderr(),
        "fault matrix, {} transport: {} cells (2 scopes x {} faults x {} steps), {} passed, in {:.1?}\n\
         target request's outcome per cell (ok = equal to the fault-free run):\n  {:<26}{steps}\n{grid}\
         all requests: {:?} (4 per cell; codes are HTTP statuses)",
        t.name(),
        tally.cells,
        faults().len(),
        Step::ALL.len(),
        tally.passed,
        started.elapsed(),
        "",
        tally.outcomes,
    );
    assert!(
        tally.failures.is_empty(),
        "{} of {} cells failed:\n{}",
        tally.failures.len(),
        tally.cells,
        tally.failures.join("\n")
    );
}

#[test]
fn every_fault_at_every_step_in_process() {
    matrix(InProcess);
}

#[test]
fn every_fault_at_every_step_over_tcp() {
    matrix(Tcp);
}

#[test]
fn every_fault_at_every_step_over_authenticated_tcp() {
    matrix(handoff::transfer::TcpAuth);
}

#[test]
fn every_fault_at_every_step_over_nixl() {
    on_nixl!(matrix);
}
