//! Story: scripts drive `examples/generate.rs` and parse its stdout. The
//! contract they rely on: one line per `--prompt-ids`, in the order given,
//! holding only the generated ids separated by single spaces (exactly
//! `--max-new-tokens` of them unless a `--stop-ids` id ends the line early);
//! anything wrong with the arguments is a non-zero exit with the reason on
//! stderr and nothing on stdout, never a panic.
//!
//! An earlier version sized its KV pool without rounding to whole pages: a
//! model whose `max_seq_len` is not a page multiple (100 here) made the
//! engine configuration refuse to build and valid prompts printed nothing.
//!
//! Text in and out: `--prompt TEXT` prints the generated text (the greedy
//! ids decoded, ending at the model's EOS or end-of-turn id, which is not
//! printed), `--chat TEXT` renders a one-turn conversation with the model's
//! template and streams the answer, ending with tokens/s and the time to
//! first token on stderr, and `--stop STRING` ends the text before the
//! string. A model without a tokenizer refuses text up front.
//!
//! Runs the example binary that `cargo test` builds; under a filtered
//! `cargo test --test example_generate` it is not built and each test says
//! so on stderr and returns.

use crate::support::example_bin;
use crate::support::hf_fixture;
use crate::support::serving_path;
use crate::support::text_support;

use std::path::PathBuf;
use std::process::Output;

use handoff::model::{Model, ModelConfig, random_weights, write_llama2c};
use handoff::text::{Message, TextModel};
use hf_fixture::FIXTURE;
use serving_path::handoff_greedy;

fn run(args: &[&str]) -> Option<Output> {
    example_bin::run("generate", args)
}

fn stdout_lines(out: &Output) -> Vec<String> {
    String::from_utf8(out.stdout.clone())
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

fn line_of(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" ")
}

