//! Story: sizes at the edge of the address space.
//!
//! The incident began with a pool that could not hold its window and a
//! size nobody checked. Here every configuration, pool and request sized
//! near `usize::MAX` (or past 2^53, where an f64 stops counting tokens
//! exactly) gets a typed error or an empty answer: never a wrapped size, a
//! panic, or a pool smaller than it claims to be.

use handoff::{
    AdmissionLimits, ConfigError, EngineConfig, KvDtype, KvError, KvGeometry, KvPool, PoolConfig,
    PoolError, Request, RequestId, TenantId,
};

fn tiny(n_layers: usize) -> KvGeometry {
    KvGeometry {
        n_layers,
        n_kv_heads: 1,
        head_dim: 2,
        dtype: KvDtype::F16,
    }
}

#[test]
fn a_page_whose_size_wraps_is_refused_not_built_small() {
    // 4 layers x 2 (K, V) x 2^61 slots x 2 elements wraps to 0 elements a
    // page; built, it would hand out a 1-byte arena for 2^61 tokens.
    let pool = KvPool::new(PoolConfig::new(tiny(4), 1 << 61, 1).audit(false));
    assert!(matches!(pool, Err(PoolError::Overflow { .. })), "{pool:?}");
    let cfg = EngineConfig::decode(tiny(4))
        .max_context(1 << 61)
        .page_size(1 << 61)
        .pool_tokens(1 << 61)
        .build();
    assert!(matches!(cfg, Err(ConfigError::Overflow { .. })), "{cfg:?}");
}

#[test]
fn a_window_of_usize_max_is_refused_with_the_pool_it_would_need() {
    let cfg = EngineConfig::decode(tiny(1))
        .max_context(usize::MAX)
        .pool_tokens(16)
        .build();
    assert!(
        matches!(cfg, Err(ConfigError::PoolCannotHoldWindow { .. })),
        "{cfg:?}"
    );
}

#[test]
fn the_window_check_counts_every_token_past_2_pow_53() {
    // 2^53 + 1 tokens of window in pages of 2^22: 2^31 + 1 pages. A pool
    // of 2^53 tokens (2^31 pages) is one page short; an f64 product rounds
    // the window down to 2^53 and would accept it.
    let window = (1usize << 53) + 1;
    let build = |pool_tokens| {
        EngineConfig::decode(tiny(1))
            .max_context(window)
            .page_size(1 << 22)
            .pool_tokens(pool_tokens)
            .build()
    };
    let short = build(1 << 53);
    assert!(
        matches!(short, Err(ConfigError::PoolCannotHoldWindow { .. })),
        "{short:?}"
    );
    assert!(build((1 << 53) + (1 << 22)).is_ok());
    // Twice the window for a prefill pool: 2^54 + 2 tokens, one page more
    // than 2^54.
    let short = EngineConfig::prefill(tiny(1))
        .max_context(window)
        .page_size(1 << 23)
        .pool_tokens(1 << 54)
        .build();
    assert!(
        matches!(short, Err(ConfigError::PoolCannotHoldWindow { .. })),
        "{short:?}"
    );
}

#[test]
fn requests_for_usize_max_tokens_get_typed_errors() {
    let pool = KvPool::new(PoolConfig::new(tiny(1), 16, 4)).unwrap();
    assert!(matches!(
        pool.reserve(RequestId(1), usize::MAX),
        Err(KvError::NeverFits { .. })
    ));
    let mut seq = pool.reserve(RequestId(2), 16).unwrap();
    seq.append(0, &[1.0, 2.0], &[3.0, 4.0]).unwrap();
    assert!(matches!(
        seq.grow(usize::MAX),
        Err(KvError::NeverFits { .. })
    ));
    assert_eq!(seq.pages().len(), 1, "nothing grew");
    {
        let reader = pool.reader();
        let view = reader.seq(&seq).unwrap();
        let layer = view.layer(0).unwrap();
        assert!(layer.keys(usize::MAX).is_empty());
        assert_eq!(layer.tokens_in_page(usize::MAX), 0);
    }
    drop(seq);
    assert!(pool.stats().is_full());
    // Limits for a pool of usize::MAX pages saturate, they do not wrap.
    let limits = AdmissionLimits::new(64, usize::MAX, 16);
    assert_eq!(limits.pool_tokens(), usize::MAX);
    let req = Request::new(RequestId(3), TenantId(1), vec![1; 8], 8);
    assert!(limits.check(&req).is_ok());
}

#[test]
fn an_audit_trail_that_cannot_exist_is_refused() {
    // 2^60 slots of one layer of one f16 element: the arena would be 2^62
    // bytes (lazily zeroed, allowed), the audit trail 2^63, past what one
    // allocation may be.
    let g = KvGeometry {
        n_layers: 1,
        n_kv_heads: 1,
        head_dim: 1,
        dtype: KvDtype::F16,
    };
    let pool = KvPool::new(PoolConfig::new(g, 1 << 30, 1 << 30).audit(true));
    assert!(matches!(pool, Err(PoolError::Overflow { .. })), "{pool:?}");
}

#[test]
fn a_pool_larger_than_memory_is_a_typed_error_not_an_abort() {
    // 8 MiB of KV per token, 2^30 tokens: 2^53 bytes, more than any
    // address space here. The deployment is refused; the process lives.
    let g = KvGeometry {
        n_layers: 64,
        n_kv_heads: 64,
        head_dim: 256,
        dtype: KvDtype::F32,
    };
    let pool = KvPool::new(PoolConfig::new(g, 1024, 1 << 20).audit(false));
    match pool {
        Err(e @ PoolError::OutOfMemory { bytes }) => {
            assert_eq!(bytes, 1 << 53);
            assert_eq!(handoff::HttpStatus::http_status(&e), 503);
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
}
