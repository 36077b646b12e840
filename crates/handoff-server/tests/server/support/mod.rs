//! What the server's stories share: the binary under test, the
//! repository's fixtures, and the rig that runs the server and talks to it.
#![allow(dead_code)]

pub mod openai_client;

use std::path::{Path, PathBuf};
use std::process::Output;

/// The `handoff-server` binary Cargo built for these tests.
pub fn server_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_handoff-server"))
}

/// The repository (workspace) root: fixtures, models and the Python venv
/// live there.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// tests/fixtures/hf_tiny_llama: a checkpoint written by transformers
/// (scripts/make_hf_fixture.py) with no tokenizer.
pub fn hf_fixture() -> PathBuf {
    root().join("tests/fixtures/hf_tiny_llama")
}

/// One prompt transformers recorded for [`hf_fixture`].
pub struct Case {
    pub prompt: Vec<u32>,
    /// transformers' greedy continuation.
    pub greedy: Vec<u32>,
}

/// The recorded prompts of [`hf_fixture`], in file order.
pub fn hf_expected() -> Vec<Case> {
    let raw = std::fs::read(hf_fixture().join("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&raw).unwrap();
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            prompt: ids(&c["prompt"]),
            greedy: ids(&c["greedy_new_tokens"]),
        })
        .collect()
}

/// A servable Hugging Face folder in a temp dir: the random-weights fixture
/// model (vocabulary 128) with the 128-token tokenizer of
/// tests/fixtures/text/hf_tiny (tokenizer.json, `tokenizer_config.json`
/// with a chat template, EOS `</s>` and end-of-turn `<|end|>`). With
/// `chat_template`, that template replaces the folder's.
pub fn served_folder(chat_template: Option<&str>) -> tempfile::TempDir {
    let fixtures = root().join("tests/fixtures");
    let dir = tempfile::tempdir().unwrap();
    for (from, name) in [
        ("hf_tiny_llama", "config.json"),
        ("hf_tiny_llama", "model.safetensors"),
        ("text/hf_tiny", "tokenizer.json"),
        ("text/hf_tiny", "tokenizer_config.json"),
        ("text/hf_tiny", "generation_config.json"),
    ] {
        std::fs::copy(fixtures.join(from).join(name), dir.path().join(name)).unwrap();
    }
    if let Some(template) = chat_template {
        let path = dir.path().join("tokenizer_config.json");
        let mut config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        config["chat_template"] = serde_json::Value::from(template);
        std::fs::write(&path, config.to_string()).unwrap();
    }
    dir
}

/// Where the SmolLM2 GGUF is looked for: `HANDOFF_SMOLLM2`, else the folder
/// `scripts/fetch-models.sh` fills.
pub fn smollm2_path() -> PathBuf {
    if let Some(p) = std::env::var_os("HANDOFF_SMOLLM2") {
        return PathBuf::from(p);
    }
    root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// The official `openai` client's Python, from the venv
/// `scripts/openai-venv.sh` makes at the repository root.
pub fn openai_python() -> PathBuf {
    root().join(".venv-openai/bin/python")
}

/// Runs the library's example `name` with `args`, as the workspace's
/// `cargo test` builds it (`target/<profile>/examples/`); `None`, with the
/// reason on stderr, when it is not built (`cargo test -p handoff-server`
/// alone builds no library example).
pub fn run_example(name: &str, args: &[&str]) -> Option<Output> {
    let exe = std::env::current_exe().ok()?;
    let bin = exe
        .parent()?
        .parent()?
        .join("examples")
        .join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    if !bin.is_file() {
        eprintln!(
            "skipped: example `{name}` not built at {} (run `cargo test` at the workspace root)",
            bin.display()
        );
        return None;
    }
    let built = mtime(&bin);
    let mut newest = mtime(&root().join("examples").join(format!("{name}.rs")));
    let mut dirs = vec![root().join("src")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                newest = newest.max(mtime(&path));
            }
        }
    }
    assert!(
        built >= newest,
        "example `{name}` at {} is older than its sources: run `cargo test` (or `cargo build --examples`) first",
        bin.display()
    );
    Some(
        std::process::Command::new(&bin)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", bin.display())),
    )
}

fn mtime(path: &Path) -> std::time::SystemTime {
    std::fs::metadata(path)
        .and_then(|m| m.modified())
        .unwrap_or(std::time::SystemTime::UNIX_EPOCH)
}

/// Asserts that the server asked for `--backend cuda` where it cannot have
/// a GPU refused as the build says it must: exit 2, nothing on stdout, and
/// the reason on stderr (`no usable GPU` in a `cuda` build, the missing
/// build flag otherwise); never under `HANDOFF_REQUIRE_GPU=1`.
pub fn assert_gpu_refused(out: &Output) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        std::env::var("HANDOFF_REQUIRE_GPU").as_deref() != Ok("1"),
        "HANDOFF_REQUIRE_GPU=1 but the server could not use the GPU: {stderr}"
    );
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(out.stdout.is_empty(), "nothing on stdout: {stderr}");
    let why = if cfg!(feature = "cuda") {
        "no usable GPU"
    } else {
        "needs a build with the cuda feature"
    };
    assert!(
        stderr.contains("--backend cuda") && stderr.contains(why),
        "{stderr}"
    );
}

/// How many of `ids` are `text`'s control tokens.
pub fn count_specials(text: &handoff::text::TextModel, ids: &[u32]) -> usize {
    ids.iter()
        .filter(|&&id| text.tokenizer().is_special(id))
        .count()
}
