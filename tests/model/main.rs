//! Models and backends: loaders (and their malformed files), conformance with reference implementations, kernels on the CPU.
//!
//! One story per module; the shared rigs are in `tests/support/`.

#[macro_use]
#[path = "../support/mod.rs"]
mod support;

mod attention_bias_reference;
mod cpu_backend_ops;
mod fingerprint_across_builds;
mod forward_misuse;
mod fp8_kv_cache;
mod fuzz_regressions;
mod gemma3_270m_generates;
mod gemma_cpu_ops;
mod gemma_malformed;
mod gemma_reference;
mod gguf_malformed;
mod gguf_metadata;
mod gguf_quantized_matmul;
mod gguf_smollm2_generates;
mod half_checkpoint_weights;
mod hf_conformance;
mod hf_llama3_rope;
mod hf_malformed;
mod llama2c_malformed;
mod llama2c_reference;
mod load_placed_as_read;
mod long_attention;
mod qwen_malformed;
mod qwen_reference;
mod stories260k_generates;
