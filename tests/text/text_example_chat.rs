//! Story: a person chats with a model in the terminal through
//! `examples/chat.rs`. Each answer streams as it is generated, each turn
//! sees the whole conversation rendered by the model's chat template,
//! `/reset` forgets it, and `/exit` or the end of input quits cleanly. With
//! greedy sampling each answer is exactly the model's greedy continuation of
//! the rendered conversation, up to its end-of-turn token.

use crate::support::serving_path;
use crate::support::text_support;

use handoff::model::Model;
use handoff::text::{Message, TextModel};
use serving_path::handoff_greedy;
use text_support::{run_example, served_folder};

/// The greedy answer to `messages`: at most `n` tokens, cut at the first
/// stop id, as text.
fn greedy_answer(dir: &std::path::Path, messages: &[Message], n: usize) -> String {
    let text = TextModel::load(dir).unwrap();
    let (_, prompt) = text.render_chat(messages).unwrap();
    let model = Model::load(handoff::backend::CpuBackend::new(), dir).unwrap();
    let ids = handoff_greedy(&model, &prompt, n, 16);
    let cut = ids
        .iter()
        .position(|id| text.stop_ids().contains(id))
        .unwrap_or(ids.len());
    text.tokenizer().decode(&ids[..cut], true).unwrap()
}

#[test]
fn each_turn_answers_the_whole_conversation_and_reset_forgets_it() {
    conversation(&[]);
}

/// With `--backend cuda`: the same answers from GPU 0; where it cannot
/// be, exit 2 with the reason before a prompt is shown.
#[test]
fn on_the_gpu_each_turn_answers_the_same_or_the_chat_says_why_it_cannot() {
    let gpu = {
        #[cfg(feature = "cuda")]
        {
            handoff::backend::cuda::device_for_test("chat --backend cuda").is_some()
        }
        #[cfg(not(feature = "cuda"))]
        false
    };
    if gpu {
        conversation(&["--backend", "cuda"]);
        return;
    }
    let dir = served_folder();
    let path = dir.path().display().to_string();
    let Some(out) = run_example("chat", &["--model", &path, "--backend", "cuda"], "hi\n") else {
        return;
    };
    crate::support::example_bin::assert_gpu_refused(&out, 2);
}

/// Two turns, a reset and a third turn, greedy, with `extra` flags; each
/// answer must be the CPU's greedy continuation of the conversation.
fn conversation(extra: &[&str]) {
    let dir = served_folder();
    let path = dir.path().display().to_string();
    let mut args = vec![
        "--model",
        &path,
        "--temperature",
        "0",
        "--max-new-tokens",
        "6",
    ];
    args.extend(extra);
    let Some(out) = run_example(
        "chat",
        &args,
        "hi\nagain\n/reset\nagain\n/exit\nnever read\n",
    ) else {
        return;
    };
    let stdout = String::from_utf8(out.stdout).unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");

    let first = greedy_answer(dir.path(), &[Message::new("user", "hi")], 6);
    let second = greedy_answer(
        dir.path(),
        &[
            Message::new("user", "hi"),
            Message::new("assistant", first.as_str()),
            Message::new("user", "again"),
        ],
        6,
    );
    let fresh = greedy_answer(dir.path(), &[Message::new("user", "again")], 6);
    // Each answer follows its "> " prompt on a line of its own; the last
    // prompt is the one /exit answered.
    let expected = format!("\n> {first}\n\n> {second}\n\n> \n> {fresh}\n\n> ");
    assert_eq!(stdout, expected, "stderr: {stderr}");
    assert_eq!(stderr.matches("tokens/s").count(), 3, "{stderr}");
    assert!(stderr.contains("(new conversation)"));
}

#[test]
fn a_model_without_a_chat_template_or_tokenizer_is_refused_up_front() {
    let no_tokenizer = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf_tiny_llama")
        .display()
        .to_string();
    let Some(out) = run_example("chat", &["--model", &no_tokenizer], "hi\n") else {
        return;
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("tokenizer"), "{stderr}");
    assert!(out.stdout.is_empty());
}
