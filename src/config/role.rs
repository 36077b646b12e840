//! Roles as types. A configuration is built for one role and only the server
//! of that role accepts it: `Engine::new` takes an [`EngineConfig`]`<Colocated>`,
//! `PrefillWorker` an `EngineConfig<Prefill>`, `DecodeWorker` an
//! `EngineConfig<Decode>`. Handing a worker the wrong one is a compile error:
//!
//! ```compile_fail
//! use handoff::model::{Model, ModelConfig, random_weights};
//! use handoff::{EngineConfig, Engine, KvDtype};
//! let model = Model::cpu(random_weights(&ModelConfig::tiny_gqa(), 7)).unwrap();
//! let decode_cfg = EngineConfig::decode(model.kv_geometry(KvDtype::F32))
//!     .max_context(64).pool_tokens(64).build().unwrap();
//! let engine = Engine::new(model, decode_cfg); // a decode config for a colocated engine
//! ```
//!
//! ```compile_fail
//! use handoff::model::{Model, ModelConfig, random_weights};
//! use handoff::transfer::{InProcess, Transfer, TransferConfig};
//! use handoff::{EngineConfig, KvDtype, PrefillWorker};
//! let model = Model::cpu(random_weights(&ModelConfig::tiny_gqa(), 7)).unwrap();
//! let decode_cfg = EngineConfig::decode(model.kv_geometry(KvDtype::F32))
//!     .max_context(64).pool_tokens(64).build().unwrap();
//! let t = TransferConfig::default();
//! let (p, _d) = InProcess.connect(&t).unwrap();
//! let prefill = PrefillWorker::new(p, model, decode_cfg, t); // a decode config for prefill
//! ```
//!
//! ```compile_fail
//! use handoff::model::{Model, ModelConfig, random_weights};
//! use handoff::transfer::{InProcess, Transfer, TransferConfig};
//! use handoff::{DecodeWorker, EngineConfig, KvDtype};
//! let model = Model::cpu(random_weights(&ModelConfig::tiny_gqa(), 7)).unwrap();
//! let colocated = EngineConfig::colocated(model.kv_geometry(KvDtype::F32))
//!     .max_context(64).pool_tokens(128).build().unwrap();
//! let t = TransferConfig::default();
//! let (_p, d) = InProcess.connect(&t).unwrap();
//! let decode = DecodeWorker::new(d, model, colocated, t); // a colocated config for decode
//! ```
//!
//! The same lines with the right configuration compile and run:
//!
//! ```
//! use handoff::model::{Model, ModelConfig, random_weights};
//! use handoff::transfer::{InProcess, Transfer, TransferConfig};
//! use handoff::{DecodeWorker, EngineConfig, KvDtype, PrefillWorker};
//! let model = || Model::cpu(random_weights(&ModelConfig::tiny_gqa(), 7)).unwrap();
//! let g = model().kv_geometry(KvDtype::F32);
//! let t = TransferConfig::default();
//! let (p, d) = InProcess.connect(&t).unwrap();
//! let prefill_cfg = EngineConfig::prefill(g).max_context(64).pool_tokens(128).build().unwrap();
//! let decode_cfg = EngineConfig::decode(g).max_context(64).pool_tokens(64).build().unwrap();
//! let _prefill = PrefillWorker::new(p, model(), prefill_cfg, t.clone()).unwrap();
//! let _decode = DecodeWorker::new(d, model(), decode_cfg, t).unwrap();
//! ```
//!
//! [`EngineConfig`]: crate::EngineConfig

use std::fmt::Debug;

use super::Role;

mod sealed {
    pub trait Sealed {}
}

/// A role a configuration can be built for: [`Colocated`], [`Prefill`] or
/// [`Decode`]. Sealed: the fail-closed sizing rules exist for these three.
pub trait RoleKind: sealed::Sealed + Copy + Debug + PartialEq + Send + Sync + 'static {
    /// The role as a value (for errors and logs).
    const ROLE: Role;
}

/// Prefill and decode in one engine, one pool (the engine layer's `Engine`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Colocated;
/// Computes prompts' KV and sends it to a decode worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Prefill;
/// Receives verified KV and generates from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Decode;

impl sealed::Sealed for Colocated {}
impl sealed::Sealed for Prefill {}
impl sealed::Sealed for Decode {}

impl RoleKind for Colocated {
    const ROLE: Role = Role::Colocated;
}
impl RoleKind for Prefill {
    const ROLE: Role = Role::Prefill;
}
impl RoleKind for Decode {
    const ROLE: Role = Role::Decode;
}
