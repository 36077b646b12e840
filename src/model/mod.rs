//! Llama-family models: configuration, weights, loaders, forward pass.

mod config;
mod error;
mod weights;

pub use config::{ModelConfig, RopeStyle};
pub use error::ModelError;
pub use weights::{LayerWeights, ModelWeights};
