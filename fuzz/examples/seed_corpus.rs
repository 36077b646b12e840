//! Writes the seed inputs of the targets into `corpus/<target>/`:
//! `cargo run --example seed_corpus` from `fuzz/`, before the first run.

#[path = "../fuzz_targets/harness/mod.rs"]
mod harness;

use std::path::Path;

fn main() -> std::io::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let fixture = root.join("../tests/fixtures/hf_tiny_llama");
    for (target, seeds) in [
        ("llama2c", harness::seeds::llama2c()),
        ("gguf", harness::seeds::gguf()),
        ("hf", harness::seeds::hf(&fixture)),
        ("tcp_frames", harness::seeds::tcp_frames()),
        ("receipt_verify", harness::seeds::receipt_verify()),
    ] {
        let dir = root.join("corpus").join(target);
        std::fs::create_dir_all(&dir)?;
        for (name, bytes) in &seeds {
            std::fs::write(dir.join(format!("seed-{name}")), bytes)?;
        }
        println!("{target}: {} seeds in {}", seeds.len(), dir.display());
    }
    Ok(())
}
