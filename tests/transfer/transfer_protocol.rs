//! Story: a receipt is trusted only after it is verified against the plan
//! and the bytes that landed.
//!
//! In the incident, a decode node accepted "transfer complete" for a
//! one-token placeholder and decoded on pages holding other users' KV. Here
//! every rule the verifier checks a receipt against is broken on purpose,
//! one at a time, and a write refused at the landing zone fails its
//! transfer too (each landing rule has its own unit test in
//! `src/transfer/link/landing.rs`), while a bystander request from another
//! tenant transfers alongside. Each
//! time: the broken transfer ends in its typed error (HTTP 500), decode gets
//! nothing to generate from (no verified KV), the bystander's KV arrives
//! intact, and both pools return to full capacity with nothing held.

use crate::support;
use std::sync::Arc;
use std::time::Duration;

use handoff::transfer::{
    Fault, FaultPlan, FaultRule, IntegrityError, Nonce, PrefillLink, Receipt, Step, ToDecode,
    Transfer, TransferConfig, TransferError, WriteRefusal, synthetic,
};
use handoff::{HttpStatus, RequestId};
use support::{Rig, RigSpec, outcome_of, request, rig};

const TARGET: RequestId = RequestId(10);
const BYSTANDER: RequestId = RequestId(20);
const PROMPT: usize = 40;

fn edit(f: impl Fn(&mut Receipt) + Send + Sync + 'static) -> FaultRule {
    FaultRule::at(Step::ReceiptSent, Fault::EditReceipt(Arc::new(f))).for_request(TARGET)
}

/// Runs the target and a bystander through a link with `rule` injected;
/// returns the target's error and the rig, after checking the bystander.
fn break_one_rule<T: Transfer>(t: T, rule: FaultRule) -> (IntegrityError, Rig<T>) {
    break_with(t, TransferConfig::default(), rule)
}

fn break_with<T: Transfer>(t: T, cfg: TransferConfig, rule: FaultRule) -> (IntegrityError, Rig<T>) {
    let cfg = cfg.with_faults(Arc::new(FaultPlan::new().with(rule)));
    let mut rig = rig(&t, cfg, RigSpec::default());
    let _ = rig.decode.submit(request(TARGET.0, 1, PROMPT)).unwrap();
    let _ = rig
        .decode
        .submit(request(BYSTANDER.0, 2, PROMPT + 7))
        .unwrap();
    rig.serve_one().unwrap();
    rig.serve_one().unwrap();
    let (target, rest) = outcome_of(rig.outcomes(2), TARGET);
    let (bystander, _) = outcome_of(rest, BYSTANDER);

    let verified = bystander
        .result
        .expect("the bystander's transfer is unaffected");
    assert_eq!(
        synthetic::check(&rig.decode_pool, verified.seq(), BYSTANDER).unwrap(),
        Ok(()),
        "the bystander's KV is its own, byte for byte"
    );
    drop(verified);

    let err = target.result.expect_err("the broken transfer must fail");
    assert_eq!(err.http_status(), 500);
    let stats = rig.decode.stats();
    assert_eq!(
        stats.verified, 1,
        "nothing verified for the target: zero tokens can be generated"
    );
    assert_eq!(stats.integrity_failures, 1);
    rig.assert_clean();
    match err {
        TransferError::Integrity(e) => (e, rig),
        other => panic!("expected an integrity error, got {other:?}"),
    }
}

fn wrong_nonce<T: Transfer>(t: T) {
    if t.name() == "tcp" {
        // An unauthenticated peer (TCP without identities) cannot end a
        // transfer with a nonce decode never issued: the receipt is ignored
        // and counted, never applied, and the target, whose only receipt it
        // was, times out (both ways: tests/transfer_auth.rs).
        let cfg = TransferConfig::default()
            .with_receipt_timeout(Duration::from_millis(500))
            .with_faults(Arc::new(
                FaultPlan::new().with(edit(|r| r.nonce = Nonce(r.nonce.0 ^ 0x5eed))),
            ));
        let mut rig = rig(&t, cfg, RigSpec::default());
        let _ = rig.decode.submit(request(TARGET.0, 1, PROMPT)).unwrap();
        rig.serve_one().unwrap();
        let (target, _) = outcome_of(rig.outcomes(1), TARGET);
        let err = target
            .result
            .expect_err("no receipt for the target verifies");
        assert!(matches!(err, TransferError::Timeout { .. }), "{err}");
        assert_eq!(err.http_status(), 504);
        let stats = rig.decode.stats();
        assert_eq!((stats.ignored_receipts, stats.verified), (1, 0));
        rig.assert_clean();
        return;
    }
    let (e, _) = break_one_rule(t, edit(|r| r.nonce = Nonce(r.nonce.0 ^ 0x5eed)));
    assert!(
        matches!(e, IntegrityError::NonceMismatch { request, .. } if request == TARGET),
        "{e}"
    );
}

