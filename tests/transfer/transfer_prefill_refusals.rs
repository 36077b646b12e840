//! Story: prefill checks every plan against its own rules and refuses what
//! breaks one with an explicit, typed abort: never a receipt, never a
//! placeholder.
//!
//! The incident began with an engine that could not serve a prompt and
//! answered "transfer complete" for a one-token stand-in. Here each of
//! prefill's plan rules (an empty prompt, a token outside the model's
//! vocabulary, a plan for another model, a plan whose token count, geometry,
//! page size or page list do not add up) is broken on purpose, one at a time: by a raw peer that
//! sends the plan by hand, and where a real decode side can be led into
//! sending it, through that decode side. Each time prefill sends an abort
//! naming that rule and nothing else for the request, a bystander's plan on
//! the same link is served normally, the decode side ends the request with
//! the same typed reason and nothing to generate from, and both pools are
//! back to full with nothing held.

use crate::support;
use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff::model::ModelFingerprint;
use handoff::transfer::{
    Abort, AbortReason, Answer, DecodeLink, DecodeSide, Fault, FaultPlan, FaultRule, Nonce, Plan,
    PlannedPage, PrefillSide, Step, ToDecode, ToPrefill, Transfer, TransferConfig, TransferError,
    Verdict, Wait, synthetic,
};
use handoff::{
    AdmissionLimits, HttpStatus, KvDtype, KvGeometry, KvPool, PoolConfig, Rejection, Request,
    RequestId, SamplingParams, TenantId,
};
use support::{Rig, outcome_of, request};

const TARGET: RequestId = RequestId(10);
const BYSTANDER: RequestId = RequestId(20);
const PROMPT: usize = 40;
/// The vocabulary of the model prefill runs.
const VOCAB: usize = 64;
const PAGE: usize = 16;
const PAGES: usize = 32;
const WINDOW: usize = 256;
/// The model prefill serves (a raw side is told it, as a worker tells its own).
const PREFILL_MODEL: ModelFingerprint = ModelFingerprint::from_u64(0x5eed_0001);

fn geometry() -> KvGeometry {
    support::geometry(KvDtype::BF16)
}

fn prefill_limits() -> AdmissionLimits {
    AdmissionLimits::new(WINDOW, PAGES, PAGE).vocab(VOCAB)
}

// ---- A raw decode peer: plans written by hand -------------------------

/// A plan that breaks none of prefill's rules.
fn valid_plan(request: RequestId, tenant: u32, len: usize) -> Plan {
    Plan {
        request,
        tenant: TenantId(tenant),
        nonce: Nonce::fresh(),
        prompt: vec![1; len],
        tokens: len as u32,
        geometry: geometry(),
        page_size: PAGE as u32,
        pages: pages(len.div_ceil(PAGE)),
        sampling: SamplingParams::default(),
        model: Some(PREFILL_MODEL),
        peer: None,
        prefix_cache: true,
    }
}

fn pages(n: usize) -> Vec<PlannedPage> {
    (0..n as u32)
        .map(|index| PlannedPage {
            index,
            generation: 1,
        })
        .collect()
}

/// Every message prefill sends until `expected` holds of what arrived (or
/// [`support::DEADLINE`] passes), then for `quiet` more: anything prefill
/// should not have sent has had every chance to follow what it should.
fn drain<L: DecodeLink>(
    link: &mut L,
    expected: impl Fn(&[ToDecode]) -> bool,
    quiet: Duration,
) -> Vec<ToDecode> {
    let until = Instant::now() + support::DEADLINE;
    let mut out = Vec::new();
    while !expected(&out) && Instant::now() < until {
        if let Some(m) = link.recv(Duration::from_millis(20)).unwrap() {
            out.push(m);
        }
    }
    let until = Instant::now() + quiet;
    while Instant::now() < until {
        if let Some(m) = link.recv(Duration::from_millis(20)).unwrap() {
            out.push(m);
        }
    }
    out
}

