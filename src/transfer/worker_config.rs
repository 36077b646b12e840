//! Checks shared by the prefill and decode workers.

use crate::backend::Backend;
use crate::config::{EngineConfig, Role};
use crate::engine::EngineError;
use crate::model::Model;

/// Refuses a configuration of the wrong role, or whose KV geometry or
/// context window does not fit the model.
pub(crate) fn check<B: Backend>(
    model: &Model<B>,
    cfg: &EngineConfig,
    role: Role,
) -> Result<(), EngineError> {
    if cfg.role() != role {
        return Err(EngineError::Role(cfg.role()));
    }
    let g = cfg.geometry();
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
    if cfg.max_context() > mc.max_seq_len {
        return Err(EngineError::ContextBeyondModel {
            max_context: cfg.max_context(),
            model_max: mc.max_seq_len,
        });
    }
    Ok(())
}
