//! Story: eight tenants chat with one colocated engine behind the same long
//! system prompt, while a long document arrives among running chats.
//!
//! The engine's prefix cache (on by default) lets a tenant's later requests
//! start from the prompt pages its earlier ones computed, and never from
//! another tenant's: the same prompt from another tenant computes everything.
//! Chunked prefill (on by default) feeds the long document over several
//! steps, and the running chats stream a token in every one of them. Either
//! way, each request streams exactly what it streams on an engine with both
//! off; a request may opt out of the cache; cancelling a prompt halfway
//! through its prefill returns its pages; a cache full of idle pages never
//! turns away a request that fits the pool; and shutdown frees every cached
//! page.

use handoff::model::{Model, ModelConfig, random_weights};
use handoff::{
    BatchLimits, Colocated, Engine, EngineConfig, EngineOptions, Event, Headroom, KvDtype, Outcome,
    Request, RequestHandle, RequestId, SamplingParams, TenantId,
};

const PAGE: usize = 8;

fn model() -> Model {
    Model::cpu(random_weights(&ModelConfig::tiny_gqa(), 21)).unwrap()
}

fn cfg(m: &Model, pool_tokens: usize) -> EngineConfig<Colocated> {
    EngineConfig::colocated(m.kv_geometry(KvDtype::F32))
        .max_context(256)
        .page_size(PAGE)
        .pool_tokens(pool_tokens)
        .build()
        .unwrap()
}

fn engine(prefix_cache: bool, chunked_prefill: bool, step_tokens: usize) -> Engine {
    let m = model();
    let c = cfg(&m, 1024);
    let opts = EngineOptions {
        limits: BatchLimits {
            max_running: 16,
            max_prefill_tokens: step_tokens,
        },
        prefix_cache,
        chunked_prefill,
        speculative: None,
    };
    Engine::with_options(m, c, opts).unwrap()
}

/// A 60-token system prompt shared by everyone, then the user's turn.
fn prompt(user: u32) -> Vec<u32> {
    let mut p: Vec<u32> = (0..60).map(|i| (i * 7 + 3) % 200 + 1).collect();
    p.extend([user % 200 + 1, 5, 9, user % 50 + 2]);
    p
}

fn request(id: u64, tenant: u32, prompt: Vec<u32>, new: usize) -> Request {
    Request::new(RequestId(id), TenantId(tenant), prompt, new).with_sampling(SamplingParams {
        temperature: 0.8,
        top_k: None,
        top_p: Some(0.95),
        seed: id,
        stop_ids: vec![],
        logprobs: None,
    })
}

/// Runs `req` alone on `e` to the end; its tokens and outcome.
fn run(e: &mut Engine, req: Request) -> (Vec<u32>, Option<Outcome>) {
    let h = e.submit(req).unwrap();
    e.run_until_idle();
    h.try_collect()
}

#[test]
fn a_tenant_reuses_its_own_prefix_and_never_another_tenants() {
    let mut e = engine(true, true, 4096);
    let mut plain = engine(false, false, 4096);
    // Tenant 1 computes the system prompt's pages and publishes them.
    let first = request(1, 1, prompt(1), 6);
    let t = e.tally();
    assert_eq!(run(&mut e, first.clone()), run(&mut plain, first));
    assert_eq!(
        e.tally().reused_tokens,
        t.reused_tokens,
        "nothing to reuse yet"
    );
    let cached = e.pool_stats().cached;
    assert!(
        cached >= 60 / PAGE,
        "the prompt's full pages stay cached: {cached}"
    );

    // The same tenant's next turn starts from them: the 7 full pages before
    // the prompt's last token are leased, only the rest is computed.
    let before = e.tally();
    let second = request(2, 1, prompt(2), 6);
    assert_eq!(run(&mut e, second.clone()), run(&mut plain, second));
    let after = e.tally();
    assert_eq!(after.reused_tokens - before.reused_tokens, 56);
    assert_eq!(after.prefill_tokens - before.prefill_tokens, 64 - 56);

    // Another tenant with the very same prompt computes all of it.
    let before = e.tally();
    let other = request(3, 2, prompt(2), 6);
    assert_eq!(run(&mut e, other.clone()), run(&mut plain, other));
    let after = e.tally();
    assert_eq!(
        after.reused_tokens, before.reused_tokens,
        "cross-tenant hit"
    );
    assert_eq!(after.prefill_tokens - before.prefill_tokens, 64);

    let c = e.prefix_cache().expect("on by default").counters();
    assert!(c.hit_pages > 0 && c.missed_pages > 0, "{c:?}");
    let st = e.pool_stats();
    assert!(st.balanced() && st.is_full(), "{st:?}");
    assert_eq!(st.isolation_violations, 0);
    assert!(plain.prefix_cache().is_none());
    assert_eq!(plain.pool_stats().cached, 0);
    // Shutdown scrubs and frees the cached pages: no tenant's KV outlives
    // the engine's service.
    e.shutdown();
    let st = e.pool_stats();
    assert!(st.all_free(), "cached pages left after shutdown: {st:?}");
}