/// A raw decode peer sends `bad`, then a bystander's valid plan, to a
/// prefill side whose model has `VOCAB` tokens. Checks that prefill
/// answered `bad` with one abort and nothing more, served the bystander on
/// the same link, and released everything; returns the abort's reason.
fn refused_by_prefill<T: Transfer>(t: T, bad: Plan) -> AbortReason {
    let cfg = TransferConfig::default().with_model(PREFILL_MODEL);
    let (prefill_link, mut decode) = t.connect(&cfg).unwrap();
    let pool = KvPool::new(PoolConfig::new(geometry(), PAGE, PAGES)).unwrap();
    let mut prefill = PrefillSide::new(prefill_link, pool.clone(), prefill_limits(), cfg);
    let (bad_request, bad_nonce) = (bad.request, bad.nonce);
    let bystander = valid_plan(BYSTANDER, 2, PROMPT + 7);
    let bystander_nonce = bystander.nonce;
    decode.send(ToPrefill::Plan(bad)).unwrap();
    decode.send(ToPrefill::Plan(bystander)).unwrap();

    // The refused plan becomes no job: the next one is the bystander's.
    let mut job = prefill.next_job_within(Duration::from_secs(5)).unwrap();
    assert_eq!(job.request(), BYSTANDER, "the refused plan got a job");
    synthetic::fill(job.seq_mut(), BYSTANDER, PROMPT + 7).unwrap();
    prefill.complete(job, Some(1)).unwrap();

    // The abort and the bystander's receipt are what prefill owes; once
    // both arrived, a further 200 ms gives any receipt for the refused plan
    // (or a second abort) its chance to show.
    let msgs = drain(
        &mut decode,
        |m| {
            let aborts = m.iter().filter(|m| matches!(m, ToDecode::Abort(_))).count();
            aborts >= 1 && m.len() > aborts
        },
        Duration::from_millis(200),
    );
    let (aborts, receipts): (Vec<_>, Vec<_>) = msgs
        .into_iter()
        .partition(|m| matches!(m, ToDecode::Abort(_)));
    assert_eq!(aborts.len(), 1, "exactly one abort: {aborts:?}");
    assert_eq!(receipts.len(), 1, "one receipt, the bystander's");
    let ToDecode::Receipt(receipt) = &receipts[0] else {
        unreachable!()
    };
    assert_eq!(
        (receipt.request, receipt.nonce),
        (BYSTANDER, bystander_nonce),
        "no receipt for the refused plan"
    );
    let ToDecode::Abort(Abort {
        request,
        nonce,
        reason,
    }) = aborts.into_iter().next().unwrap()
    else {
        unreachable!()
    };
    assert_eq!((request, nonce), (bad_request, bad_nonce));

    let stats = prefill.stats();
    assert_eq!((stats.plans, stats.aborted, stats.sent), (2, 1, 1));
    // Decode acks the bystander: prefill releases its source pages.
    decode
        .send(ToPrefill::Answer(Answer {
            request: BYSTANDER,
            nonce: bystander_nonce,
            verdict: Verdict::Ack,
        }))
        .unwrap();
    let until = Instant::now() + Duration::from_secs(5);
    while prefill.held_transfers() > 0 && Instant::now() < until {
        prefill.poll(Duration::from_millis(20)).unwrap();
    }
    assert!(
        prefill.link_error().is_none(),
        "the link survives a refusal"
    );
    assert_eq!(prefill.held_transfers(), 0);
    let s = pool.stats();
    assert!(s.is_full() && s.balanced(), "prefill pool: {s:?}");
    assert_eq!(s.isolation_violations, 0);
    reason
}

fn raw_empty_prompt<T: Transfer>(t: T) {
    let plan = valid_plan(TARGET, 1, 0);
    assert!(plan.prompt.is_empty() && plan.pages.is_empty() && plan.tokens == 0);
    assert_eq!(refused_by_prefill(t, plan), AbortReason::EmptyPrompt);
}

fn raw_plan_for_another_model<T: Transfer + Copy>(t: T) {
    // Decode serves other weights, or does not say which: prefill refuses
    // rather than hand over KV that another model computed.
    for planned in [Some(ModelFingerprint::from_u64(0x5eed_0002)), None] {
        let mut plan = valid_plan(TARGET, 1, PROMPT);
        plan.model = planned;
        let reason = refused_by_prefill(t, plan);
        assert_eq!(
            reason,
            AbortReason::ModelMismatch {
                planned,
                served: Some(PREFILL_MODEL)
            }
        );
        assert!(reason.to_string().contains("deploy the same weights"));
    }
}

fn raw_token_outside_the_vocabulary<T: Transfer + Copy>(t: T) {
    for token in [VOCAB as u32, u32::MAX] {
        let mut plan = valid_plan(TARGET, 1, PROMPT);
        plan.prompt[7] = token;
        assert_eq!(
            refused_by_prefill(t, plan),
            AbortReason::InvalidToken {
                index: 7,
                token,
                vocab: VOCAB as u64
            }
        );
    }
}

