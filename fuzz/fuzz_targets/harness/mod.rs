//! Fuzz harness bodies, shared by the libFuzzer targets in this folder and by
//! `tests/fuzz_regressions.rs`, which replays every saved input under plain
//! `cargo test`. Each body panics only on a broken invariant: a typed error
//! is a pass, a panic, a hang or an oversized allocation is a finding.

// Each target and the test use a different subset of the bodies.
#![allow(dead_code, unused_imports)]

mod gguf;
mod hf;
mod kv_ops;
mod llama2c;
mod loaded;
mod receipt_verify;
pub mod seeds;
mod tcp_frames;

pub use gguf::{gguf, gguf_outcome};
pub use hf::{HfInput, hf, hf_outcome};
pub use kv_ops::kv_ops;
pub use llama2c::{llama2c, llama2c_outcome};
pub use loaded::Outcome;
pub use receipt_verify::receipt_verify;
pub use tcp_frames::{Stream, tcp_frames, tcp_frames_stream};
