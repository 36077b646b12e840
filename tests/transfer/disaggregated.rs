//! Story: splitting prefill from decode changes where KV is computed, never
//! what is generated.
//!
//! The same requests are served by the colocated engine and by a prefill
//! worker and a decode worker joined by a transport; under greedy sampling
//! every request's tokens are identical, for a random model and for the
//! real stories260K model (when present), across page sizes and KV dtypes,
//! over both transports. Afterwards both workers' pools are full again with
//! nothing held and no isolation violation.

use handoff::{
    Colocated, Decode, DecodeWorker, EngineConfigBuilder, Prefill, PrefillWorker, RoleKind,
};
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use handoff::model::{Model, ModelConfig, ModelWeights, load_llama2c, random_weights};
use handoff::transfer::{
    Fault, FaultPlan, FaultRule, InProcess, Step, Tcp, Transfer, TransferConfig,
};
use handoff::{
    Engine, EngineConfig, EngineError, KvDtype, Outcome, Request, RequestId, Role, TenantId,
};

const STORIES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../shared/models/stories260K.bin"
);

struct Case {
    page: usize,
    dtype: KvDtype,
    window: usize,
}

fn config<R: RoleKind>(weights: &ModelWeights, c: &Case) -> EngineConfig<R> {
    let g = weights.config.kv_geometry(c.dtype);
    let factor = if R::ROLE == Role::Decode { 1 } else { 2 };
    EngineConfigBuilder::<R>::new(g)
        .max_context(c.window)
        .page_size(c.page)
        .pool_tokens(factor * c.window * 3)
        .build()
        .unwrap()
}

fn workload(vocab: u32) -> Vec<Request> {
    // Four tenants, prompt lengths around and across page boundaries.
    [1usize, 7, 16, 33, 50, 90]
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            let prompt = (0..len)
                .map(|j| ((i * 131 + j * 17 + 1) as u32) % vocab)
                .collect();
            Request::new(RequestId(i as u64 + 1), TenantId(i as u32 % 4), prompt, 12)
        })
        .collect()
}

fn colocated(weights: ModelWeights, c: &Case, reqs: &[Request]) -> Vec<Vec<u32>> {
    let cfg = config::<Colocated>(&weights, c);
    let mut engine = Engine::new(Model::cpu(weights).unwrap(), cfg).unwrap();
    let handles: Vec<_> = reqs
        .iter()
        .map(|r| engine.submit(r.clone()).unwrap())
        .collect();
    engine.run_until_idle();
    handles
        .into_iter()
        .map(|h| {
            let (tokens, outcome) = h.try_collect();
            assert!(matches!(outcome, Some(Outcome::Finished(_))), "{outcome:?}");
            tokens
        })
        .collect()
}

/// Serves `reqs` through a prefill worker (on its own thread) and a decode
/// worker; returns each request's tokens and outcome.
fn disaggregated<T: Transfer>(
    t: &T,
    weights: impl Fn() -> ModelWeights,
    c: &Case,
    reqs: &[Request],
    transfer: TransferConfig,
    prefill_pass_cap: Option<usize>,
) -> Vec<(Vec<u32>, Outcome)> {
    let (pl, dl) = t.connect(&transfer).unwrap();
    let w = weights();
    let pcfg = config::<Prefill>(&w, c);
    let mut prefill =
        PrefillWorker::new(pl, Model::cpu(w).unwrap(), pcfg, transfer.clone()).unwrap();
    if let Some(cap) = prefill_pass_cap {
        prefill = prefill.with_max_batch_tokens(cap);
    }
    let w = weights();
    let dcfg = config::<Decode>(&w, c);
    let mut decode = DecodeWorker::new(dl, Model::cpu(w).unwrap(), dcfg, transfer).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let prefill_thread = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let _ = prefill.run(&stop);
            // Let decode's last answers arrive (however late a loaded
            // machine delivers them, up to 10 s), then release everything.
            let until = Instant::now() + Duration::from_secs(10);
            while (prefill.side().held_transfers() > 0 || !prefill.pool().stats().is_full())
                && Instant::now() < until
            {
                if prefill.step(Duration::from_millis(20)).is_err() {
                    break;
                }
            }
            let stats = prefill.pool().stats();
            let held = prefill.side().held_transfers();
            prefill.shutdown();
            (stats, held, prefill.pool().stats())
        })
    };
    let handles: Vec<_> = reqs
        .iter()
        .map(|r| decode.submit(r.clone()).unwrap())
        .collect();
    decode.run_until_idle();
    let decode_stats = decode.pool().stats();
    stop.store(true, Ordering::Release);
    let (prefill_stats, held, after_shutdown) = prefill_thread.join().unwrap();
    assert!(
        decode_stats.is_full(),
        "decode pool not full: {decode_stats:?}"
    );
    assert_eq!(decode_stats.isolation_violations, 0);
    assert_eq!(
        held, 0,
        "prefill released every source page on decode's answers"
    );
    assert!(
        prefill_stats.is_full(),
        "prefill pool not full: {prefill_stats:?}"
    );
    assert_eq!(prefill_stats.isolation_violations, 0);
    assert!(after_shutdown.is_full());
    handles
        .into_iter()
        .map(|h| {
            let (tokens, outcome) = h.try_collect();
            (tokens, outcome.expect("every request ended"))
        })
        .collect()
}

