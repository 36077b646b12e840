//! `llama2c`: arbitrary bytes as a llama2.c `.bin` file.

use handoff::model::{RopeStyle, parse_llama2c, write_llama2c};

use super::loaded::{self, Outcome};

/// Parses `data`; what loads must pass [`loaded::check`] and be exactly the
/// file it came from: written back, every byte outside the RoPE tables
/// (which the loader skips and the writer recomputes) is the input's.
pub fn llama2c_outcome(data: &[u8]) -> Outcome {
    let w = match parse_llama2c(data) {
        Ok(w) => w,
        Err(e) => return loaded::refused(&e),
    };
    let outcome = loaded::check(&w, data.len(), 4);
    let c = &w.config;
    assert_eq!(c.rope_style, RopeStyle::Interleaved);
    let again = match write_llama2c(&w) {
        Ok(b) => b,
        Err(e) => panic!("a file that loaded cannot be written back: {e}"),
    };
    assert_eq!(again.len(), data.len(), "written back at another size");
    let rope = 2 * 4 * c.max_seq_len * (c.head_dim / 2);
    let wcls = if c.tied_embeddings {
        0
    } else {
        4 * c.vocab_size * c.dim
    };
    let Some(rope_start) = data.len().checked_sub(wcls + rope) else {
        panic!(
            "loaded from {} bytes, fewer than its RoPE tables and classifier",
            data.len()
        );
    };
    assert!(
        again[..rope_start] == data[..rope_start],
        "header or tensors read from the wrong place"
    );
    assert!(
        again[rope_start + rope..] == data[rope_start + rope..],
        "classifier read from the wrong place"
    );
    outcome
}

pub fn llama2c(data: &[u8]) {
    let _ = llama2c_outcome(data);
}
