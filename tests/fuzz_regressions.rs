//! Every input the fuzzers kept (minimized corpora and any crash inputs,
//! under fuzz/regressions/<target>/) replayed under plain `cargo test`, so a
//! fixed crash stays fixed. See RELIABILITY.md for how the fuzzers ran.

#[path = "../fuzz/fuzz_targets/harness.rs"]
mod harness;

use std::path::Path;

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

#[test]
fn kv_ops_corpus() {
    replay("kv_ops", harness::kv_ops);
}
