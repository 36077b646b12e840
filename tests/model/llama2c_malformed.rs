//! A model file is input like any other: truncated files, wrong headers,
//! NaN weights, trailing garbage and random bytes all get a typed
//! `ModelError` naming what is wrong — never a panic, never a half-loaded
//! model. A well-formed file round-trips exactly.

use handoff::model::{
    ModelConfig, ModelError, load_llama2c, parse_llama2c, random_weights, write_llama2c,
};
use proptest::prelude::*;

fn small() -> ModelConfig {
    ModelConfig {
        dim: 16,
        hidden_dim: 24,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 4,
        vocab_size: 32,
        max_seq_len: 8,
        ..ModelConfig::tiny_gqa()
    }
}

fn file(tied: bool) -> (handoff::model::ModelWeights, Vec<u8>) {
    let cfg = ModelConfig {
        tied_embeddings: tied,
        ..small()
    };
    let w = random_weights(&cfg, 3);
    let bytes = write_llama2c(&w).unwrap();
    (w, bytes)
}

#[test]
fn a_well_formed_file_round_trips_exactly() {
    for tied in [true, false] {
        let (w, bytes) = file(tied);
        assert_eq!(parse_llama2c(&bytes).unwrap(), w);
    }
}

#[test]
fn every_truncation_is_a_typed_error_naming_a_tensor() {
    let (_, bytes) = file(false);
    for len in 0..bytes.len() {
        match parse_llama2c(&bytes[..len]) {
            Err(ModelError::Truncated {
                tensor,
                expected,
                available,
            }) => {
                assert!(!tensor.is_empty());
                assert!(expected > available, "{tensor}: {expected} <= {available}");
            }
            other => panic!("truncated to {len} bytes: {other:?}"),
        }
    }
}

#[test]
fn a_file_truncated_at_the_separate_classifier_names_wcls() {
    let (_, bytes) = file(false);
    let cut = bytes.len() - 4;
    assert!(matches!(
        parse_llama2c(&bytes[..cut]),
        Err(ModelError::Truncated { ref tensor, .. }) if tensor == "wcls"
    ));
}

#[test]
fn trailing_bytes_mean_the_header_is_wrong() {
    let (_, mut bytes) = file(true);
    bytes.extend_from_slice(&[0; 8]);
    assert!(matches!(
        parse_llama2c(&bytes),
        Err(ModelError::BadHeader(_))
    ));
}

#[test]
fn nonsense_headers_are_refused() {
    let (_, bytes) = file(true);
    let set = |field: usize, v: i32| {
        let mut b = bytes.clone();
        b[field * 4..field * 4 + 4].copy_from_slice(&v.to_le_bytes());
        parse_llama2c(&b)
    };
    // dim not divisible by n_heads, zero or negative sizes, GQA that does
    // not divide, versioned magic.
    assert!(matches!(set(3, 3), Err(ModelError::BadHeader(_))));
    assert!(matches!(set(0, 0), Err(ModelError::BadHeader(_))));
    assert!(matches!(set(1, -5), Err(ModelError::BadHeader(_))));
    assert!(matches!(set(4, 3), Err(ModelError::BadHeader(_))));
    assert!(matches!(set(6, i32::MIN), Err(ModelError::BadHeader(_))));
    assert!(matches!(set(0, 0x616b_3432), Err(ModelError::BadHeader(_))));
    // A header that grows a tensor: the file is then too short for it.
    assert!(matches!(set(1, 1000), Err(ModelError::Truncated { .. })));
}

#[test]
fn nan_and_infinite_weights_are_named() {
    let (_, bytes) = file(true);
    // First element of wq: after the header, embedding (32*16) and
    // rms_att (2*16).
    let at = 28 + 4 * (32 * 16 + 2 * 16);
    for bad in [f32::NAN, f32::INFINITY] {
        let mut b = bytes.clone();
        b[at..at + 4].copy_from_slice(&bad.to_le_bytes());
        assert!(matches!(
            parse_llama2c(&b),
            Err(ModelError::NonFinite { ref tensor, index: 0 }) if tensor == "wq"
        ));
    }
}

#[test]
fn a_missing_file_is_an_io_error_with_its_path() {
    let err = load_llama2c(std::path::Path::new("/nonexistent/model.bin")).unwrap_err();
    assert!(matches!(err, ModelError::Io { ref path, .. } if path.contains("nonexistent")));
}

proptest! {
    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = parse_llama2c(&bytes);
    }

    #[test]
    fn random_corruption_of_a_real_file_never_panics(
        flips in proptest::collection::vec((0usize..2000, any::<u8>()), 1..8),
        cut in 0usize..4000,
    ) {
        let (_, mut bytes) = file(true);
        for (i, v) in flips {
            let n = bytes.len();
            bytes[i % n] = v;
        }
        let cut = cut.min(bytes.len());
        let _ = parse_llama2c(&bytes[..cut]);
        let _ = parse_llama2c(&bytes);
    }
}
