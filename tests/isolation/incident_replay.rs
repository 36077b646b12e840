//! Incident replay, end to end through the prefill and decode workers.
//!
//! The published chain: (1) a deployment served a 1,048,576-token context
//! window from a prefill KV pool of 681,280 tokens; (2) a prompt longer than
//! that pool arrived and the engine replaced it with a one-token
//! placeholder instead of refusing it; (3) prefill told decode "transfer
//! complete" for the placeholder; (4) decode generated from pages that
//! still held other users' KV, and 155 responses leaked.
//!
//! Each link is replayed and must break: (1) at the original numbers, no
//! configuration of any role lets either worker start; (2) with the pool
//! forced past configuration at 1/1024 scale, the oversized prompt is
//! refused at admission on each side whose pool is too small, with a typed
//! error, before any page is allocated or any byte transferred; (3) a
//! forged receipt claiming completion for a one-token placeholder, or
//! claiming the whole prompt when only the start of it was written, fails
//! verification with a typed error; (4) tenant B, whose destination pages
//! are tenant A's former pages with A's bytes left in them (no scrubbing),
//! gets no token at all, and the audit trail records no read of a slot B
//! did not write.

use crate::support::pd;

use handoff::{
    Colocated, Decode, DecodeWorker, EngineConfigBuilder, Prefill, PrefillWorker, RoleKind,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff::model::{Model, ModelConfig, ModelWeights, random_weights};
use handoff::transfer::{
    Fault, FaultPlan, FaultRule, InProcess, IntegrityError, PlannedPage, Receipt, Step, Tcp,
    Transfer, TransferConfig, TransferError, WriterRun,
};
use handoff::{
    AdmissionLimits, ConfigError, EngineConfig, EngineError, Headroom, HttpStatus, KvDtype, KvPool,
    Outcome, PoolConfig, Rejection, Request, RequestId, Role, ScrubPolicy, TenantId,
};
use parking_lot::Mutex;
use pd::Tracked;

const WINDOW: usize = 1_048_576;
const PUBLISHED_POOL: usize = 681_280;
/// The reduced scale: every token count divided by this.
const SCALE: usize = 1024;
const S_WINDOW: usize = WINDOW / SCALE;
const PAGE: usize = 16;
/// The published prefill pool at scale, in whole pages (656 tokens).
const S_POOL_PAGES: usize = PUBLISHED_POOL / SCALE / PAGE;
const S_POOL_TOKENS: usize = S_POOL_PAGES * PAGE;
/// Longer than the scaled pool, shorter than the scaled window.
const OVERSIZED: usize = 700;

const TENANT_A: TenantId = TenantId(1);
const TENANT_B: TenantId = TenantId(2);

fn model(max_seq_len: usize) -> ModelConfig {
    ModelConfig {
        max_seq_len,
        ..pd::tiny_model()
    }
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (seed * 37 + i * 11 + i / 7) % 97)
        .collect()
}

type Workers<T> = (
    PrefillWorker<<T as Transfer>::Prefill>,
    DecodeWorker<<T as Transfer>::Decode>,
);

/// Starts a prefill and a decode worker the only way a deployment can:
/// from validated configurations.
fn deploy<T: Transfer>(
    t: &T,
    w: &ModelWeights,
    window: usize,
    prefill_pool: usize,
    decode_pool: usize,
    headroom: Headroom,
) -> Result<Workers<T>, EngineError> {
    let g = w.config.kv_geometry(KvDtype::BF16);
    let pcfg = EngineConfig::prefill(g)
        .max_context(window)
        .page_size(PAGE)
        .pool_tokens(prefill_pool)
        .headroom(headroom)
        .build()?;
    let dcfg = EngineConfig::decode(g)
        .max_context(window)
        .page_size(PAGE)
        .pool_tokens(decode_pool)
        .build()?;
    let tcfg = TransferConfig::default();
    let (pl, dl) = t.connect(&tcfg).map_err(TransferError::from)?;
    let prefill = PrefillWorker::new(pl, Model::cpu(w.clone()).unwrap(), pcfg, tcfg.clone())?;
    let decode = DecodeWorker::new(dl, Model::cpu(w.clone()).unwrap(), dcfg, tcfg)?
        .with_idle_wait(Duration::from_millis(1));
    Ok((prefill, decode))
}

