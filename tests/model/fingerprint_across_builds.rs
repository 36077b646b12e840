//! A disaggregated pair is upgraded one worker at a time: for a while the
//! prefill worker of the previous build serves the decode worker of the new
//! one. Each plan carries the decode model's fingerprint and prefill refuses
//! any other, so a build that hashes the same weights differently (another
//! order, another tensor fed first, a length left out) fails every transfer
//! of the pair with `ModelMismatch` until both sides are upgraded.
//!
//! The fingerprints below were computed by the build before the loader
//! placed checkpoints as it read them (commit aa01c13, which hashed a whole
//! `ModelWeights` in one pass). Every way of building a model today must
//! still give them: `ModelFingerprint::of`, `Model::new` and `Model::load`.
//! Changing the hash on purpose means a new version tag and new values here.

#![cfg(target_endian = "little")]

use std::io::Write;
use std::path::Path;

use handoff::backend::CpuBackend;
use handoff::model::{Model, ModelConfig, ModelFingerprint, load_model, random_weights};

fn cpu() -> CpuBackend {
    CpuBackend::with_threads(1)
}

#[test]
fn random_weights_hash_as_the_previous_build_hashed_them() {
    // (tied_embeddings, attention_bias) -> fingerprint at aa01c13.
    let pinned = [
        ((false, false), 0x597f_9e50_6f1e_82f4u64),
        ((false, true), 0xeee5_18a6_4666_20a1),
        ((true, false), 0xf9d9_12b1_bbdb_c1d8),
        ((true, true), 0xfd00_4fd2_a203_f0a9),
    ];
    for ((tied, bias), want) in pinned {
        let mut c = ModelConfig::tiny_gqa();
        c.tied_embeddings = tied;
        c.attention_bias = bias;
        let w = random_weights(&c, 7);
        let want = ModelFingerprint::from_u64(want);
        assert_eq!(
            ModelFingerprint::of(&w),
            want,
            "of: tied {tied}, bias {bias}"
        );
        let placed = Model::new(cpu(), w).unwrap();
        assert_eq!(placed.fingerprint(), want, "new: tied {tied}, bias {bias}");
    }
}

#[test]
fn checkpoints_hash_as_the_previous_build_hashed_them() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let pinned = [
        ("tests/fixtures/hf_tiny_llama", 0x0e86_49f4_1d93_5dbfu64),
        (
            "tests/fixtures/hf_tiny_llama/sharded",
            0x0e86_49f4_1d93_5dbf,
        ),
        ("tests/fixtures/hf_tiny_llama3", 0x76e9_78cb_99b3_1990),
        ("../shared/models/stories260K.bin", 0x12c9_fb1d_ad4b_5138),
    ];
    for (rel, want) in pinned {
        let path = root.join(rel);
        if !path.exists() {
            let _ = writeln!(std::io::stderr(), "{rel} skipped: it is absent");
            continue;
        }
        let want = ModelFingerprint::from_u64(want);
        let whole = load_model(&path).unwrap();
        assert_eq!(ModelFingerprint::of(&whole), want, "of: {rel}");
        assert_eq!(
            Model::new(cpu(), whole).unwrap().fingerprint(),
            want,
            "new: {rel}"
        );
        assert_eq!(
            Model::load(cpu(), &path).unwrap().fingerprint(),
            want,
            "load: {rel}"
        );
    }
}
