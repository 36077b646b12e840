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
//! (request i uses S + i), `--page-size N` (16), `--kv-dtype f32|f16|bf16`
//! (f32), `--threads N` (all cores).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use handoff::backend::CpuBackend;
use handoff::model::{Model, ModelWeights, load_hf, load_llama2c};
use handoff::{
    Engine, EngineConfig, Event, KvDtype, Outcome, Request, RequestId, Role, SamplingParams,
    TenantId,
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
    Ok(a)
}

fn load(path: &Path) -> Result<ModelWeights, String> {
    let w = if path.is_dir() {
        load_hf(path)
    } else {
        load_llama2c(path)
    };
    w.map_err(|e| format!("{}: {e}", path.display()))
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
    let weights = load(&args.model)?;
    let backend = match args.threads {
        Some(n) => CpuBackend::with_threads(n),
        None => CpuBackend::new(),
    };
    let threads = backend.threads();
    let model = Model::new(backend, weights).map_err(|e| e.to_string())?;
    let mc = model.config().clone();
    let _ = writeln!(
        err,
        "loaded {} in {:.2?}: dim {}, {} layers, {} heads / {} KV heads, vocab {}, {} threads",
        args.model.display(),
        t_load.elapsed(),
        mc.dim,
        mc.n_layers,
        mc.n_heads,
        mc.n_kv_heads,
        mc.vocab_size,
        threads
    );

    // Size the deployment so that every prompt runs at once.
    let page = args.page_size.max(1);
    let need = args
        .prompts
        .iter()
        .map(|p| p.len() + args.max_new)
        .max()
        .unwrap_or(1);
    let max_context = need.next_multiple_of(page).min(mc.max_seq_len);
    let page = page.min(prev_power_of_two(max_context));
    let all: usize = args
        .prompts
        .iter()
        .map(|p| (p.len() + args.max_new).next_multiple_of(page))
        .sum();
    let cfg = EngineConfig::builder(Role::Colocated, model.kv_geometry(args.kv_dtype))
        .max_context(max_context)
        .page_size(page)
        .pool_tokens(all.max(2 * max_context))
        .build()
        .map_err(|e| e.to_string())?;
    let mut engine = Engine::new(model, cfg).map_err(|e| e.to_string())?;

    let t0 = Instant::now();
    let mut handles = Vec::new();
    let mut failed = false;
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
            Ok(h) => handles.push(Some(h)),
            Err(r) => {
                let _ = writeln!(
                    err,
                    "prompt {i}: rejected ({}): {r}",
                    handoff::HttpStatus::http_status(&r)
                );
                failed = true;
                handles.push(None);
            }
        }
    }

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
            let Some(h) = h else { continue };
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
        if handles[i].is_some() && !matches!(outcome[i], Some(Outcome::Finished(_))) {
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
