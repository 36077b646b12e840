use crate::config::ConfigError;
use crate::http::HttpStatus;
use crate::kv::KvError;
use crate::model::ForwardError;
use crate::sampling::SamplingError;

/// Errors of the engine: refusing to build, or failing one request. A
/// request that fails produces no further tokens; other requests go on.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    #[error("configuration refused: {0}")]
    Config(#[from] ConfigError),
    #[error(
        "the configuration's KV geometry ({cfg_layers} layers, {cfg_kv_heads} KV heads of \
         {cfg_head_dim}) does not match the model's ({model_layers}, {model_kv_heads}, \
         {model_head_dim}): build it from model.kv_geometry()"
    )]
    Geometry {
        cfg_layers: usize,
        cfg_kv_heads: usize,
        cfg_head_dim: usize,
        model_layers: usize,
        model_kv_heads: usize,
        model_head_dim: usize,
    },
    #[error(
        "max_context {max_context} exceeds the model's trained length {model_max}: lower \
         max_context"
    )]
    ContextBeyondModel {
        max_context: usize,
        model_max: usize,
    },
    #[error("batch limits must allow at least one running sequence and one prefill token")]
    Limits,
    #[error("speculative decoding default: {0}")]
    Speculative(&'static str),
    /// A worker was given a pool that its configuration does not describe.
    #[error(
        "the pool given is not the configuration's (geometry, page size, pages, audit, scrub): \
         build it with KvPool::new(cfg.pool_config())"
    )]
    PoolMismatch,
    /// A worker was given a pool whose pages live where its backend does
    /// not compute (device pages for a host backend).
    #[error(
        "the pool given keeps its pages in {pool:?} memory, where this backend does not compute: \
         build the pool where the backend computes (KvPool::new for host memory)"
    )]
    PoolResidence { pool: crate::kv::Residence },
    /// A worker was given a pool whose pages something already holds.
    #[error(
        "the pool given has {in_use} pages in use and {held} held: give a worker a pool of its own"
    )]
    PoolInUse { in_use: usize, held: usize },
    /// A worker was given a pool another worker already took.
    #[error("the pool given already serves another worker: give each worker a pool of its own")]
    PoolClaimed,
    #[error("forward pass failed: {0}")]
    Forward(#[from] ForwardError),
    #[error("KV pages: {0}")]
    Kv(#[from] KvError),
    #[error("sampling failed: {0}")]
    Sampling(#[from] SamplingError),
    #[error("the engine shut down before the request finished: resubmit it")]
    Shutdown,
    #[error("KV transfer failed: {0}")]
    Transfer(#[from] crate::transfer::TransferError),
}

impl HttpStatus for EngineError {
    fn http_status(&self) -> u16 {
        match self {
            EngineError::Config(e) => e.http_status(),
            EngineError::Forward(e) => e.http_status(),
            EngineError::Kv(e) => e.http_status(),
            EngineError::Sampling(e) => e.http_status(),
            EngineError::Shutdown => 503,
            EngineError::Transfer(e) => e.http_status(),
            EngineError::Geometry { .. }
            | EngineError::ContextBeyondModel { .. }
            | EngineError::Limits
            | EngineError::Speculative(_)
            | EngineError::PoolMismatch
            | EngineError::PoolResidence { .. }
            | EngineError::PoolInUse { .. }
            | EngineError::PoolClaimed => 500,
        }
    }
}

impl From<crate::kv::PoolError> for EngineError {
    fn from(e: crate::kv::PoolError) -> Self {
        EngineError::Config(e.into())
    }
}
