//! Generates from a llama2.c `.bin` file or a Hugging Face model folder,
//! serving every prompt concurrently in one continuous batch.
//!
//! ```sh
//! cargo run --release --example generate -- --model PATH \
//!     --prompt-ids 1,2,3 [--prompt-ids 1,5 ...] --max-new-tokens N --temperature 0
//! ```
//!
//! stdout: one line per prompt, in order: the generated token ids separated
//! by single spaces. Generation stops only at max new tokens unless
//! `--stop-ids` is given. Logs and timings go to stderr.
//!
//! Other flags: `--stop-ids 1,2`, `--top-k K`, `--top-p P`, `--seed S`
//! (request i uses S + i), `--page-size N` (16; a power of two, lowered to
//! fit the context window), `--kv-dtype f32|f16|bf16` (f32), `--threads N`
//! (all cores).
//!
//! Bad arguments (including counts that overflow, and prompts the engine
//! rejects) print the reason and the usage on stderr, nothing on stdout, and
//! exit with status 2. A request that fails while generating still gets its
//! line (the tokens it streamed), and the exit status is 1.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use handoff::backend::CpuBackend;
use handoff::model::Model;
use handoff::{
    Engine, EngineConfig, Event, KvDtype, Outcome, Request, RequestId, SamplingParams, TenantId,
};

struct Args {
    model: PathBuf,
    prompts: Vec<Vec<u32>>,
    max_new: usize,
    temperature: f32,
    top_k: Option<usize>,
    top_p: Option<f32>,
    seed: u64,
    stop_ids: Vec<u32>,
    page_size: usize,
    kv_dtype: KvDtype,
    threads: Option<usize>,
}

const USAGE: &str = "usage: generate --model PATH --prompt-ids 1,2,3 [--prompt-ids ...] \
--max-new-tokens N [--temperature T] [--top-k K] [--top-p P] [--seed S] [--stop-ids a,b] \
[--page-size N] [--kv-dtype f32|f16|bf16] [--threads N]";

fn ids(s: &str) -> Result<Vec<u32>, String> {
    s.split(',')
        .map(|t| {
            t.trim()
                .parse::<u32>()
                .map_err(|e| format!("bad token id {t:?}: {e}"))
        })
        .collect()
}

fn num<T: std::str::FromStr>(flag: &str, v: &str) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    v.parse().map_err(|e| format!("{flag} {v:?}: {e}"))
}

fn parse(mut it: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut a = Args {
        model: PathBuf::new(),
        prompts: Vec::new(),
        max_new: 0,
        temperature: 0.0,
        top_k: None,
        top_p: None,
        seed: 0,
        stop_ids: Vec::new(),
        page_size: 16,
        kv_dtype: KvDtype::F32,
        threads: None,
    };
    let mut have_model = false;
    while let Some(flag) = it.next() {
        let v = it.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--model" => {
                a.model = PathBuf::from(v);
                have_model = true;
            }
            "--prompt-ids" => a.prompts.push(ids(&v)?),
            "--max-new-tokens" => a.max_new = num(&flag, &v)?,
            "--temperature" => a.temperature = num(&flag, &v)?,
            "--top-k" => a.top_k = Some(num(&flag, &v)?),
            "--top-p" => a.top_p = Some(num(&flag, &v)?),
            "--seed" => a.seed = num(&flag, &v)?,
            "--stop-ids" => a.stop_ids = ids(&v)?,
            "--page-size" => a.page_size = num(&flag, &v)?,
            "--kv-dtype" => {
                a.kv_dtype =
                    KvDtype::parse(&v).ok_or(format!("--kv-dtype {v:?}: f32, f16 or bf16"))?
            }
            "--threads" => a.threads = Some(num(&flag, &v)?),
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if !have_model || a.prompts.is_empty() || a.max_new == 0 {
        return Err(
            "--model, at least one --prompt-ids and --max-new-tokens > 0 are required".into(),
        );
    }
    if !a.page_size.is_power_of_two() {
        return Err(format!(
            "--page-size {}: a power of two is required",
            a.page_size
        ));
    }
    for p in &a.prompts {
        tokens_needed(p, a.max_new)?;
    }
    Ok(a)
}

/// Prompt plus new tokens, or a usage error when that does not fit a `usize`.
fn tokens_needed(prompt: &[u32], max_new: usize) -> Result<usize, String> {
    prompt.len().checked_add(max_new).ok_or(format!(
        "--max-new-tokens {max_new} with a prompt of {} tokens is more tokens than can be counted",
        prompt.len()
    ))
}

/// `n` rounded up to whole pages, or a usage error on overflow.
fn whole_pages(n: usize, page: usize) -> Result<usize, String> {
    n.checked_next_multiple_of(page)
        .ok_or(format!("{n} tokens in pages of {page} overflow"))
}

