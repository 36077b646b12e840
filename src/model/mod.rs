//! Llama-family models: configuration, weights, loaders, forward pass.

mod config;
mod error;
mod hf;
mod weights;

pub use config::{ModelConfig, RopeStyle};
pub use error::ModelError;
pub use hf::{load_hf, load_hf_bytes};
pub use weights::{LayerWeights, ModelWeights};