fn raw_malformed_plans<T: Transfer + Copy>(t: T) {
    type Break = fn(&mut Plan);
    let cases: [(&str, Break); 7] = [
        ("token count above the prompt", |p| {
            p.tokens += 1;
            p.pages = pages((p.tokens as usize).div_ceil(PAGE));
        }),
        ("token count below the prompt", |p| p.tokens -= 1),
        ("another geometry", |p| p.geometry.n_layers += 1),
        ("another dtype", |p| p.geometry.dtype = KvDtype::F16),
        ("page size zero", |p| p.page_size = 0),
        ("page size not a power of two", |p| {
            p.page_size = 24;
            p.pages = pages(PROMPT.div_ceil(24));
        }),
        ("one page short", |p| {
            p.pages.pop();
        }),
    ];
    for (what, break_it) in cases {
        let mut plan = valid_plan(TARGET, 1, PROMPT);
        break_it(&mut plan);
        assert_eq!(
            refused_by_prefill(t, plan),
            AbortReason::MalformedPlan,
            "{what}"
        );
    }
    let mut plan = valid_plan(TARGET, 1, PROMPT);
    plan.pages.push(PlannedPage {
        index: 99,
        generation: 1,
    });
    assert_eq!(
        refused_by_prefill(t, plan),
        AbortReason::MalformedPlan,
        "one page too many"
    );
}

// ---- Through a real decode side ---------------------------------------

/// A rig whose prefill runs a model of `VOCAB` tokens (decode admits any
/// token) and whose decode pool stores `decode_dtype`.
fn rig_with<T: Transfer>(t: &T, cfg: TransferConfig, decode_dtype: KvDtype) -> Rig<T> {
    let prefill_pool = KvPool::new(PoolConfig::new(geometry(), PAGE, PAGES)).unwrap();
    let decode_geometry = support::geometry(decode_dtype);
    let decode_pool = KvPool::new(PoolConfig::new(decode_geometry, PAGE, PAGES)).unwrap();
    let (pl, dl) = t.connect(&cfg).unwrap();
    Rig {
        prefill: PrefillSide::new(pl, prefill_pool.clone(), prefill_limits(), cfg.clone()),
        decode: DecodeSide::new(
            dl,
            decode_pool.clone(),
            AdmissionLimits::new(WINDOW, PAGES, PAGE),
            cfg,
        ),
        prefill_pool,
        decode_pool,
    }
}

/// The target's outcome after prefill handled its plan and served the
/// bystander; checks the bystander's KV, that the target got nothing to
/// generate from and no receipt, and that both pools are clean.
fn target_refused<T: Transfer>(mut rig: Rig<T>, target: Request) -> TransferError {
    let _ = rig.decode.submit(target).unwrap();
    let _ = rig
        .decode
        .submit(request(BYSTANDER.0, 2, PROMPT + 7))
        .unwrap();
    assert_eq!(rig.serve_one().unwrap(), BYSTANDER);
    let (target, rest) = outcome_of(rig.outcomes(2), TARGET);
    let (bystander, _) = outcome_of(rest, BYSTANDER);
    let verified = bystander.result.expect("the bystander is unaffected");
    assert_eq!(
        synthetic::check(&rig.decode_pool, verified.seq(), BYSTANDER).unwrap(),
        Ok(())
    );
    drop(verified);
    let err = target.result.expect_err("the refused request has no KV");
    // Anything late for the target would show up now.
    assert!(rig.decode.poll(Duration::from_millis(200)).is_empty());
    let (d, p) = (rig.decode.stats(), rig.prefill.stats());
    assert_eq!(d.verified, 1, "nothing verified for the target");
    assert_eq!(d.aborted, 1);
    assert_eq!(d.ignored_receipts, 0, "no receipt for the target, ever");
    assert_eq!((p.aborted, p.sent), (1, 1));
    rig.assert_clean();
    err
}

/// Prefill has no job to compute: its wait for a plan times out.
fn assert_no_job<T: Transfer>(rig: &mut Rig<T>) {
    let r = rig.prefill.next_job_within(Duration::from_millis(300));
    assert!(
        matches!(
            r,
            Err(TransferError::Timeout {
                waiting_for: Wait::Plan,
                ..
            })
        ),
        "{r:?}"
    );
}

