//! Small vocabularies built by hand, and the SmolLM2 model when it is
//! present, for the text tests.

use std::path::PathBuf;

use handoff::text::{TextModel, TokenizerMetadata};

/// GPT-2's printable stand-in for byte `b` (byte-level BPE's alphabet).
pub fn byte_char(b: u8) -> char {
    let printable = |x: u8| (b'!'..=b'~').contains(&x) || (0xA1..=0xAC).contains(&x) || x >= 0xAE;
    if printable(b) {
        char::from(b)
    } else {
        let n = (0..b).filter(|&x| !printable(x)).count() as u32;
        char::from_u32(256 + n).unwrap()
    }
}

/// `s`'s bytes in byte-level BPE's alphabet.
pub fn byte_text(s: &str) -> String {
    s.bytes().map(byte_char).collect()
}

/// A byte-level BPE vocabulary: the 256 bytes (ids 0..256), then
/// `<|endoftext|>` (256, EOS), `<|im_start|>` (257), `<|im_end|>` (258), all
/// control tokens, then one token per merge in `merges` (each merge joins two
/// existing tokens, written as plain text).
pub fn byte_level(merges: &[(&str, &str)]) -> TokenizerMetadata {
    let mut tokens: Vec<String> = (0..=255u8).map(|b| byte_char(b).to_string()).collect();
    let mut types = vec![1i64; 256];
    for special in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] {
        tokens.push(special.to_string());
        types.push(3);
    }
    let mut merge_lines = Vec::new();
    for (l, r) in merges {
        let (l, r) = (byte_text(l), byte_text(r));
        merge_lines.push(format!("{l} {r}"));
        tokens.push(format!("{l}{r}"));
        types.push(1);
    }
    TokenizerMetadata {
        model: "gpt2".into(),
        pre: Some("smollm".into()),
        tokens,
        token_types: Some(types),
        merges: merge_lines,
        eos_id: Some(256),
        bos_id: Some(257),
        add_bos: Some(false),
        ..TokenizerMetadata::default()
    }
}

/// A SentencePiece vocabulary with byte fallback: `<unk>` 0, `<s>` 1,
/// `</s>` 2, bytes `<0x00>`..`<0xFF>` (3..259), then `pieces` with their
/// scores (higher merges first).
pub fn sentencepiece(pieces: &[(&str, f32)]) -> TokenizerMetadata {
    let mut tokens = vec!["<unk>".to_string(), "<s>".into(), "</s>".into()];
    let mut types = vec![2i64, 3, 3];
    let mut scores = vec![0.0f32; 3];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
        scores.push(0.0);
    }
    for (p, s) in pieces {
        tokens.push(p.to_string());
        types.push(1);
        scores.push(*s);
    }
    TokenizerMetadata {
        model: "llama".into(),
        tokens,
        scores: Some(scores),
        token_types: Some(types),
        bos_id: Some(1),
        eos_id: Some(2),
        unk_id: Some(0),
        ..TokenizerMetadata::default()
    }
}

/// Where the SmolLM2 GGUF is looked for: `HANDOFF_SMOLLM2`, else the folder
/// `scripts/fetch-models.sh` fills.
pub fn smollm2_path() -> PathBuf {
    if let Some(p) = std::env::var_os("HANDOFF_SMOLLM2") {
        return PathBuf::from(p);
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// SmolLM2's text side, or `None` with the reason printed when the model
/// file is absent.
pub fn smollm2() -> Option<TextModel> {
    let path = smollm2_path();
    if !path.is_file() {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "SKIP: {} is absent (run scripts/fetch-models.sh, or set HANDOFF_SMOLLM2)",
            path.display()
        );
        return None;
    }
    Some(TextModel::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
}

/// The committed fixture made by scripts/make_text_fixtures.py.
pub fn fixture() -> serde_json::Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/text/smollm2.json");
    serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()
}

/// A servable Hugging Face folder in a temp dir: the random-weights fixture
/// model (tests/fixtures/hf_tiny_llama, vocabulary 128) with the 128-token
/// tokenizer of tests/fixtures/text/hf_tiny (tokenizer.json, a chat template,
/// EOS `</s>` and end-of-turn `<|end|>`).
pub fn served_folder() -> tempfile::TempDir {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let dir = tempfile::tempdir().unwrap();
    for (from, name) in [
        ("hf_tiny_llama", "config.json"),
        ("hf_tiny_llama", "model.safetensors"),
        ("text/hf_tiny", "tokenizer.json"),
        ("text/hf_tiny", "tokenizer_config.json"),
        ("text/hf_tiny", "generation_config.json"),
    ] {
        std::fs::copy(root.join(from).join(name), dir.path().join(name)).unwrap();
    }
    dir
}

/// Runs example `name` with `args`, `stdin` on its standard input; `None`
/// when `cargo test` did not build it.
pub fn run_example(name: &str, args: &[&str], stdin: &str) -> Option<std::process::Output> {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let exe = std::env::current_exe().ok()?;
    let bin = exe.parent()?.parent()?.join("examples").join(name);
    if !bin.is_file() {
        let _ = writeln!(
            std::io::stderr(),
            "skipped: example `{name}` not built at {} (run `cargo test`, which builds examples)",
            bin.display()
        );
        return None;
    }
    let mut child = Command::new(&bin)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A child that exits before reading (bad arguments) closes the pipe.
    let _ = child.stdin.take().unwrap().write_all(stdin.as_bytes());
    Some(child.wait_with_output().unwrap())
}

/// A [`byte_level`] model (no merges) with `template` as its chat template.
pub fn byte_level_chat(template: &str) -> TextModel {
    let meta = TokenizerMetadata {
        chat_template: Some(template.into()),
        ..byte_level(&[])
    };
    TextModel::from_metadata(&meta).unwrap()
}

/// The control tokens among `ids`, in order.
pub fn specials(m: &TextModel, ids: &[u32]) -> Vec<u32> {
    ids.iter()
        .copied()
        .filter(|&id| m.tokenizer().is_special(id))
        .collect()
}
