//! Story: an operator points handoff at a GGUF file that is broken in one
//! of the ways files get broken: cut short, written by a buggy converter
//! (lying counts, offsets or dimensions), of another architecture, holding
//! a type handoff cannot compute with, or a NaN. Each ends in a typed error
//! naming the tensor or key, quickly and with bounded memory, never a panic
//! and never a partially loaded model.
//!
//! Every case starts from a small valid Llama GGUF written here (Q8_0 and
//! Q4_1 matrices, f32 norms) and damages one thing.

use std::time::{Duration, Instant};

use handoff::HttpStatus;
use handoff::backend::CpuBackend;
use handoff::model::gguf::{
    GgmlType, GgufArray, GgufError, GgufFile, GgufValue, GgufWriter, load_gguf_bytes,
};
use handoff::model::{Model, ModelError};

use crate::support::gguf_llama::{DIM, HIDDEN, Parts, f16};

/// Loads the bytes both ways a host can, which must agree: the same error
/// or the same model. Every error must also map to a status.
fn load(bytes: Vec<u8>) -> Result<(), ModelError> {
    let whole = load_gguf_bytes(bytes.clone());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    std::fs::write(&path, &bytes).unwrap();
    let placed = Model::load(CpuBackend::with_threads(1), &path);
    match (whole, placed) {
        (Ok(w), Ok(m)) => {
            let want = Model::new(CpuBackend::with_threads(1), w).unwrap();
            assert_eq!(
                m.fingerprint(),
                want.fingerprint(),
                "placed as read: other weights"
            );
            Ok(())
        }
        (Err(a), Err(b)) => {
            assert_eq!(a.to_string(), b.to_string(), "placed as read");
            assert_eq!(a.http_status(), 500);
            Err(a)
        }
        (Ok(_), Err(b)) => panic!("load_gguf_bytes loaded what Model::load refused: {b}"),
        (Err(a), Ok(_)) => panic!("load_gguf_bytes refused ({a}) what Model::load placed"),
    }
}

fn gguf_err(e: ModelError) -> GgufError {
    match e {
        ModelError::Gguf(g) => g,
        other => panic!("expected a GGUF error, got {other}"),
    }
}

#[test]
fn the_undamaged_file_loads_so_every_failure_below_is_the_damage() {
    load(Parts::valid().bytes()).unwrap();
}

#[test]
fn every_cut_of_the_file_is_a_typed_error() {
    let bytes = Parts::valid().bytes();
    for len in (0..bytes.len())
        .step_by(97)
        .chain([4, 8, 23, bytes.len() - 1])
    {
        let err = load_gguf_bytes(bytes[..len].to_vec()).unwrap_err();
        assert!(matches!(err, ModelError::Gguf(_)), "cut at {len}: {err}");
    }
}

#[test]
fn a_file_of_another_format_or_version_is_refused_by_its_header() {
    let mut bytes = Parts::valid().bytes();
    bytes[..4].copy_from_slice(b"GGML");
    assert!(matches!(
        gguf_err(load(bytes.clone()).unwrap_err()),
        GgufError::BadMagic { .. }
    ));
    for v in [1u32, 4] {
        bytes[..4].copy_from_slice(b"GGUF");
        bytes[4..8].copy_from_slice(&v.to_le_bytes());
        assert!(
            matches!(gguf_err(load(bytes.clone()).unwrap_err()), GgufError::UnsupportedVersion(x) if x == v)
        );
    }
}