/// The KV sizing that runs every prompt at once: `(max_context, page,
/// pool_tokens)`. The window covers the longest request, capped at the
/// model's `max_seq_len`; the pool holds every request (each capped at the
/// window: longer ones are rejected at submit) and at least twice the
/// window, in whole pages, as [`EngineConfig`] requires.
fn sizing(args: &Args, model_max: usize) -> Result<(usize, usize, usize), String> {
    let page = args.page_size;
    let mut need = 1;
    for p in &args.prompts {
        need = need.max(tokens_needed(p, args.max_new)?);
    }
    let max_context = whole_pages(need, page)?.min(model_max);
    let page = page.min(prev_power_of_two(max_context));
    let mut all = 0usize;
    for p in &args.prompts {
        let one = whole_pages(tokens_needed(p, args.max_new)?.min(max_context), page)?;
        all = all
            .checked_add(one)
            .ok_or("the prompts together need more tokens than can be counted")?;
    }
    let window2 = max_context
        .checked_mul(2)
        .ok_or("twice the context window overflows")?;
    Ok((max_context, page, whole_pages(all.max(window2), page)?))
}

fn main() -> ExitCode {
    match run() {
        Ok(code) => code,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "error: {e}\n{USAGE}");
            ExitCode::from(2)
        }
    }
}

fn run() -> Result<ExitCode, String> {
    let args = parse(std::env::args().skip(1))?;
    let mut err = std::io::stderr();
    let t_load = Instant::now();
    let backend = match args.threads {
        Some(n) => CpuBackend::with_threads(n),
        None => CpuBackend::new(),
    };
    let threads = backend.threads();
    // Placed as it is read: a bf16 checkpoint never sits in memory in f32.
    let model =
        Model::load(backend, &args.model).map_err(|e| format!("{}: {e}", args.model.display()))?;
    let mc = model.config().clone();
    let _ = writeln!(
        err,
        "loaded {} in {:.2?}: dim {}, {} layers, {} heads / {} KV heads, vocab {}, {:.1} MB of weights, {} threads",
        args.model.display(),
        t_load.elapsed(),
        mc.dim,
        mc.n_layers,
        mc.n_heads,
        mc.n_kv_heads,
        mc.vocab_size,
        model.weight_bytes() as f64 / 1e6,
        threads
    );

    // Size the deployment so that every prompt runs at once.
    let (max_context, page, pool_tokens) = sizing(&args, mc.max_seq_len)?;
    let cfg = EngineConfig::colocated(model.kv_geometry(args.kv_dtype))
        .max_context(max_context)
        .page_size(page)
        .pool_tokens(pool_tokens)
        .build()
        .map_err(|e| e.to_string())?;
    let mut engine = Engine::new(model, cfg).map_err(|e| e.to_string())?;

    let t0 = Instant::now();
    let mut handles = Vec::new();
    let mut rejected = Vec::new();
    for (i, prompt) in args.prompts.iter().enumerate() {
        let sampling = SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            seed: args.seed.wrapping_add(i as u64),
            stop_ids: args.stop_ids.clone(),
        };
        let req = Request::new(
            RequestId(i as u64),
            TenantId(0),
            prompt.clone(),
            args.max_new,
        )
        .with_sampling(sampling);
        match engine.submit(req) {
            Ok(h) => handles.push(h),
            Err(r) => rejected.push(format!(
                "prompt {i}: rejected ({}): {r}",
                handoff::HttpStatus::http_status(&r)
            )),
        }
    }
    // A prompt the engine refuses (a token outside the vocabulary, more
    // tokens than the model's window) is a bad argument: say why and print
    // no lines rather than a blank line that reads like an empty generation.
    if !rejected.is_empty() {
        return Err(rejected.join("\n"));
    }
    let mut failed = false;

    let n = handles.len();
    let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); n];
    let mut first: Vec<Option<Duration>> = vec![None; n];
    let mut outcome: Vec<Option<Outcome>> = vec![None; n];
    let mut steps = 0usize;
    while !engine.is_idle() {
        steps += 1;
        if !engine.step().progressed() {
            break;
        }
        for (i, h) in handles.iter().enumerate() {
            for ev in h.events().try_iter() {
                match ev {
                    Event::Token(t) => {
                        first[i].get_or_insert_with(|| t0.elapsed());
                        tokens[i].push(t);
                    }
                    Event::Done(o) => outcome[i] = Some(o),
                }
            }
        }
    }
    let elapsed = t0.elapsed();

    let mut out = std::io::stdout().lock();
    for (i, toks) in tokens.iter().enumerate() {
        let line: Vec<String> = toks.iter().map(u32::to_string).collect();
        writeln!(out, "{}", line.join(" ")).map_err(|e| e.to_string())?;
        if !matches!(outcome[i], Some(Outcome::Finished(_))) {
            let _ = writeln!(err, "prompt {i}: ended with {:?}", outcome[i]);
            failed = true;
        }
    }
    let generated: usize = tokens.iter().map(Vec::len).sum();
    let ttfts: Vec<Duration> = first.iter().flatten().copied().collect();
    let _ = writeln!(
        err,
        "{} prompts, {generated} tokens in {elapsed:.2?} ({steps} steps): {:.1} tokens/s; \
         time to first token: min {:.2?}, max {:.2?}",
        n,
        generated as f64 / elapsed.as_secs_f64().max(1e-9),
        ttfts.iter().min().copied().unwrap_or_default(),
        ttfts.iter().max().copied().unwrap_or_default(),
    );
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

fn prev_power_of_two(n: usize) -> usize {
    if n == 0 {
        1
    } else {
        1 << (usize::BITS - 1 - n.leading_zeros())
    }
}
