//! Every input the fuzzers kept (minimized corpora and any crash inputs,
//! under fuzz/regressions/<target>/) replayed under plain `cargo test`, so a
//! fixed crash stays fixed. See fuzz/README.md for how the fuzzers ran.

#[path = "../../fuzz/fuzz_targets/harness/mod.rs"]
mod harness;

use std::path::Path;

use harness::Outcome;

fn replay(target: &str, body: fn(&[u8])) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/regressions")
        .join(target);
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        let data = std::fs::read(&path).unwrap();
        body(&data);
        n += 1;
    }
    assert!(n > 0, "no saved inputs for {target}");
}

/// Seeds named `valid-*` load through the harness (so its checks ran on a
/// real model, and it does not refuse everything); the damaged ones are
/// refused.
fn seeds_behave(seeds: Vec<harness::seeds::Seed>, outcome: fn(&[u8]) -> Outcome) {
    let mut loaded = 0;
    for (name, bytes) in &seeds {
        let want = if name.starts_with("valid-") {
            loaded += 1;
            Outcome::Loaded
        } else {
            Outcome::Refused
        };
        assert_eq!(outcome(bytes), want, "seed {name}");
    }
    assert!(loaded >= 3, "only {loaded} valid seeds");
}

#[test]
fn kv_ops_corpus() {
    replay("kv_ops", harness::kv_ops);
}

#[test]
fn llama2c_corpus() {
    replay("llama2c", harness::llama2c);
}

#[test]
fn gguf_corpus() {
    replay("gguf", harness::gguf);
}

#[test]
fn gguf_seeds_load_or_are_refused_as_named() {
    seeds_behave(harness::seeds::gguf(), harness::gguf_outcome);
}

#[test]
fn hf_corpus() {
    replay("hf", harness::hf);
}

#[test]
fn llama2c_seeds_load_or_are_refused_as_named() {
    seeds_behave(harness::seeds::llama2c(), harness::llama2c_outcome);
}

#[test]
fn hf_seeds_load_or_are_refused_as_named() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf_tiny_llama");
    seeds_behave(harness::seeds::hf(&fixture), harness::hf_outcome);
}

#[test]
fn tcp_frames_corpus() {
    replay("tcp_frames", harness::tcp_frames);
}

#[test]
fn receipt_verify_corpus() {
    replay("receipt_verify", harness::receipt_verify);
}

#[test]
fn tcp_seed_streams_decode_to_their_last_byte() {
    let seeds = harness::seeds::tcp_frames();
    for (name, bytes) in &seeds {
        let s = harness::tcp_frames_stream(bytes);
        assert!(s.clean_end && s.frames >= 1, "seed {name}: {s:?}");
    }
    let (_, stream) = seeds.last().unwrap();
    assert_eq!(harness::tcp_frames_stream(stream).frames, 7);
}

/// The honest programs assert inside the harness that the transfer is
/// verified; the others that whatever is verified is the request's own.
#[test]
fn receipt_verify_seeds_hold_the_properties() {
    for (_, bytes) in harness::seeds::receipt_verify() {
        harness::receipt_verify(&bytes);
    }
}