fn token_outside_the_vocabulary_via_decode<T: Transfer>(t: T) {
    // Decode was configured without the model's vocabulary; prefill knows
    // it and refuses the plan.
    let rig = rig_with(&t, TransferConfig::default(), KvDtype::BF16);
    let mut target = request(TARGET.0, 1, PROMPT);
    target.prompt[17] = VOCAB as u32;
    let err = target_refused(rig, target);
    let reason = AbortReason::InvalidToken {
        index: 17,
        token: VOCAB as u32,
        vocab: VOCAB as u64,
    };
    assert_eq!(
        err,
        TransferError::Aborted {
            request: TARGET,
            reason
        }
    );
    assert_eq!(err.http_status(), 400);
}

fn truncated_plan_via_decode<T: Transfer>(t: T) {
    // The plan loses its last page on the way: the page list no longer
    // covers the prompt.
    let cfg =
        TransferConfig::default()
            .with_faults(Arc::new(FaultPlan::new().with(
                FaultRule::at(Step::PlanSent, Fault::Truncate).for_request(TARGET),
            )));
    let rig = rig_with(&t, cfg, KvDtype::BF16);
    let err = target_refused(rig, request(TARGET.0, 1, PROMPT));
    assert_eq!(
        err,
        TransferError::Aborted {
            request: TARGET,
            reason: AbortReason::MalformedPlan
        }
    );
    assert_eq!(err.http_status(), 500);
}

fn mismatched_kv_dtype_via_decode<T: Transfer>(t: T) {
    // A misconfigured pair: decode stores F16, prefill computes BF16.
    // Every plan is refused; nothing is converted or guessed.
    let mut rig = rig_with(&t, TransferConfig::default(), KvDtype::F16);
    let _ = rig.decode.submit(request(TARGET.0, 1, PROMPT)).unwrap();
    let _ = rig
        .decode
        .submit(request(BYSTANDER.0, 2, PROMPT + 7))
        .unwrap();
    // Prefill handles both plans without producing a job.
    assert_no_job(&mut rig);
    let outcomes = rig.outcomes(2);
    for id in [TARGET, BYSTANDER] {
        let o = outcomes.iter().find(|o| o.request == id).unwrap();
        let e = o.result.as_ref().expect_err("no KV for a mismatched pair");
        assert_eq!(
            e,
            &TransferError::Aborted {
                request: id,
                reason: AbortReason::MalformedPlan
            }
        );
    }
    drop(outcomes);
    assert_eq!(rig.decode.stats().verified, 0);
    assert_eq!(rig.decode.stats().ignored_receipts, 0);
    assert_eq!(
        (rig.prefill.stats().aborted, rig.prefill.stats().sent),
        (2, 0)
    );
    rig.assert_clean();
}

fn empty_prompt_via_decode<T: Transfer>(t: T) {
    // Decode refuses an empty prompt itself, before any page or plan.
    let mut rig = rig_with(&t, TransferConfig::default(), KvDtype::BF16);
    let before = rig.decode_pool.stats();
    let r = rig
        .decode
        .submit(Request::new(TARGET, TenantId(1), vec![], 4))
        .unwrap_err();
    assert_eq!(r, Rejection::EmptyPrompt { id: TARGET });
    assert_eq!(r.http_status(), 400);
    assert_eq!(rig.decode_pool.stats(), before, "nothing allocated");
    assert_no_job(&mut rig);
    assert_eq!(rig.prefill.stats().plans, 0, "no plan was sent");
    rig.assert_clean();
}

on_both_transports! {
    empty_prompt_plan_is_aborted_with_empty_prompt => raw_empty_prompt;
    token_outside_the_vocabulary_is_aborted_with_invalid_token => raw_token_outside_the_vocabulary;
    plan_for_another_model_is_aborted_with_model_mismatch => raw_plan_for_another_model;
    inconsistent_plans_are_aborted_as_malformed => raw_malformed_plans;
    decode_without_the_vocabulary_gets_prefills_invalid_token => token_outside_the_vocabulary_via_decode;
    plan_truncated_in_flight_is_refused_as_malformed => truncated_plan_via_decode;
    decode_and_prefill_with_different_kv_dtypes_refuse_every_plan => mismatched_kv_dtype_via_decode;
    empty_prompt_is_rejected_by_decode_before_any_plan => empty_prompt_via_decode;
}
