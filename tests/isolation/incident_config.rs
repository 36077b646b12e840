//! Incident, part 1: a 1,048,576-token context window was served from a
//! prefill KV pool of 681,280 tokens, and oversized prompts were silently
//! replaced by a one-token placeholder. handoff refuses the deployment, and
//! even a pool forced past configuration turns such a prompt away at
//! admission, before a single page is allocated.

use handoff::{
    AdmissionLimits, ConfigError, EngineConfig, Headroom, HttpStatus, KvDtype, KvGeometry, KvPool,
    PoolConfig, Rejection, Request, RequestId, Scheduler, TenantId,
};

const WINDOW: usize = 1_048_576;
const PUBLISHED_POOL: usize = 681_280;

/// Llama-3-70B-shaped KV (80 layers, 8 KV heads of 128, bf16).
fn geometry() -> KvGeometry {
    KvGeometry {
        n_layers: 80,
        n_kv_heads: 8,
        head_dim: 128,
        dtype: KvDtype::BF16,
    }
}

#[test]
fn the_published_deployment_does_not_start() {
    let err = EngineConfig::prefill(geometry())
        .max_context(WINDOW)
        .pool_tokens(PUBLISHED_POOL)
        .build()
        .unwrap_err();
    match &err {
        ConfigError::PoolCannotHoldWindow {
            pool_tokens,
            max_context,
            required_tokens,
            ..
        } => {
            assert_eq!(*pool_tokens, PUBLISHED_POOL);
            assert_eq!(*max_context, WINDOW);
            assert_eq!(*required_tokens, 2 * WINDOW);
        }
        other => panic!("wrong refusal: {other:?}"),
    }
    // The message names both numbers and the fix.
    let msg = err.to_string();
    assert!(msg.contains("681280") && msg.contains("1048576"), "{msg}");
    assert!(msg.contains("2097152"), "{msg}");
    // The operator's error: a server fault, like every refused setup.
    assert_eq!(err.http_status(), 500);
}

#[test]
fn even_the_minimum_headroom_refuses_the_published_pool() {
    let err = EngineConfig::prefill(geometry())
        .max_context(WINDOW)
        .pool_tokens(PUBLISHED_POOL)
        .headroom(Headroom::MIN)
        .build();
    assert!(matches!(err, Err(ConfigError::PoolCannotHoldWindow { .. })));
    // A decode pool needs one window; the published pool is short of it too.
    let err = EngineConfig::decode(geometry())
        .max_context(WINDOW)
        .pool_tokens(PUBLISHED_POOL)
        .build();
    assert!(matches!(err, Err(ConfigError::PoolCannotHoldWindow { .. })));
}

#[test]
fn a_pool_of_twice_the_window_is_accepted() {
    let cfg = EngineConfig::prefill(geometry())
        .max_context(WINDOW)
        .pool_tokens(2 * WINDOW)
        .build()
        .expect("2x headroom is the remediation's default");
    assert_eq!(cfg.pool_tokens(), 2 * WINDOW);
    assert_eq!(cfg.max_length_sequences(), 2);
}

#[test]
fn an_oversized_prompt_is_rejected_at_admission_with_nothing_allocated() {
    // Force the published pool past configuration, as a misconfigured
    // deployment would: admission still protects it.
    let page_size = 16;
    let pages = PUBLISHED_POOL / page_size;
    let tiny = KvGeometry {
        n_layers: 1,
        n_kv_heads: 1,
        head_dim: 1,
        dtype: KvDtype::F32,
    };
    let pool = KvPool::new(PoolConfig::new(tiny, page_size, pages)).unwrap();
    let mut sched = Scheduler::new(AdmissionLimits::new(WINDOW, pages, page_size));

    let prompt = vec![1u32; 700_000];
    let rejection = sched
        .submit(Request::new(RequestId(155), TenantId(2), prompt, 16))
        .unwrap_err();
    assert_eq!(
        rejection,
        Rejection::ExceedsPool {
            id: RequestId(155),
            tokens: 700_000,
            pool_tokens: PUBLISHED_POOL,
        }
    );
    assert_eq!(rejection.http_status(), 413);
    assert!(rejection.is_client_error());
    // Nothing queued, nothing allocated.
    assert_eq!(sched.waiting(), 0);
    assert_eq!(sched.live(), 0);
    assert!(pool.stats().is_full());
    // And the pool itself refuses the reservation with a typed error.
    assert!(matches!(
        pool.reserve(RequestId(155), 700_000),
        Err(handoff::KvError::NeverFits { .. })
    ));
    assert!(pool.stats().is_full());
}

#[test]
fn no_placeholder_path_exists_for_any_rejection() {
    let mut sched = Scheduler::new(AdmissionLimits::new(64, 8, 16).vocab(100));
    let cases = [
        (vec![], 4),          // empty
        (vec![1; 65], 1),     // longer than the window
        (vec![1; 60], 10),    // prompt + max_new > window
        (vec![1, 2, 100], 4), // token outside the vocabulary
        (vec![1, 2, 3], 0),   // nothing to generate
    ];
    for (i, (prompt, new)) in cases.into_iter().enumerate() {
        let r = sched.submit(Request::new(RequestId(i as u64), TenantId(1), prompt, new));
        let rej = r.expect_err("must be rejected");
        assert!(rej.is_client_error(), "{rej}");
        assert_eq!(rej.request_id(), RequestId(i as u64));
    }
    assert_eq!(sched.waiting(), 0);
}
