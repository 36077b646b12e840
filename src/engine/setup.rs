//! Setup checks shared by the colocated engine and both disaggregated
//! workers: the configuration's role, its KV geometry and window against
//! the model, and a pool the host built.

use crate::backend::Backend;
use crate::config::{EngineConfig, RoleKind};
use crate::engine::EngineError;
use crate::kv::{KvPool, Residence};
use crate::model::Model;
use crate::sched::AdmissionLimits;

/// Refuses a configuration whose KV geometry or context window does not
/// fit the model. (Its role is its type: a server takes only its own.)
pub(crate) fn check<B: Backend, R: RoleKind>(
    model: &Model<B>,
    cfg: &EngineConfig<R>,
) -> Result<(), EngineError> {
    check_model(model, cfg.geometry(), cfg.max_context())
}

/// Refuses a model whose KV geometry is not `g` or whose trained length is
/// below the context window.
pub(crate) fn check_model<B: Backend>(
    model: &Model<B>,
    g: crate::kv::KvGeometry,
    max_context: usize,
) -> Result<(), EngineError> {
    let mc = model.config();
    if (g.n_layers, g.n_kv_heads, g.head_dim) != (mc.n_layers, mc.n_kv_heads, mc.head_dim) {
        return Err(EngineError::Geometry {
            cfg_layers: g.n_layers,
            cfg_kv_heads: g.n_kv_heads,
            cfg_head_dim: g.head_dim,
            model_layers: mc.n_layers,
            model_kv_heads: mc.n_kv_heads,
            model_head_dim: mc.head_dim,
        });
    }
    if max_context > mc.max_seq_len {
        return Err(EngineError::ContextBeyondModel {
            max_context,
            model_max: mc.max_seq_len,
        });
    }
    Ok(())
}

/// A new pool as `cfg` describes it, on `model`'s backend, once `cfg` fits
/// the model ([`check`]).
pub(crate) fn new_pool<B: Backend, R: RoleKind>(
    model: &Model<B>,
    cfg: &EngineConfig<R>,
) -> Result<KvPool, EngineError> {
    check(model, cfg)?;
    Ok(model.backend().new_pool(cfg.pool_config())?)
}

/// The admission limits of a worker for `model` under `cfg` over the
/// host-built `pool`, once `cfg` fits the model ([`check`]) and the pool is
/// the one `cfg` describes, free and unclaimed ([`check_pool`]); the pool
/// is then this worker's.
pub(crate) fn worker_limits<B: Backend, R: RoleKind>(
    model: &Model<B>,
    cfg: &EngineConfig<R>,
    pool: &KvPool,
) -> Result<AdmissionLimits, EngineError> {
    check(model, cfg)?;
    check_pool(cfg, pool, |r| model.backend().accepts_kv(r))?;
    Ok(AdmissionLimits::from_config(cfg).vocab(model.config().vocab_size))
}

/// Refuses a host-built `pool` that is not the pool `cfg` describes (scrub
/// policy included), whose pages live where the backend does not compute,
/// whose pages something already holds, or that another worker already
/// took; then takes it.
pub(crate) fn check_pool<R: RoleKind>(
    cfg: &EngineConfig<R>,
    pool: &KvPool,
    accepts: impl Fn(Residence) -> bool,
) -> Result<(), EngineError> {
    if *pool.config() != cfg.pool_config() {
        return Err(EngineError::PoolMismatch);
    }
    if !accepts(pool.residence()) {
        return Err(EngineError::PoolResidence {
            pool: pool.residence(),
        });
    }
    let s = pool.stats();
    if !s.is_full() {
        return Err(EngineError::PoolInUse {
            in_use: s.in_use,
            held: s.held,
        });
    }
    if !pool.claim() {
        return Err(EngineError::PoolClaimed);
    }
    Ok(())
}