fn assert_same_as_colocated<T: Transfer>(t: &T, weights: impl Fn() -> ModelWeights, c: &Case) {
    assert_same_as_colocated_capped(t, weights, c, None);
}

/// [`assert_same_as_colocated`] with the prefill worker's passes capped at
/// `cap` prompt tokens: longer prompts are prefilled in chunks.
fn assert_same_as_colocated_capped<T: Transfer>(
    t: &T,
    weights: impl Fn() -> ModelWeights,
    c: &Case,
    cap: Option<usize>,
) {
    let vocab = weights().config.vocab_size as u32;
    let reqs = workload(vocab);
    let expected = colocated(weights(), c, &reqs);
    let got = disaggregated(t, &weights, c, &reqs, TransferConfig::default(), cap);
    for ((r, want), (tokens, outcome)) in reqs.iter().zip(&expected).zip(got) {
        assert!(
            matches!(outcome, Outcome::Finished(_)),
            "{}: {outcome:?}",
            r.id
        );
        assert_eq!(
            want.len(),
            r.max_new_tokens,
            "no stop ids: every request runs to length"
        );
        assert_eq!(
            &tokens,
            want,
            "{} (prompt {}): {} page {} {:?}",
            r.id,
            r.prompt.len(),
            t.name(),
            c.page,
            c.dtype
        );
    }
}

fn random_model() -> ModelWeights {
    random_weights(&ModelConfig::tiny_gqa(), 7)
}

fn stories() -> Option<impl Fn() -> ModelWeights> {
    let path = Path::new(STORIES);
    if !path.exists() {
        let _ = writeln!(
            std::io::stderr(),
            "skipping stories260K cases: {STORIES} is absent"
        );
        return None;
    }
    Some(move || load_llama2c(path).expect("stories260K loads"))
}

const CASES: [Case; 3] = [
    Case {
        page: 16,
        dtype: KvDtype::F32,
        window: 128,
    },
    Case {
        page: 4,
        dtype: KvDtype::F32,
        window: 128,
    },
    Case {
        page: 8,
        dtype: KvDtype::BF16,
        window: 128,
    },
];

#[test]
fn random_model_in_process_matches_colocated() {
    for c in &CASES {
        assert_same_as_colocated(&InProcess, random_model, c);
    }
}

#[test]
fn random_model_over_tcp_matches_colocated() {
    for c in &CASES {
        assert_same_as_colocated(&Tcp, random_model, c);
    }
}

#[test]
fn random_model_over_authenticated_tcp_matches_colocated() {
    for c in &CASES {
        assert_same_as_colocated(&handoff::transfer::TcpAuth, random_model, c);
    }
}

#[test]
fn random_model_over_nixl_matches_colocated() {
    on_nixl!(|t| {
        for c in &CASES {
            assert_same_as_colocated(&t, random_model, c);
        }
    });
}

/// A prefill worker whose passes hold at most 5 (or 16) prompt tokens
/// computes the 7- to 90-token prompts in chunks, appending each after the
/// KV already written: the tokens are still the colocated engine's.
#[test]
fn prefill_in_capped_passes_matches_colocated() {
    for cap in [5, 16] {
        for c in &CASES[..2] {
            assert_same_as_colocated_capped(&InProcess, random_model, c, Some(cap));
        }
        assert_same_as_colocated_capped(&Tcp, random_model, &CASES[2], Some(cap));
    }
}

#[test]
fn stories260k_in_process_matches_colocated() {
    let Some(w) = stories() else { return };
    for c in &CASES[..2] {
        assert_same_as_colocated(&InProcess, &w, c);
    }
}

#[test]
fn stories260k_over_tcp_matches_colocated() {
    let Some(w) = stories() else { return };
    for c in &CASES[..2] {
        assert_same_as_colocated(&Tcp, &w, c);
    }
}

#[test]
fn a_corrupted_receipt_fails_only_its_request_and_generates_nothing() {
    fn run<T: Transfer>(t: &T) {
        let c = &CASES[0];
        let reqs = workload(ModelConfig::tiny_gqa().vocab_size as u32);
        let expected = colocated(random_model(), c, &reqs);
        let victim = RequestId(3);
        let faults = FaultPlan::new()
            .with(FaultRule::at(Step::ReceiptSent, Fault::Corrupt).for_request(victim));
        let cfg = TransferConfig::default().with_faults(Arc::new(faults));
        let got = disaggregated(t, random_model, c, &reqs, cfg, None);
        for ((r, want), (tokens, outcome)) in reqs.iter().zip(&expected).zip(got) {
            if r.id == victim {
                assert!(tokens.is_empty(), "no token for the corrupted transfer");
                match outcome {
                    Outcome::Failed(EngineError::Transfer(e)) => {
                        assert_eq!(handoff::HttpStatus::http_status(&e), 500)
                    }
                    other => panic!("expected a transfer failure, got {other:?}"),
                }
            } else {
                assert!(matches!(outcome, Outcome::Finished(_)));
                assert_eq!(&tokens, want, "{}", r.id);
            }
        }
    }
    run(&InProcess);
    run(&Tcp);
    run(&handoff::transfer::TcpAuth);
    on_nixl!(|t| run(&t));
}
