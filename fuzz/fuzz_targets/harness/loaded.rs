//! What every model loader must guarantee about what it hands back.

use handoff::HttpStatus;
use handoff::model::{ModelError, ModelWeights};

/// What one input did to a loader.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Loaded, and the weights passed every check below.
    Loaded,
    /// Refused with a typed [`ModelError`].
    Refused,
}

/// A refusal must be printable and mapped to a status without panicking.
pub fn refused(e: &ModelError) -> Outcome {
    assert!(!e.to_string().is_empty(), "{e:?} has an empty message");
    assert_eq!(e.http_status(), 500);
    Outcome::Refused
}

/// Loaded weights pass `ModelConfig::validate` and the shape check, hold
/// only finite values, and hold no more values than the input could encode
/// at `min_bytes_per_value` bytes each (a loader never invents weights).
pub fn check(w: &ModelWeights, input_len: usize, min_bytes_per_value: usize) -> Outcome {
    if let Err(e) = w.config.validate() {
        panic!("loaded config fails validate: {e}: {:?}", w.config);
    }
    if let Err(e) = w.check_shapes() {
        panic!("loaded tensors disagree with their config: {e}");
    }
    let mut values = 0usize;
    for t in tensors(w) {
        assert!(
            t.iter().all(|x| x.is_finite()),
            "a non-finite weight loaded"
        );
        values += t.len();
    }
    assert!(
        values * min_bytes_per_value <= input_len,
        "{values} values from {input_len} input bytes"
    );
    Outcome::Loaded
}

fn tensors(w: &ModelWeights) -> impl Iterator<Item = &[f32]> {
    let per_layer = w.layers.iter().flat_map(|l| {
        [
            Some(&l.attn_norm),
            Some(&l.wq),
            Some(&l.wk),
            Some(&l.wv),
            Some(&l.wo),
            l.bq.as_ref(),
            l.bk.as_ref(),
            l.bv.as_ref(),
            Some(&l.ffn_norm),
            Some(&l.w1),
            Some(&l.w2),
            Some(&l.w3),
        ]
        .into_iter()
        .flatten()
        .map(Vec::as_slice)
    });
    [Some(&w.embedding), Some(&w.final_norm), w.lm_head.as_ref()]
        .into_iter()
        .flatten()
        .map(Vec::as_slice)
        .chain(per_layer)
}