fn csv(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

fn assert_success(out: &Output) {
    assert!(
        out.status.success(),
        "exit {:?}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The fixture's prompts and transformers' greedy continuations.
fn transformers_cases() -> Vec<(Vec<u32>, Vec<u32>)> {
    hf_fixture::expected()
        .into_iter()
        .map(|c| (c.prompt, c.greedy))
        .collect()
}

/// A file under the temp dir with a name no other test run shares, removed
/// on drop.
struct TempFile(PathBuf);

impl TempFile {
    fn new(tag: &str, bytes: &[u8]) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let path = std::env::temp_dir().join(format!(
            "handoff-example-generate-{tag}-{}-{nanos}.bin",
            std::process::id()
        ));
        std::fs::write(&path, bytes).unwrap();
        TempFile(path)
    }

    fn as_str(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Runs the example on `model` with `cases`' prompts, in that order, for
/// as many tokens as their continuations, greedy; checks that stdout is
/// exactly those continuations, one line each (ids only, single spaces, no
/// trailing text). `None` when the example is not built.
fn greedy_lines_are(model: &str, cases: &[(Vec<u32>, Vec<u32>)]) -> Option<Output> {
    let n = cases[0].1.len();
    assert!(cases.iter().all(|(_, g)| g.len() == n));
    let mut args = vec!["--model", model];
    let prompts: Vec<String> = cases.iter().map(|(p, _)| csv(p)).collect();
    for p in &prompts {
        args.extend(["--prompt-ids", p.as_str()]);
    }
    let n_arg = n.to_string();
    args.extend(["--max-new-tokens", &n_arg, "--temperature", "0"]);
    let out = run(&args)?;
    assert_success(&out);
    let expected: Vec<String> = cases.iter().map(|(_, g)| line_of(g)).collect();
    assert_eq!(
        String::from_utf8(out.stdout.clone()).unwrap(),
        format!("{}\n", expected.join("\n"))
    );
    Some(out)
}

#[test]
fn one_line_per_prompt_in_order_with_transformers_greedy_tokens() {
    // Given in reverse, so order comes from the arguments, not the fixture.
    let cases: Vec<_> = transformers_cases().into_iter().rev().collect();
    let Some(out) = greedy_lines_are(FIXTURE, &cases) else {
        return;
    };
    for line in stdout_lines(&out) {
        assert_eq!(line.split(' ').count(), cases[0].1.len(), "{line:?}");
    }
}

/// `--backend cuda`: on a GPU, the fixture's prompts give transformers'
/// greedy tokens as on the CPU (KV pages in device memory, sampling on the
/// device); without one, or in a build without the `cuda` feature, exit 2
/// with the reason and nothing on stdout, never a CPU run in its place.
#[test]
fn the_gpu_backend_generates_transformers_greedy_tokens_or_says_why_it_cannot() {
    let cases = transformers_cases();
    let n = cases[0].1.len().to_string();
    let prompts: Vec<String> = cases.iter().map(|(p, _)| csv(p)).collect();
    let mut args = vec!["--model", FIXTURE, "--backend", "cuda"];
    for p in &prompts {
        args.extend(["--prompt-ids", p.as_str()]);
    }
    args.extend(["--max-new-tokens", n.as_str(), "--temperature", "0"]);
    let Some(out) = run(&args) else {
        return;
    };
    if out.status.success() {
        let expected: Vec<String> = cases.iter().map(|(_, g)| line_of(g)).collect();
        assert_eq!(
            String::from_utf8(out.stdout.clone()).unwrap(),
            format!("{}\n", expected.join("\n"))
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("KV pages in device memory"), "{stderr}");
        return;
    }
    example_bin::assert_gpu_refused(&out, 2);
}

#[test]
fn a_llama3_checkpoint_generates_transformers_greedy_tokens() {
    // Llama 3's scaled RoPE, through the example's exact interface.
    let cases: Vec<(Vec<u32>, Vec<u32>)> = hf_fixture::expected_in(hf_fixture::FIXTURE_LLAMA3)
        .into_iter()
        .map(|c| (c.prompt, c.greedy))
        .collect();
    greedy_lines_are(hf_fixture::FIXTURE_LLAMA3, &cases);
}

#[test]
fn stop_ids_end_a_line_early_and_only_that_line() {
    let cases = transformers_cases();
    // Greedy [1, 17, 42] -> 16 88 15 ...; [7] never produces 15.
    let (stopping, free) = (&cases[0], &cases[2]);
    let stop = stopping.1[2];
    assert!(!free.1.contains(&stop) && !stopping.1[..2].contains(&stop));
    let (p0, p1) = (csv(&stopping.0), csv(&free.0));
    let stop_arg = stop.to_string();
    let n_arg = stopping.1.len().to_string();
    let Some(out) = run(&[
        "--model",
        FIXTURE,
        "--prompt-ids",
        &p0,
        "--prompt-ids",
        &p1,
        "--max-new-tokens",
        &n_arg,
        "--stop-ids",
        &stop_arg,
    ]) else {
        return;
    };
    assert_success(&out);
    assert_eq!(
        stdout_lines(&out),
        [line_of(&stopping.1[..3]), line_of(&free.1)],
        "the stop id is the last token of its line"
    );
}

/// max_seq_len 100 is not a multiple of the 16-token page: the window is
/// 100 tokens and the pool must still be whole pages holding it twice.
#[test]
fn a_window_that_is_not_a_page_multiple_still_serves_a_llama2c_file() {
    let cfg = ModelConfig {
        max_seq_len: 100,
        ..ModelConfig::tiny_gqa()
    };
    let weights = random_weights(&cfg, 21);
    let file = TempFile::new("window100", &write_llama2c(&weights).unwrap());
    let prompt: Vec<u32> = (0..90).map(|i| (i * 37 + 11) % 384).collect();
    let p = csv(&prompt);
    let Some(out) = run(&[
        "--model",
        file.as_str(),
        "--prompt-ids",
        &p,
        "--max-new-tokens",
        "9",
        "--page-size",
        "16",
    ]) else {
        return;
    };
    assert_success(&out);
    let expected = handoff_greedy(&Model::cpu(weights).unwrap(), &prompt, 9, 16);
    assert_eq!(stdout_lines(&out), [line_of(&expected)]);
}

#[test]
fn bad_arguments_exit_non_zero_with_nothing_on_stdout() {
    let huge = u64::MAX.to_string();
    let too_long: String = csv(&[1; 200]);
    let cases: Vec<(&str, Vec<&str>)> = vec![
        ("no arguments", vec![]),
        (
            "no prompt",
            vec!["--model", FIXTURE, "--max-new-tokens", "4"],
        ),
        (
            "no max new tokens",
            vec!["--model", FIXTURE, "--prompt-ids", "1,2"],
        ),
        (
            "not a token id",
            vec![
                "--model",
                FIXTURE,
                "--prompt-ids",
                "1,x",
                "--max-new-tokens",
                "4",
            ],
        ),
        (
            "unknown flag",
            vec![
                "--model",
                FIXTURE,
                "--prompt-ids",
                "1",
                "--max-new-tokens",
                "4",
                "--bogus",
                "1",
            ],
        ),
        (
            "flag without value",
            vec!["--model", FIXTURE, "--prompt-ids", "1", "--max-new-tokens"],
        ),
        (
            "max new tokens overflows",
            vec![
                "--model",
                FIXTURE,
                "--prompt-ids",
                "1,2,3",
                "--max-new-tokens",
                &huge,
            ],
        ),
        (
            "huge page size",
            vec![
                "--model",
                FIXTURE,
                "--prompt-ids",
                "1,2,3",
                "--max-new-tokens",
                "4",
                "--page-size",
                &huge,
            ],
        ),
        (
            "unknown backend",
            vec![
                "--model",
                FIXTURE,
                "--prompt-ids",
                "1,2,3",
                "--max-new-tokens",
                "4",
                "--backend",
                "tpu",
            ],
        ),
        (
            "threads for the GPU backend",
            vec![
                "--model",
                FIXTURE,
                "--prompt-ids",
                "1,2,3",
                "--max-new-tokens",
                "4",
                "--backend",
                "cuda",
                "--threads",
                "2",
            ],
        ),
        (
            "page size 0",
            vec![
                "--model",
                FIXTURE,
                "--prompt-ids",
                "1,2,3",
                "--max-new-tokens",
                "4",
                "--page-size",
                "0",
            ],
        ),
        (
            "missing model",
            vec![
                "--model",
                "/nonexistent/handoff/model.bin",
                "--prompt-ids",
                "1",
                "--max-new-tokens",
                "4",
            ],
        ),
        (
            "token outside the vocabulary of 128",
            vec![
                "--model",
                FIXTURE,
                "--prompt-ids",
                "1,2",
                "--prompt-ids",
                "1,128",
                "--max-new-tokens",
                "4",
            ],
        ),
        (
            "prompt longer than the model's 128 positions",
            vec![
                "--model",
                FIXTURE,
                "--prompt-ids",
                &too_long,
                "--max-new-tokens",
                "4",
            ],
        ),
    ];
    for (what, args) in cases {
        let Some(out) = run(&args) else { return };
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{what}: {stderr}");
        assert!(out.stdout.is_empty(), "{what}: stdout {:?}", out.stdout);
        assert!(stderr.contains("error:"), "{what}: {stderr}");
        assert!(!stderr.contains("panicked"), "{what}: {stderr}");
    }
}

/// The greedy continuation of `prompt` on the served fixture folder, as the
/// example prints it: at most `n` ids, cut before the first stop id, decoded.
fn greedy_text(dir: &std::path::Path, prompt: &[u32], n: usize) -> String {
    let text = TextModel::load(dir).unwrap();
    let model = Model::load(handoff::backend::CpuBackend::new(), dir).unwrap();
    let ids = handoff_greedy(&model, prompt, n, 16);
    let cut = ids
        .iter()
        .position(|id| text.stop_ids().contains(id))
        .unwrap_or(ids.len());
    text.tokenizer().decode(&ids[..cut], true).unwrap()
}

#[test]
fn text_prompts_print_their_greedy_continuations_as_text_in_order() {
    let dir = text_support::served_folder();
    let path = dir.path().to_str().unwrap();
    let text = TextModel::load(dir.path()).unwrap();
    let prompts = ["Hello world", "the lazy fox"];
    let Some(out) = run(&[
        "--model",
        path,
        "--prompt",
        prompts[0],
        "--prompt",
        prompts[1],
        "--max-new-tokens",
        "10",
        "--temperature",
        "0",
    ]) else {
        return;
    };
    assert_success(&out);
    let want: String = prompts
        .iter()
        .map(|p| greedy_text(dir.path(), &text.tokenizer().encode(p).unwrap(), 10) + "\n")
        .collect();
    assert_eq!(String::from_utf8(out.stdout).unwrap(), want);
}

#[test]
fn a_chat_turn_streams_the_templated_answer_and_reports_speed() {
    let dir = text_support::served_folder();
    let path = dir.path().to_str().unwrap();
    let text = TextModel::load(dir.path()).unwrap();
    let Some(out) = run(&[
        "--model",
        path,
        "--chat",
        "hi",
        "--max-new-tokens",
        "12",
        "--temperature",
        "0",
    ]) else {
        return;
    };
    assert_success(&out);
    let (_, prompt) = text.render_chat(&[Message::new("user", "hi")]).unwrap();
    assert_eq!(
        prompt[0], 2,
        "the template's <|user|>, as one special token"
    );
    let want = greedy_text(dir.path(), &prompt, 12) + "\n";
    assert_eq!(String::from_utf8(out.stdout).unwrap(), want);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let last = stderr.lines().last().unwrap();
    assert!(
        last.contains("tokens/s") && last.contains("time to first token"),
        "{stderr}"
    );
}

#[test]
fn a_stop_string_ends_the_text_before_it() {
    let dir = text_support::served_folder();
    let path = dir.path().to_str().unwrap();
    let text = TextModel::load(dir.path()).unwrap();
    let full = greedy_text(
        dir.path(),
        &text.tokenizer().encode("Hello world").unwrap(),
        16,
    );
    let chars: Vec<char> = full.chars().collect();
    assert!(
        chars.len() >= 6,
        "the fixture's continuation is long enough: {full:?}"
    );
    // A two-character stop string from the middle of the text.
    let stop: String = chars[3..5].iter().collect();
    let before = &full[..full.find(&stop).unwrap()];
    let Some(out) = run(&[
        "--model",
        path,
        "--prompt",
        "Hello world",
        "--max-new-tokens",
        "16",
        "--temperature",
        "0",
        "--stop",
        &stop,
    ]) else {
        return;
    };
    assert_success(&out);
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        format!("{before}\n")
    );
}

#[test]
fn text_needs_a_tokenizer_and_one_way_of_giving_prompts() {
    let dir = text_support::served_folder();
    let path = dir.path().to_str().unwrap();
    let cases: Vec<(&str, Vec<&str>)> = vec![
        (
            "no tokenizer",
            vec![
                "--model",
                FIXTURE,
                "--prompt",
                "hi",
                "--max-new-tokens",
                "4",
            ],
        ),
        (
            "no tokenizer for chat",
            vec!["--model", FIXTURE, "--chat", "hi", "--max-new-tokens", "4"],
        ),
        (
            "ids and text",
            vec![
                "--model",
                path,
                "--prompt",
                "hi",
                "--prompt-ids",
                "1",
                "--max-new-tokens",
                "4",
            ],
        ),
        (
            "two chats",
            vec![
                "--model",
                path,
                "--chat",
                "a",
                "--chat",
                "b",
                "--max-new-tokens",
                "4",
            ],
        ),
        (
            "stop strings on ids",
            vec![
                "--model",
                path,
                "--prompt-ids",
                "1",
                "--stop",
                "x",
                "--max-new-tokens",
                "4",
            ],
        ),
        (
            "empty stop",
            vec![
                "--model",
                path,
                "--prompt",
                "hi",
                "--stop",
                "",
                "--max-new-tokens",
                "4",
            ],
        ),
    ];
    for (what, args) in cases {
        let Some(out) = run(&args) else { return };
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{what}: {stderr}");
        assert!(out.stdout.is_empty(), "{what}: stdout {:?}", out.stdout);
        assert!(
            stderr.contains("error:") && !stderr.contains("panicked"),
            "{what}: {stderr}"
        );
    }
}

/// `--speculative ngram`: prompt-lookup drafts verified in one pass give
/// transformers' greedy tokens all the same, and stderr reports the drafts
/// and the acceptance rate.
#[test]
fn prompt_lookup_drafting_prints_the_same_greedy_tokens_and_its_acceptance() {
    let cases = transformers_cases();
    let n = cases[0].1.len().to_string();
    let prompts: Vec<String> = cases.iter().map(|(p, _)| csv(p)).collect();
    let mut args = vec!["--model", FIXTURE, "--speculative", "ngram"];
    for p in &prompts {
        args.extend(["--prompt-ids", p.as_str()]);
    }
    args.extend(["--max-new-tokens", n.as_str(), "--temperature", "0"]);
    let Some(out) = run(&args) else {
        return;
    };
    assert_success(&out);
    let expected: Vec<String> = cases.iter().map(|(_, g)| line_of(g)).collect();
    assert_eq!(
        String::from_utf8(out.stdout.clone()).unwrap(),
        format!("{}\n", expected.join("\n"))
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("speculative: ") && stderr.contains("% acceptance"),
        "{stderr}"
    );
    // An unknown drafter is refused like any bad argument.
    let Some(bad) = run(&[
        "--model",
        FIXTURE,
        "--speculative",
        "eagle",
        "--prompt-ids",
        "1",
        "--max-new-tokens",
        "2",
    ]) else {
        return;
    };
    assert!(!bad.status.success());
    assert!(bad.stdout.is_empty());
}