#[test]
fn the_published_deployment_does_not_start() {
    // A model that could serve the window (weights do not depend on it).
    let w = random_weights(&model(WINDOW), 1);
    for headroom in [Headroom::DEFAULT, Headroom::MIN] {
        // Decode given a pool that does hold the window: prefill alone
        // refuses.
        let err = deploy(&InProcess, &w, WINDOW, PUBLISHED_POOL, WINDOW, headroom)
            .expect_err("the published prefill pool must not start");
        match err {
            EngineError::Config(ConfigError::PoolCannotHoldWindow {
                role: Role::Prefill,
                pool_tokens: PUBLISHED_POOL,
                max_context: WINDOW,
                required_tokens,
                ..
            }) => assert_eq!(required_tokens as f64, headroom.factor() * WINDOW as f64),
            other => panic!("wrong refusal: {other:?}"),
        }
    }
    // The same pool on the decode side is refused too.
    let err = deploy(
        &InProcess,
        &w,
        WINDOW,
        2 * WINDOW,
        PUBLISHED_POOL,
        Headroom::DEFAULT,
    )
    .expect_err("the published pool must not start a decode worker either");
    assert!(
        matches!(
            err,
            EngineError::Config(ConfigError::PoolCannotHoldWindow {
                role: Role::Decode,
                ..
            })
        ),
        "{err:?}"
    );
    assert!((500..600).contains(&err.http_status()), "{err}");
    // No role at all accepts the published numbers, so no worker can be
    // built from them.
    fn refused<R: RoleKind>(w: &ModelWeights) {
        for headroom in [Headroom::DEFAULT, Headroom::MIN] {
            let built = EngineConfigBuilder::<R>::new(w.config.kv_geometry(KvDtype::BF16))
                .max_context(WINDOW)
                .pool_tokens(PUBLISHED_POOL)
                .headroom(headroom)
                .build();
            assert!(
                built.is_err(),
                "{:?} {headroom:?} accepted the published pool",
                R::ROLE
            );
        }
    }
    refused::<Colocated>(&w);
    refused::<Prefill>(&w);
    refused::<Decode>(&w);
    // The same deployment at scale with pools that hold the window starts:
    // the refusals above are about the pool, nothing else.
    let w = random_weights(&model(2 * S_WINDOW), 1);
    let started = deploy(
        &InProcess,
        &w,
        S_WINDOW,
        2 * S_WINDOW,
        S_WINDOW,
        Headroom::DEFAULT,
    );
    assert!(started.is_ok(), "{:?}", started.err());
}

/// The scaled deployment with the published prefill pool forced past
/// configuration (and, if `decode_too`, the decode pool as well).
struct Scaled<T: Transfer> {
    prefill: PrefillWorker<T::Prefill>,
    decode: DecodeWorker<T::Decode>,
    prefill_pool: KvPool,
    decode_pool: KvPool,
}