fn wrong_request<T: Transfer>(t: T) {
    // The target's receipt names the bystander: it fails the transfer it
    // came with and is never applied to the bystander's pages.
    let (e, _) = break_one_rule(t, edit(|r| r.request = BYSTANDER));
    assert!(
        matches!(e, IntegrityError::RequestMismatch { planned, got, .. } if planned == TARGET && got == BYSTANDER),
        "{e}"
    );
}

fn short_layer_counts<T: Transfer>(t: T) {
    let (e, _) = break_one_rule(t, edit(|r| r.layer_tokens.iter_mut().for_each(|c| *c -= 1)));
    assert!(
        matches!(e, IntegrityError::LayerTokens { layer: 0, claimed, planned, .. } if claimed + 1 == planned),
        "{e}"
    );
}

fn missing_layer_count<T: Transfer>(t: T) {
    let (e, _) = break_one_rule(
        t,
        edit(|r| {
            r.layer_tokens.pop();
        }),
    );
    assert!(
        matches!(
            e,
            IntegrityError::LayerCountLen {
                planned: 3,
                got: 2,
                ..
            }
        ),
        "{e}"
    );
}

fn one_layer_claimed_short<T: Transfer>(t: T) {
    let (e, _) = break_one_rule(
        t,
        edit(|r| {
            if let Some(last) = r.layer_tokens.last_mut() {
                *last = 1; // the placeholder's one token
            }
        }),
    );
    assert!(
        matches!(
            e,
            IntegrityError::LayerTokens {
                layer: 2,
                claimed: 1,
                ..
            }
        ),
        "{e}"
    );
}

fn one_layer_lost_while_receipt_claims_all<T: Transfer>(t: T) {
    // One batch per layer: dropping the third write loses the last layer,
    // yet the receipt claims every layer complete.
    let rule = FaultRule::at(Step::KvWriting, Fault::Drop)
        .for_request(TARGET)
        .skip(2);
    let (e, _) = break_one_rule(t, rule);
    assert!(
        matches!(e, IntegrityError::Incomplete { layer: 2, landed: 0, planned, .. } if planned == PROMPT),
        "{e}"
    );
}

fn wrong_page_generation<T: Transfer>(t: T) {
    let (e, _) = break_one_rule(t, edit(|r| r.pages[1].generation += 1));
    assert!(
        matches!(e, IntegrityError::PageMismatch { position: 1, .. }),
        "{e}"
    );
}

fn corrupted_kv_bytes<T: Transfer>(t: T) {
    let rule = FaultRule::at(Step::KvWriting, Fault::Corrupt).for_request(TARGET);
    let (e, _) = break_one_rule(t, rule);
    assert!(
        matches!(e, IntegrityError::ChecksumMismatch { position: 0, .. }),
        "{e}"
    );
}

fn corrupted_receipt_checksum<T: Transfer>(t: T) {
    let rule = FaultRule::at(Step::ReceiptSent, Fault::Corrupt).for_request(TARGET);
    let (e, _) = break_one_rule(t, rule);
    assert!(
        matches!(e, IntegrityError::ChecksumMismatch { position: 0, .. }),
        "{e}"
    );
}

fn missing_page_checksum<T: Transfer>(t: T) {
    let (e, _) = break_one_rule(
        t,
        edit(|r| {
            r.page_checksums.pop();
        }),
    );
    assert!(
        matches!(e, IntegrityError::ChecksumCount { planned, got, .. } if got + 1 == planned),
        "{e}"
    );
}