#[test]
fn lying_counts_and_lengths_are_refused_before_they_size_anything() {
    let bytes = Parts::valid().bytes();
    let started = Instant::now();
    // Tensor count (bytes 8..16), metadata count (16..24).
    for at in [8, 16] {
        for lie in [u64::MAX, 1 << 40] {
            let mut b = bytes.clone();
            b[at..at + 8].copy_from_slice(&lie.to_le_bytes());
            let e = gguf_err(load_gguf_bytes(b).unwrap_err());
            assert!(
                matches!(e, GgufError::ImplausibleCount { count, .. } if count == lie),
                "{e}"
            );
        }
    }
    // The first key's length (24..32).
    let mut b = bytes.clone();
    b[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
    let e = gguf_err(load_gguf_bytes(b).unwrap_err());
    assert!(
        matches!(
            e,
            GgufError::Truncated {
                needed: u64::MAX,
                ..
            }
        ),
        "{e}"
    );
    // An array claiming 2^60 strings.
    let huge = GgufWriter::new()
        .kv("general.architecture", GgufValue::String("llama".into()))
        .kv(
            "tokenizer.ggml.tokens",
            GgufValue::Array(GgufArray::String(vec!["a".into()])),
        )
        .finish();
    let at = huge
        .windows(16)
        .rposition(|w| w[..8] == 1u64.to_le_bytes() && w[8..] == 1u64.to_le_bytes())
        .unwrap();
    let mut b = huge.clone();
    b[at..at + 8].copy_from_slice(&(1u64 << 60).to_le_bytes());
    let e = GgufFile::from_bytes(b).unwrap_err();
    assert!(
        matches!(&e, GgufError::ImplausibleCount { what, .. } if what.contains("tokenizer.ggml.tokens")),
        "{e}"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn lying_offsets_and_dimensions_name_the_tensor() {
    let offset = |o: u64| {
        let mut p = Parts::valid().bytes();
        // The offset of blk.0.attn_q.weight follows its name, n_dims, dims and type.
        let name = b"blk.0.attn_q.weight";
        let at = p.windows(name.len()).position(|w| w == name).unwrap() + name.len() + 4 + 16 + 4;
        p[at..at + 8].copy_from_slice(&o.to_le_bytes());
        gguf_err(load(p).unwrap_err())
    };
    let e = offset(1 << 40);
    assert!(
        matches!(&e, GgufError::OutOfBounds { tensor, .. } if tensor == "blk.0.attn_q.weight"),
        "{e}"
    );
    let e = offset(u64::MAX - 31);
    assert!(
        matches!(&e, GgufError::OutOfBounds { tensor, .. } if tensor == "blk.0.attn_q.weight"),
        "{e}"
    );
    let e = offset(3);
    assert!(
        matches!(&e, GgufError::Misaligned { tensor, .. } if tensor == "blk.0.attn_q.weight"),
        "{e}"
    );

    for dims in [
        vec![1 << 40, 1 << 40],
        vec![u64::MAX, 2],
        vec![0, 64],
        vec![64, 1, 1, 1, 1],
    ] {
        let p = Parts::valid().tensor("blk.1.ffn_up.weight", |d, _, _| *d = dims.clone());
        let e = gguf_err(load(p.bytes()).unwrap_err());
        let named = e.to_string().contains("blk.1.ffn_up.weight");
        assert!(named, "{dims:?}: {e}");
    }
    // Dimensions that fit the file but not the config.
    let p = Parts::valid().tensor("blk.1.ffn_up.weight", |d, _, b| {
        *d = vec![DIM, HIDDEN / 2];
        b.truncate(b.len() / 2);
    });
    let e = gguf_err(load(p.bytes()).unwrap_err());
    assert!(
        matches!(&e, GgufError::Shape { tensor, expected, got }
        if tensor == "blk.1.ffn_up.weight" && expected == &[DIM, HIDDEN] && got == &[DIM, HIDDEN / 2]),
        "{e}"
    );
}

#[test]
fn an_unknown_architecture_or_missing_key_is_refused_before_any_weight_is_read() {
    let p = Parts::valid().kv("general.architecture", GgufValue::String("gpt2".into()));
    assert!(
        matches!(gguf_err(load(p.bytes()).unwrap_err()), GgufError::UnknownArchitecture(a) if a == "gpt2")
    );
    let mut p = Parts::valid();
    p.kv.retain(|(k, _)| k != "llama.embedding_length");
    assert!(
        matches!(gguf_err(load(p.bytes()).unwrap_err()), GgufError::MissingKey(k) if k == "llama.embedding_length")
    );
    let p = Parts::valid().kv("llama.block_count", GgufValue::String("two".into()));
    assert!(
        matches!(gguf_err(load(p.bytes()).unwrap_err()), GgufError::WrongType { key, .. } if key == "llama.block_count")
    );
}

#[test]
fn a_config_claiming_a_million_layers_is_refused_by_the_file_at_once() {
    for layers in [1_000_000u64, 1 << 40] {
        let started = Instant::now();
        let p = Parts::valid().kv("llama.block_count", GgufValue::U64(layers));
        let e = gguf_err(load(p.bytes()).unwrap_err());
        assert!(
            matches!(&e, GgufError::InvalidConfig(m) if m.contains(&layers.to_string())),
            "{e}"
        );
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}

#[test]
fn a_type_handoff_cannot_compute_with_is_named_with_its_tensor() {
    // I8, a type ggml defines but no Llama computes with, sized right.
    let p = Parts::valid().tensor("blk.0.attn_q.weight", |_, ty, b| {
        *ty = GgmlType::I8.id();
        *b = vec![0; (DIM * DIM) as usize];
    });
    let e = gguf_err(load(p.bytes()).unwrap_err());
    assert!(
        matches!(&e, GgufError::UnsupportedType { tensor, ty: GgmlType::I8 } if tensor == "blk.0.attn_q.weight"),
        "{e}"
    );
    // Q4_K blocks are 256 wide: 64-element rows cannot hold one.
    let p = Parts::valid().tensor("blk.0.attn_q.weight", |_, ty, _| *ty = GgmlType::Q4K.id());
    let e = gguf_err(load(p.bytes()).unwrap_err());
    assert!(
        matches!(&e, GgufError::RowNotBlockMultiple { tensor, ty: GgmlType::Q4K, .. } if tensor == "blk.0.attn_q.weight"),
        "{e}"
    );
    let p = Parts::valid().tensor("blk.0.attn_q.weight", |_, ty, _| *ty = 99);
    let e = gguf_err(load(p.bytes()).unwrap_err());
    assert!(
        matches!(&e, GgufError::UnknownType { tensor, type_id: 99 } if tensor == "blk.0.attn_q.weight"),
        "{e}"
    );
}

#[test]
fn a_nan_in_a_norm_or_a_block_scale_is_refused_with_its_position() {
    let p = Parts::valid().tensor("blk.1.ffn_norm.weight", |_, _, b| {
        b[12..16].copy_from_slice(&f32::NAN.to_le_bytes())
    });
    let e = gguf_err(load(p.bytes()).unwrap_err());
    assert!(
        matches!(&e, GgufError::NonFinite { tensor, index: 3 } if tensor == "blk.1.ffn_norm.weight"),
        "{e}"
    );
    // The second block's scale of a Q8_0 matrix: elements 32.. are NaN.
    let p = Parts::valid().tensor("blk.0.attn_v.weight", |_, _, b| {
        b[34..36].copy_from_slice(&f16(f32::NAN))
    });
    let e = gguf_err(load(p.bytes()).unwrap_err());
    assert!(
        matches!(&e, GgufError::NonFinite { tensor, index: 32 } if tensor == "blk.0.attn_v.weight"),
        "{e}"
    );
}

#[test]
fn an_extra_or_missing_tensor_is_named() {
    let mut p = Parts::valid();
    p.tensors.retain(|t| t.0 != "blk.1.attn_k.weight");
    let e = gguf_err(load(p.bytes()).unwrap_err());
    assert!(e.to_string().contains("blk.1.attn_k.weight"), "{e}");
    let mut p = Parts::valid();
    p.tensors.push((
        "rope_freqs.weight".into(),
        vec![8],
        GgmlType::F32.id(),
        vec![0; 32],
    ));
    let e = gguf_err(load(p.bytes()).unwrap_err());
    assert!(
        matches!(&e, GgufError::UnexpectedTensor(t) if t == "rope_freqs.weight"),
        "{e}"
    );
}

#[test]
fn random_corruption_never_panics() {
    let bytes = Parts::valid().bytes();
    let mut s = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..400 {
        let mut b = bytes.clone();
        for _ in 0..4 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            // Mostly the header, where the structure is.
            let at = (s as usize)
                % if s & 1 == 0 {
                    1024.min(b.len())
                } else {
                    b.len()
                };
            b[at] = (s >> 32) as u8;
        }
        let _ = load_gguf_bytes(b);
    }
}
