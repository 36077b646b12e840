//! A Hugging Face checkpoint read whole is held in f32 before it is placed:
//! an 8B bf16 checkpoint (16 GB) needed 32 GB to load, on a machine where the
//! placed model (bf16, 16 GB) would fit. `Model::load` places each layer as
//! it is read. It must be the same model: the same fingerprint (so a
//! disaggregated pair where one side loads whole and the other as read still
//! serves) and the same logits, bit for bit.

use std::path::{Path, PathBuf};

use handoff::backend::CpuBackend;
use handoff::model::{Model, load_model};

fn fixtures() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut v = vec![
        root.join("tests/fixtures/hf_tiny_llama"),
        root.join("tests/fixtures/hf_tiny_llama/sharded"),
        root.join("tests/fixtures/hf_tiny_llama3"),
    ];
    let stories = root.join("../shared/models/stories260K.bin");
    if stories.exists() {
        v.push(stories);
    } else {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "stories260K case skipped: {} is absent",
            stories.display()
        );
    }
    v
}

#[test]
fn a_model_placed_as_it_is_read_is_the_model_read_whole() {
    for path in fixtures() {
        let whole = Model::new(CpuBackend::with_threads(2), load_model(&path).unwrap()).unwrap();
        let placed = Model::load(CpuBackend::with_threads(2), &path).unwrap();
        assert_eq!(
            placed.fingerprint(),
            whole.fingerprint(),
            "{}",
            path.display()
        );
        assert_eq!(placed.config(), whole.config());
        assert_eq!(placed.weight_bytes(), whole.weight_bytes());
        let prompt: Vec<u32> = (0..24).map(|i| (i * 7 + 3) % 100).collect();
        let bits = |m: &Model| -> Vec<u32> {
            m.logits_for_prompt(&prompt)
                .unwrap()
                .iter()
                .flatten()
                .map(|x| x.to_bits())
                .collect()
        };
        assert_eq!(bits(&placed), bits(&whole), "{}", path.display());
    }
}

#[test]
fn loading_as_read_refuses_what_loading_whole_refuses() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for bad in [root.join("tests"), root.join("no/such/model")] {
        let whole = load_model(&bad).unwrap_err();
        let placed = Model::load(CpuBackend::with_threads(1), &bad).unwrap_err();
        assert_eq!(placed.to_string(), whole.to_string());
    }
}