fn duplicated_write<T: Transfer>(t: T) {
    // The second copy of a batch starts where the first ended: refused, and
    // the transfer fails rather than trusting either.
    let rule = FaultRule::at(Step::KvWriting, Fault::Duplicate).for_request(TARGET);
    let (e, _) = break_one_rule(t, rule);
    assert!(
        matches!(
            e,
            IntegrityError::WriteRefused {
                reason: WriteRefusal::OutOfOrder {
                    layer: 0,
                    start: 0,
                    expected: PROMPT
                },
                ..
            }
        ),
        "{e}"
    );
}

fn reordered_across_layers<T: Transfer>(t: T) {
    // Batches of different layers are independent: swapping two of them
    // breaks no rule, and the KV that lands is exactly the request's own.
    let cfg = TransferConfig::default()
        .with_max_batch_bytes(1024)
        .with_faults(Arc::new(
            FaultPlan::new().with(
                FaultRule::at(Step::KvWriting, Fault::Reorder)
                    .for_request(TARGET)
                    .times(3),
            ),
        ));
    let mut rig = rig(&t, cfg, RigSpec::default());
    let _ = rig.decode.submit(request(TARGET.0, 1, PROMPT)).unwrap();
    rig.serve_one().unwrap();
    let (o, _) = outcome_of(rig.outcomes(1), TARGET);
    let v = o.result.unwrap();
    assert_eq!(
        synthetic::check(&rig.decode_pool, v.seq(), TARGET).unwrap(),
        Ok(())
    );
    drop(v);
    rig.assert_clean();
}

fn forged_writer_trail<T: Transfer>(t: T) {
    let (e, _) = break_one_rule(t, edit(|r| r.writers[1].writer = BYSTANDER));
    assert!(matches!(e, IntegrityError::WriterMismatch { .. }), "{e}");
}

fn duplicate_receipt<T: Transfer>(t: T) {
    let cfg = TransferConfig::default()
        .with_faults(Arc::new(FaultPlan::new().with(
            FaultRule::at(Step::ReceiptSent, Fault::Duplicate).for_request(TARGET),
        )));
    let mut rig = rig(&t, cfg, RigSpec::default());
    let _ = rig.decode.submit(request(TARGET.0, 1, PROMPT)).unwrap();
    rig.serve_one().unwrap();
    let mut outcomes = rig.outcomes(1);
    // Give the duplicate time to arrive.
    outcomes.extend(rig.decode.poll(Duration::from_millis(200)));
    let (target, _) = outcome_of(outcomes, TARGET);
    let verified = target.result.expect("the first receipt verifies");
    assert_eq!(
        rig.decode.stats().ignored_receipts,
        1,
        "the duplicate is ignored and counted"
    );
    assert_eq!(rig.decode.stats().verified, 1, "and verifies nothing twice");
    assert_eq!(
        synthetic::check(&rig.decode_pool, verified.seq(), TARGET).unwrap(),
        Ok(())
    );
    drop(verified);
    rig.assert_clean();
}

fn receipt_after_cancel<T: Transfer>(t: T) {
    let mut rig = rig(&t, TransferConfig::default(), RigSpec::default());
    let _ = rig.decode.submit(request(TARGET.0, 1, PROMPT)).unwrap();
    let _ = rig.decode.submit(request(BYSTANDER.0, 2, PROMPT)).unwrap();
    let mut job = rig.prefill.next_job_within(Duration::from_secs(5)).unwrap();
    assert_eq!(job.request(), TARGET);
    // The client goes away while prefill computes.
    assert_eq!(
        rig.decode.cancel(TARGET),
        handoff::transfer::CancelOutcome::Fenced
    );
    assert_eq!(
        rig.decode.cancel(TARGET),
        handoff::transfer::CancelOutcome::NotLive,
        "cancel is idempotent"
    );
    assert!(rig.decode_pool.stats().in_use < 2 * rig.decode_pool.pages_for(PROMPT + 4) + 1);
    // Prefill has not seen the cancel yet: it sends KV and a receipt.
    synthetic::fill(job.seq_mut(), TARGET, PROMPT).unwrap();
    rig.prefill.complete(job, None).unwrap();
    rig.serve_one().unwrap();
    let (bystander, rest) = outcome_of(rig.outcomes(1), BYSTANDER);
    assert!(
        rest.is_empty(),
        "no outcome for the cancelled request: {rest:?}"
    );
    let verified = bystander.result.unwrap();
    assert_eq!(
        synthetic::check(&rig.decode_pool, verified.seq(), BYSTANDER).unwrap(),
        Ok(())
    );
    drop(verified);
    let stats = rig.decode.stats();
    assert_eq!(
        stats.ignored_receipts, 1,
        "the late receipt is ignored and counted"
    );
    assert_eq!(stats.verified, 1);
    assert_eq!(stats.cancelled, 1);
    assert!(
        rig.decode.landing().stray_writes() > 0,
        "its writes found no destination and landed nowhere"
    );
    rig.assert_clean();
}

