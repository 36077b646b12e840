//! Compute backends that carry out the engine's plans.

#[cfg(feature = "cuda")]
pub mod cuda;
