//! Llama-family models: configuration, weights, loaders, forward pass.

mod check;
mod config;
mod error;
mod fingerprint;
mod forward;
pub mod gguf;
mod hf;
mod llama2c;
mod load;
mod place;
mod random;
mod weights;

pub use crate::backend::{RopeScaling, RopeStyle};
pub use crate::fingerprint::ModelFingerprint;
pub use config::{Gemma, ModelConfig};
pub use error::ModelError;
pub use forward::{ForwardError, Logits, Model, Sampled, Scratch};
pub use hf::{load_hf, load_hf_bytes};
pub use llama2c::{load_llama2c, parse_llama2c, write_llama2c};
pub use load::load_model;
pub use random::random_weights;
pub use weights::{LayerWeights, ModelWeights};