fn scaled<T: Transfer>(
    t: &T,
    w: &ModelWeights,
    tcfg: TransferConfig,
    decode_too: bool,
    scrub: ScrubPolicy,
) -> Scaled<T> {
    let g = w.config.kv_geometry(KvDtype::F32);
    let refused = EngineConfig::prefill(g)
        .max_context(S_WINDOW)
        .page_size(PAGE)
        .pool_tokens(S_POOL_TOKENS)
        .build();
    assert!(refused.is_err(), "configuration refuses the scaled pool");
    let small = PoolConfig::new(g, PAGE, S_POOL_PAGES).scrub(scrub);
    let small_limits = AdmissionLimits::new(S_WINDOW, S_POOL_PAGES, PAGE);
    let (pl, dl) = t.connect(&tcfg).unwrap();
    let prefill_pool = KvPool::new(small).unwrap();
    let prefill = PrefillWorker::with_unvalidated_pool(
        pl,
        Model::cpu(w.clone()).unwrap(),
        prefill_pool.clone(),
        small_limits,
        tcfg.clone(),
    )
    .unwrap();
    let (decode_pool, limits) = if decode_too {
        (KvPool::new(small).unwrap(), small_limits)
    } else {
        let cfg = EngineConfig::decode(g)
            .max_context(S_WINDOW)
            .page_size(PAGE)
            .pool_tokens(2 * S_WINDOW)
            .build()
            .unwrap();
        let pool = KvPool::new(cfg.pool_config().scrub(scrub)).unwrap();
        (pool, AdmissionLimits::from_config(&cfg))
    };
    let decode = DecodeWorker::with_unvalidated_pool(
        dl,
        Model::cpu(w.clone()).unwrap(),
        decode_pool.clone(),
        limits,
        tcfg,
    )
    .unwrap()
    .with_idle_wait(Duration::from_millis(1));
    Scaled {
        prefill,
        decode,
        prefill_pool,
        decode_pool,
    }
}

impl<T: Transfer> Scaled<T> {
    fn submit(&mut self, req: Request) -> Tracked {
        let submitted = self.decode.submit(req.clone());
        Tracked::new(req, submitted)
    }

    /// Steps both workers (one thread) until every request has ended, then
    /// lets decode's last answers reach prefill.
    fn serve(&mut self, reqs: &mut [&mut Tracked]) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            for r in reqs.iter_mut() {
                r.drain();
            }
            if reqs.iter().all(|r| r.done()) {
                break;
            }
            assert!(Instant::now() < deadline, "a request never ended");
            self.prefill.step(Duration::from_millis(1)).unwrap();
            self.decode.step();
        }
        for _ in 0..20 {
            self.prefill.step(Duration::from_millis(2)).unwrap();
            self.decode.step();
        }
    }
}

/// True when no page of `pool` was ever handed out: reserving the whole
/// pool gives every page at its first generation.
fn never_allocated(pool: &KvPool) -> bool {
    let all = pool
        .reserve(RequestId(u64::MAX), pool.capacity() * pool.page_size())
        .unwrap();
    all.pages().iter().all(|p| p.generation() == 1)
}

fn oversized_is_rejected_on_both_sides<T: Transfer>(t: T) {
    let w = random_weights(&model(2 * S_WINDOW), 1155);
    let id = RequestId(155);
    let oversized = || Request::new(id, TENANT_B, prompt(9, OVERSIZED), 16);
    let want = Rejection::ExceedsPool {
        id,
        tokens: OVERSIZED,
        pool_tokens: S_POOL_TOKENS,
    };

    // Both pools at the published size: decode's admission refuses it.
    let mut s = scaled(&t, &w, TransferConfig::default(), true, ScrubPolicy::Zero);
    let mut b = s.submit(oversized());
    s.serve(&mut [&mut b]);
    assert_eq!(
        b.outcome,
        Some(Outcome::Rejected(want.clone())),
        "{}",
        t.name()
    );
    assert_eq!(want.http_status(), 413);
    assert!(b.tokens.is_empty(), "decode generated no token for it");
    assert_eq!(s.decode.side().stats().planned, 0, "no plan was sent");
    assert_eq!(s.prefill.side().stats().plans, 0);
    assert!(never_allocated(&s.decode_pool) && never_allocated(&s.prefill_pool));

    // Decode holds the window, prefill has the published pool: decode
    // admits and plans, prefill's admission refuses with a typed abort.
    let mut s = scaled(&t, &w, TransferConfig::default(), false, ScrubPolicy::Zero);
    let mut b = s.submit(oversized());
    s.serve(&mut [&mut b]);
    assert_eq!(b.outcome, Some(Outcome::Rejected(want)), "{}", t.name());
    assert!(b.tokens.is_empty(), "decode generated no token for it");
    let p = s.prefill.side();
    assert_eq!(
        (p.stats().plans, p.stats().aborted, p.stats().sent),
        (1, 1, 0)
    );
    assert_eq!(p.in_flight().peak, 0, "not one KV byte was sent");
    let d = s.decode.side();
    assert_eq!((d.stats().aborted, d.stats().verified), (1, 0));
    assert_eq!(d.landing().stray_writes() + d.landing().refused_writes(), 0);
    assert!(
        never_allocated(&s.prefill_pool),
        "prefill allocated nothing"
    );
    let ds = s.decode_pool.stats();
    assert!(ds.is_full(), "decode's reservation was released: {ds:?}");
}

