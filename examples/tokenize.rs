//! Tokenizes text with a model's own tokenizer, for scripts.
//!
//! ```sh
//! echo '["Hello world", "<|im_start|>user"]' | \
//!     cargo run --release --example tokenize -- --model PATH
//! echo '[[{"role": "user", "content": "Hi"}]]' | \
//!     cargo run --release --example tokenize -- --model PATH --chat
//! ```
//!
//! `PATH` is a Hugging Face folder (tokenizer.json) or a `.gguf` file.
//! stdin: a JSON array of strings; stdout: a JSON array of token-id arrays,
//! one per string, BOS added only where the model's tokenizer says so.
//! With `--chat`, stdin is a JSON array of conversations (each an array of
//! `{"role", "content"}`) and stdout a JSON array of `{"rendered": string,
//! "ids": [...]}`: the model's chat template with the generation prompt, and
//! its ids (nothing added: the template writes its own special tokens).
//!
//! Anything wrong (arguments, input that is not the JSON described, a model
//! without a tokenizer or chat template) prints the reason on stderr, nothing
//! on stdout, and exits with status 2.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use handoff::text::{Message, TextModel};
use serde_json::{Value, json};

const USAGE: &str = "usage: tokenize --model PATH [--chat] < input.json";

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "error: {e}\n{USAGE}");
            ExitCode::from(2)
        }
    }
}

fn parse() -> Result<(PathBuf, bool), String> {
    let mut model = None;
    let mut chat = false;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--model" => model = Some(PathBuf::from(it.next().ok_or("--model needs a value")?)),
            "--chat" => chat = true,
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok((model.ok_or("--model is required")?, chat))
}

/// Conversation `i` of the input as messages.
fn conversation(i: usize, v: &Value) -> Result<Vec<Message>, String> {
    let turns = v
        .as_array()
        .ok_or(format!("conversation {i} is not an array of messages"))?;
    turns
        .iter()
        .enumerate()
        .map(|(j, m)| {
            let field = |k: &str| {
                m.get(k)
                    .and_then(Value::as_str)
                    .ok_or(format!("conversation {i}, message {j}: no string {k:?}"))
            };
            Ok(Message::new(field("role")?, field("content")?))
        })
        .collect()
}

fn run() -> Result<(), String> {
    let (path, chat) = parse()?;
    let mut input = String::new();
    std::io::stdin()
        .read_to_string(&mut input)
        .map_err(|e| format!("cannot read stdin: {e}"))?;
    let items: Vec<Value> = match serde_json::from_str(&input) {
        Ok(Value::Array(items)) => items,
        Ok(_) => return Err("stdin must be a JSON array".into()),
        Err(e) => return Err(format!("stdin is not JSON: {e}")),
    };
    let model = TextModel::load(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        if chat {
            let (rendered, ids) = model
                .render_chat(&conversation(i, item)?)
                .map_err(|e| format!("conversation {i}: {e}"))?;
            out.push(json!({ "rendered": rendered, "ids": ids }));
        } else {
            let text = item.as_str().ok_or(format!("item {i} is not a string"))?;
            let ids = model
                .tokenizer()
                .encode(text)
                .map_err(|e| format!("item {i}: {e}"))?;
            out.push(json!(ids));
        }
    }
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{}", Value::Array(out)).map_err(|e| e.to_string())
}