fn receipt_for_unknown_request<T: Transfer>(t: T) {
    // A peer that forges a receipt for a request decode never planned,
    // while a real request waits for its KV.
    let cfg = TransferConfig::default().with_receipt_timeout(Duration::from_millis(300));
    let (mut prefill_link, decode_link) = t.connect(&cfg).unwrap();
    let g = support::geometry(handoff::KvDtype::BF16);
    let decode_pool = handoff::KvPool::new(handoff::PoolConfig::new(g, 16, 32)).unwrap();
    let mut decode = handoff::transfer::DecodeSide::new(
        decode_link,
        decode_pool.clone(),
        handoff::AdmissionLimits::new(256, 32, 16),
        cfg,
    );
    let _ = decode.submit(request(TARGET.0, 1, PROMPT)).unwrap();
    let plan = match prefill_link.recv(Duration::from_secs(5)).unwrap() {
        Some(handoff::transfer::ToPrefill::Plan(p)) => p,
        other => panic!("expected a plan, got {other:?}"),
    };
    prefill_link
        .send(ToDecode::Receipt(Receipt {
            request: RequestId(999),
            nonce: Nonce(plan.nonce.0.wrapping_add(1)),
            layer_tokens: vec![1; g.n_layers],
            pages: plan.pages.clone(),
            page_checksums: vec![0; plan.pages.len()],
            writers: vec![],
            first_token: Some(7),
            first_logprobs: None,
        }))
        .unwrap();
    let mut outcomes = Vec::new();
    while outcomes.is_empty() {
        outcomes = decode.poll(Duration::from_secs(2));
    }
    assert_eq!(decode.stats().ignored_receipts, 1, "ignored and counted");
    let (target, _) = outcome_of(outcomes, TARGET);
    let err = target
        .result
        .expect_err("the forged receipt is not applied to the live request");
    assert!(matches!(
        err,
        TransferError::Timeout {
            waiting_for: handoff::transfer::Wait::Receipt,
            ..
        }
    ));
    assert_eq!(err.http_status(), 504);
    assert_eq!(decode.stats().verified, 0);
    assert!(decode_pool.stats().is_full());
}

on_both_transports! {
    wrong_nonce_fails_the_transfer => wrong_nonce;
    receipt_naming_another_request_fails_only_its_own_transfer => wrong_request;
    short_layer_counts_fail => short_layer_counts;
    missing_layer_count_fails => missing_layer_count;
    one_layer_claimed_short_while_others_complete_fails => one_layer_claimed_short;
    one_layer_lost_while_receipt_claims_all_fails => one_layer_lost_while_receipt_claims_all;
    wrong_page_generation_fails => wrong_page_generation;
    corrupted_kv_bytes_fail_the_checksum => corrupted_kv_bytes;
    corrupted_receipt_checksum_fails => corrupted_receipt_checksum;
    a_receipt_short_of_one_page_checksum_fails => missing_page_checksum;
    duplicated_write_is_refused => duplicated_write;
    reordered_writes_across_layers_still_verify => reordered_across_layers;
    forged_writer_trail_fails => forged_writer_trail;
    duplicate_receipt_is_ignored_and_counted => duplicate_receipt;
    receipt_after_cancel_is_ignored_and_counted => receipt_after_cancel;
    receipt_for_unknown_request_is_ignored_and_counted => receipt_for_unknown_request;
}