#[test]
fn an_oversized_prompt_is_refused_at_admission_on_both_sides_in_process() {
    oversized_is_rejected_on_both_sides(InProcess);
}

#[test]
fn an_oversized_prompt_is_refused_at_admission_on_both_sides_over_tcp() {
    oversized_is_rejected_on_both_sides(Tcp);
}

/// Destination pages seen in receipts, per request.
type Seen = Arc<Mutex<Vec<(RequestId, Vec<PlannedPage>)>>>;

fn observe(seen: &Seen, id: RequestId) -> FaultRule {
    let seen = seen.clone();
    let f = move |r: &mut Receipt| seen.lock().push((r.request, r.pages.clone()));
    FaultRule::at(Step::ReceiptSent, Fault::EditReceipt(Arc::new(f))).for_request(id)
}

fn tenant_a_kv_never_reaches_tenant_b<T: Transfer>(t: T) {
    let w = random_weights(&model(2 * S_WINDOW), 2026);
    let a: Vec<Request> = [(11, 260), (12, 190), (13, 150)]
        .iter()
        .map(|&(id, len)| Request::new(RequestId(id), TENANT_A, prompt(id as u32, len), 8))
        .collect();
    let b_oversized = Request::new(RequestId(21), TENANT_B, prompt(21, OVERSIZED), 8);
    let b_placeholder = Request::new(RequestId(22), TENANT_B, prompt(22, 180), 8);
    let b_partial = Request::new(RequestId(23), TENANT_B, prompt(23, 180), 8);
    let b_honest = Request::new(RequestId(24), TENANT_B, prompt(24, 180), 8);
    let n_layers = w.config.n_layers;

    let seen: Seen = Arc::default();
    let mut plan = FaultPlan::new();
    for r in &a {
        plan = plan.with(observe(&seen, r.id));
    }
    // The forged receipt: "complete" for a one-token placeholder.
    let placeholder = {
        let seen = seen.clone();
        move |r: &mut Receipt| {
            seen.lock().push((r.request, r.pages.clone()));
            r.layer_tokens = vec![1; r.layer_tokens.len()];
            r.pages.truncate(1);
            r.page_checksums.truncate(1);
            r.writers = (0..r.layer_tokens.len() as u32)
                .map(|layer| WriterRun {
                    layer,
                    start: 0,
                    len: 1,
                    writer: r.request,
                })
                .collect();
        }
    };
    plan = plan
        .with(
            FaultRule::at(Step::ReceiptSent, Fault::EditReceipt(Arc::new(placeholder)))
                .for_request(b_placeholder.id),
        )
        // The other forgery: the receipt claims the whole prompt, but only
        // the first write batch of each layer was written.
        .with(
            FaultRule::at(Step::KvWriting, Fault::Drop)
                .for_request(b_partial.id)
                .skip(n_layers)
                .times(usize::MAX),
        )
        .with(observe(&seen, b_partial.id));
    let tcfg = TransferConfig::default()
        .with_max_batch_bytes(8 << 10)
        .with_faults(Arc::new(plan));
    // No scrubbing anywhere: released pages keep their bytes, as the
    // incident's did. Only verification and the audit trail stand between
    // tenant B and tenant A's KV.
    let mut s = scaled(&t, &w, tcfg, false, ScrubPolicy::AcceptStaleBytes);
    let mut want = pd::reference_in_window(&w, &a, S_WINDOW);
    want.extend(pd::reference_in_window(
        &w,
        std::slice::from_ref(&b_honest),
        S_WINDOW,
    ));

    // Tenant A's requests fill pages on both workers with their KV.
    let mut ta: Vec<Tracked> = a.iter().map(|r| s.submit(r.clone())).collect();
    s.serve(&mut ta.iter_mut().collect::<Vec<_>>());
    for (r, want) in ta.iter().zip(&want) {
        assert_eq!(r.judge(want), Ok("ok".into()), "{}", t.name());
    }
    let a_pages: Vec<u32> = seen
        .lock()
        .iter()
        .flat_map(|(_, p)| p.iter().map(|p| p.index))
        .collect();
    assert!(!a_pages.is_empty());

    // Tenant B's oversized prompt: refused by prefill's admission.
    let mut b1 = s.submit(b_oversized.clone());
    s.serve(&mut [&mut b1]);
    assert!(
        matches!(
            &b1.outcome,
            Some(Outcome::Rejected(Rejection::ExceedsPool {
                tokens: OVERSIZED,
                ..
            }))
        ),
        "{:?}",
        b1.outcome
    );
    assert!(b1.tokens.is_empty());

    // The placeholder receipt, then the partial one.
    let mut b2 = s.submit(b_placeholder.clone());
    s.serve(&mut [&mut b2]);
    let mut b3 = s.submit(b_partial.clone());
    s.serve(&mut [&mut b3]);
    for (b, name) in [(&b2, "placeholder"), (&b3, "partial")] {
        assert!(b.tokens.is_empty(), "{name}: a token of B was generated");
        let Some(Outcome::Failed(EngineError::Transfer(TransferError::Integrity(e)))) = &b.outcome
        else {
            panic!("{name}: expected an integrity failure, got {:?}", b.outcome);
        };
        assert_eq!(e.http_status(), 500);
        match (name, e) {
            (
                "placeholder",
                IntegrityError::LayerTokens {
                    claimed: 1,
                    planned: 180,
                    ..
                },
            ) => {}
            ("partial", IntegrityError::Incomplete { planned: 180, .. }) => {}
            _ => panic!("{name}: {e}"),
        }
    }
    // B's destinations were tenant A's former pages, A's bytes still in
    // them: the incident's precondition, here harmless.
    let b_pages: Vec<u32> = seen
        .lock()
        .iter()
        .filter(|(id, _)| *id == b_placeholder.id || *id == b_partial.id)
        .flat_map(|(_, p)| p.iter().map(|p| p.index))
        .collect();
    assert!(
        b_pages.iter().any(|p| a_pages.contains(p)),
        "B's destinations {b_pages:?} should reuse A's pages {a_pages:?}"
    );
    let d = s.decode.side().stats();
    assert_eq!((d.verified, d.integrity_failures, d.aborted), (3, 2, 1));

    // An honest request of tenant B on the same pages is served exactly.
    let mut b4 = s.submit(b_honest);
    s.serve(&mut [&mut b4]);
    assert_eq!(b4.judge(&want[3]), Ok("ok".into()));

    // The audit trail: no read of any slot by anyone but its writer, and
    // every page back.
    for (side, pool) in [("prefill", &s.prefill_pool), ("decode", &s.decode_pool)] {
        let st = pool.stats();
        assert_eq!(st.isolation_violations, 0, "{side}");
        assert!(st.is_full(), "{side} pool not full: {st:?}");
    }
    assert_eq!(s.prefill.side().held_transfers(), 0);
}

#[test]
fn tenant_a_kv_never_reaches_tenant_b_in_process() {
    tenant_a_kv_never_reaches_tenant_b(InProcess);
}

#[test]
fn tenant_a_kv_never_reaches_tenant_b_over_tcp() {
    tenant_a_kv_never_reaches_tenant_b(Tcp);
}