#[test]
fn eight_tenants_share_nothing_across_tenants_and_agree_with_no_cache() {
    let mut e = engine(true, true, 96);
    let mut plain = engine(false, false, 4096);
    let reqs: Vec<Request> = (0..32u64)
        .map(|i| request(100 + i, (i % 8) as u32, prompt(i as u32), 5))
        .collect();
    // All at once: batched prefill, chunks, hits from earlier steps.
    let handles: Vec<RequestHandle> = reqs.iter().map(|r| e.submit(r.clone()).unwrap()).collect();
    e.run_until_idle();
    for (r, h) in reqs.iter().zip(handles) {
        assert_eq!(h.try_collect(), run(&mut plain, r.clone()), "{}", r.id);
    }
    // Only later requests of a tenant can hit: every tenant's first
    // request computed its whole prompt.
    assert!(e.tally().reused_tokens > 0, "same-tenant requests hit");
    let st = e.pool_stats();
    assert!(st.balanced() && st.is_full(), "{st:?}");
    assert_eq!(
        st.isolation_violations, 0,
        "the audit saw no cross-tenant read"
    );
}

#[test]
fn a_request_that_opts_out_neither_reuses_nor_publishes() {
    let mut e = engine(true, true, 4096);
    let _ = run(&mut e, request(1, 1, prompt(1), 3));
    let cached = e.pool_stats().cached;
    let before = e.tally();
    let out = request(2, 1, prompt(1), 3).with_prefix_cache(false);
    let _ = run(&mut e, out);
    assert_eq!(e.tally().reused_tokens, before.reused_tokens);
    assert_eq!(e.tally().prefill_tokens - before.prefill_tokens, 64);
    assert_eq!(e.pool_stats().cached, cached, "it published nothing");
}

#[test]
fn a_long_prompt_is_prefilled_in_chunks_while_running_chats_stream_every_step() {
    let mut e = engine(true, true, 32);
    let mut plain = engine(false, false, 4096);
    let chats: Vec<Request> = (0..3)
        .map(|i| request(i, 7, vec![3, 4, 5 + i as u32], 40))
        .collect();
    let chat_handles: Vec<RequestHandle> =
        chats.iter().map(|r| e.submit(r.clone()).unwrap()).collect();
    let _ = e.step();
    assert_eq!(e.running(), 3);

    let doc: Vec<u32> = (0..200).map(|i| (i * 13 + 1) % 250 + 1).collect();
    let long = request(9, 8, doc, 4);
    let lh = e.submit(long.clone()).unwrap();
    let mut steps_prefilling = 0;
    loop {
        let r = e.step();
        if e.prefilling() == 0 {
            break;
        }
        steps_prefilling += 1;
        // Every chat streams its token in every step the document is
        // still being prefilled: 32 tokens a step, 3 of them decodes.
        assert_eq!(r.decoded, 3, "the decodes were stalled");
        assert!(r.prefill_tokens <= 32 - 3, "{r:?}");
    }
    assert!(
        steps_prefilling >= 5,
        "200 tokens over 29-token chunks: {steps_prefilling}"
    );
    e.run_until_idle();
    assert_eq!(
        lh.try_collect(),
        run(&mut plain, long),
        "chunked = unchunked"
    );
    for (r, h) in chats.iter().zip(chat_handles) {
        assert_eq!(h.try_collect(), run(&mut plain, r.clone()));
    }
    assert!(e.pool_stats().is_full());
}

#[test]
fn cancelling_a_prompt_halfway_through_its_prefill_returns_its_pages() {
    let mut e = engine(true, true, 24);
    let doc: Vec<u32> = (0..180).map(|i| (i * 5 + 2) % 250 + 1).collect();
    let h = e.submit(request(1, 1, doc, 4)).unwrap();
    let _ = e.step();
    let _ = e.step();
    assert_eq!(e.prefilling(), 1);
    assert!(e.pool_stats().in_use > 0);
    h.cancel();
    let r = e.step();
    assert_eq!(r.cancelled, 1);
    assert_eq!(e.prefilling(), 0);
    assert!(e.is_idle());
    let (tokens, outcome) = h.try_collect();
    assert!(tokens.is_empty());
    assert_eq!(outcome, Some(Outcome::Cancelled));
    let st = e.pool_stats();
    assert!(st.balanced() && st.is_full(), "{st:?}");
}

#[test]
fn a_cache_full_of_idle_pages_never_turns_away_a_request_that_fits() {
    // 16 pages of 8 tokens; each finished request leaves its full prompt
    // pages cached.
    let m = model();
    let c = EngineConfig::colocated(m.kv_geometry(KvDtype::F32))
        .max_context(128)
        .page_size(PAGE)
        .pool_tokens(128)
        .headroom(Headroom::new(1.0).unwrap())
        .build()
        .unwrap();
    let mut e = Engine::new(m, c).unwrap();
    for t in 0..4u32 {
        let p: Vec<u32> = (0..40).map(|i| (i + t * 40) % 250 + 1).collect();
        let (tokens, outcome) = run(&mut e, request(u64::from(t), t, p, 2));
        assert_eq!(tokens.len(), 2);
        assert!(matches!(outcome, Some(Outcome::Finished(_))));
    }
    let st = e.pool_stats();
    assert!(st.cached > 8 && st.cached == st.cached_idle, "{st:?}");
    // A prompt that needs the whole pool: the idle cached pages are
    // evicted for it, not counted against it.
    let big: Vec<u32> = (0..126).map(|i| (i * 3) % 250 + 1).collect();
    let h = e.submit(request(99, 9, big, 2)).unwrap();
    e.run_until_idle();
    let events: Vec<Event> = h.events().try_iter().collect();
    assert!(
        matches!(events.last(), Some(Event::Done(Outcome::Finished(_)))),
        "{events:?}"
    );
    let c = e.prefix_cache().unwrap().counters();
    assert!(c.evictions > 0, "{c:?}");
    let st = e.pool_stats();
    assert!(st.balanced() && st.is_full(), "{st:?}");
}
