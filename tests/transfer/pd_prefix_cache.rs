//! Story: a tenant's chat goes through a disaggregated deployment turn after
//! turn, behind a long system prompt. The prefill worker keeps the full
//! prompt pages it computed in its tenant-scoped prefix cache (on by
//! default) and starts the tenant's next turn from them, computing only the
//! rest; it still sends the whole prompt's KV, every page under the receipt,
//! and decode verifies it as ever. Another tenant with the very same prompt
//! gets no page of it, and a request that opts out of the cache is computed
//! whole and leaves nothing in it. Every answer is the colocated engine's,
//! and both pools end full.

use crate::support;
use crate::support::pd;

use std::time::Instant;

use handoff::kv::CacheCounters;
use handoff::transfer::{Transfer, TransferConfig};
use handoff::{Outcome, Request, RequestId, TenantId};
use pd::Pair;

/// 40 shared tokens (five full pages of 8), then the turn's own.
fn prompt(turn: u32) -> Vec<u32> {
    let mut p: Vec<u32> = (0..40).map(|i| (i * 5 + 1) % 96 + 1).collect();
    p.extend([turn + 3, 7, turn + 11]);
    p
}

fn serve<T: Transfer>(pair: &mut Pair<T>, req: Request) -> Vec<u32> {
    let want = pd::reference(&pd::weights(), std::slice::from_ref(&req));
    let mut tracked = [pair.submit(req)];
    assert!(
        pair.run_until(&mut tracked, Instant::now() + support::DEADLINE),
        "the request did not end"
    );
    let [t] = tracked;
    assert!(
        matches!(t.outcome, Some(Outcome::Finished(_))),
        "{:?}",
        t.outcome
    );
    assert_eq!(t.tokens, want[0], "{}: not the colocated answer", t.req.id);
    t.tokens
}

fn reuse_only_within_the_tenant<T: Transfer>(t: T) {
    let w = pd::weights();
    let mut pair = Pair::start(&t, TransferConfig::default(), &w);
    let counters = |pair: &Pair<T>| -> CacheCounters { pair.prefill_pool.cache_counters() };

    let _ = serve(
        &mut pair,
        Request::new(RequestId(1), TenantId(1), prompt(1), 5),
    );
    let first = counters(&pair);
    assert_eq!(first.hit_pages, 0, "nothing cached before the first turn");
    assert!(
        first.published >= 5,
        "the prompt's full pages were kept: {first:?}"
    );

    // The tenant's next turn: the five system-prompt pages are reused.
    let _ = serve(
        &mut pair,
        Request::new(RequestId(2), TenantId(1), prompt(2), 5),
    );
    let second = counters(&pair);
    assert_eq!(second.hit_pages - first.hit_pages, 5, "{second:?}");

    // Another tenant, the very same prompt: no page of tenant 1's.
    let _ = serve(
        &mut pair,
        Request::new(RequestId(3), TenantId(2), prompt(2), 5),
    );
    let third = counters(&pair);
    assert_eq!(
        third.hit_pages, second.hit_pages,
        "a cross-tenant hit: {third:?}"
    );

    // The tenant's request that opts out: the plan carries its choice, and
    // prefill neither reuses nor publishes for it.
    let out = Request::new(RequestId(4), TenantId(1), prompt(4), 5).with_prefix_cache(false);
    let _ = serve(&mut pair, out);
    let fourth = counters(&pair);
    assert_eq!(
        (fourth.hit_pages, fourth.published, fourth.lookups),
        (third.hit_pages, third.published, third.lookups),
        "an opted-out request touched the cache: {fourth:?}"
    );

    pair.pools_return_to_full(support::DEADLINE).unwrap();
    let p = pair.prefill_pool.stats();
    assert!(p.cached > 0 && p.cached == p.cached_idle, "{p:?}");
    pair.stop().unwrap();
}

on_both_transports! {
    turns_reuse_the_tenants_prefix_and_only_its_own => reuse_only_within_the_tenant;
}
