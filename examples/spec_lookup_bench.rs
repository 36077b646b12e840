//! Prompt-lookup speculative decoding against plain decoding, side by
//! side in one run: a single greedy stream on a summarise-this-text chat
//! prompt (the answer quotes its source), alternating the two modes
//! `--rounds` times (the model loaded afresh for each run). Prints each run's tokens/s, the
//! median ratio and the acceptance rate; checks the two outputs are the
//! same tokens.
//!
//! cargo run --release --example spec_lookup_bench -- \
//!     [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--max-new-tokens 128] \
//!     [--rounds 3] [--threads N] [--k 8]

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use handoff::backend::CpuBackend;
use handoff::model::Model;
use handoff::request::SpecConfig;
use handoff::text::{Message, TextModel};
use handoff::{
    Engine, EngineConfig, EngineOptions, KvDtype, Request, RequestId, SamplingParams, TenantId,
};

const SOURCE: &str = "The Rust borrow checker enforces that every value has a single owner, \
that references never outlive the value they point to, and that a value is either shared \
immutably by many readers or borrowed mutably by exactly one writer at a time. Because these \
rules are checked at compile time, data races and use-after-free bugs are ruled out without a \
garbage collector, and the generated code pays no runtime cost for the checks.";

struct Args {
    model: PathBuf,
    max_new: usize,
    rounds: usize,
    threads: Option<usize>,
    k: usize,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        model: PathBuf::from("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        max_new: 128,
        rounds: 3,
        threads: None,
        k: 8,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let v = it.next().ok_or(format!("{flag} needs a value"))?;
        let n = || v.parse::<usize>().map_err(|e| format!("{flag} {v:?}: {e}"));
        match flag.as_str() {
            "--model" => a.model = PathBuf::from(&v),
            "--max-new-tokens" => a.max_new = n()?,
            "--rounds" => a.rounds = n()?.max(1),
            "--threads" => a.threads = Some(n()?),
            "--k" => a.k = n()?,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    Ok(a)
}

/// One greedy generation.
struct Run {
    tokens: Vec<u32>,
    /// Seconds per decoded token (the first token's prefill apart).
    secs: f64,
    drafted: u64,
    accepted: u64,
}

/// One greedy generation of `prompt`, drafting with `spec` if given.
fn once(
    model: Model,
    prompt: &[u32],
    stops: &[u32],
    a: &Args,
    spec: Option<SpecConfig>,
) -> Result<Run, String> {
    let cfg = EngineConfig::colocated(model.kv_geometry(KvDtype::F32))
        .max_context(prompt.len() + a.max_new + 16)
        .page_size(16)
        .pool_tokens(4 * (prompt.len() + a.max_new + 16))
        .build()
        .map_err(|e| e.to_string())?;
    let opts = EngineOptions {
        prefix_cache: false,
        speculative: spec,
        ..EngineOptions::default()
    };
    let mut e = Engine::with_options(model, cfg, opts).map_err(|e| e.to_string())?;
    let req = Request::new(RequestId(1), TenantId(0), prompt.to_vec(), a.max_new).with_sampling(
        SamplingParams {
            stop_ids: stops.to_vec(),
            ..SamplingParams::greedy()
        },
    );
    let h = e.submit(req).map_err(|e| e.to_string())?;
    // Time the decode only: the first token (the prompt's prefill) apart.
    e.step();
    let t0 = Instant::now();
    let before = h.try_collect().0.len();
    e.run_until_idle();
    let secs = t0.elapsed().as_secs_f64();
    let tokens = h.try_collect().0;
    let t = e.tally();
    let n = (tokens.len() - before) as f64;
    Ok(Run {
        tokens,
        secs: secs / n.max(1.0),
        drafted: t.drafted,
        accepted: t.accepted,
    })
}

fn run() -> Result<(), String> {
    let a = parse()?;
    let load = || {
        let backend = match a.threads {
            Some(t) => CpuBackend::with_threads(t),
            None => CpuBackend::new(),
        };
        Model::load(backend, &a.model).map_err(|e| e.to_string())
    };
    let text = TextModel::load(&a.model).map_err(|e| e.to_string())?;
    let turn = format!("Summarise this text in two sentences, keeping its wording:\n\n{SOURCE}");
    let (_, prompt) = text
        .render_chat(&[Message::new("user", turn.as_str())])
        .map_err(|e| e.to_string())?;
    let spec = SpecConfig::prompt_lookup(1, 3, a.k);
    spec.validate()?;
    let mut ratios = Vec::new();
    for round in 0..a.rounds {
        let plain = once(load()?, &prompt, text.stop_ids(), &a, None)?;
        let spec_run = once(load()?, &prompt, text.stop_ids(), &a, Some(spec))?;
        if plain.tokens != spec_run.tokens {
            return Err(format!(
                "round {round}: drafted output differs from plain output"
            ));
        }
        let ratio = plain.secs / spec_run.secs;
        ratios.push(ratio);
        println!(
            "round {round}: {} tokens; plain {:.1} tok/s, prompt lookup {:.1} tok/s ({ratio:.2}x); \
             {} drafted, {} accepted ({:.1}%)",
            plain.tokens.len(),
            1.0 / plain.secs,
            1.0 / spec_run.secs,
            spec_run.drafted,
            spec_run.accepted,
            100.0 * spec_run.accepted as f64 / (spec_run.drafted as f64).max(1.0)
        );
        if round == 0 {
            eprintln!(
                "{}",
                text.tokenizer()
                    .decode(&plain.tokens, true)
                    .unwrap_or_default()
            );
        }
    }
    ratios.sort_by(f64::total_cmp);
    println!("median speed-up {:.2}x", ratios[ratios.len() / 2]);
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("spec_lookup_bench: {e}");
            ExitCode::FAILURE
        }
    }
}
