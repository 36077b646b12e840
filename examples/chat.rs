//! An interactive terminal chat with a model, streaming each answer as it is
//! generated, with the whole conversation as context.
//!
//! ```sh
//! cargo run --release --example chat -- --model PATH
//! ```
//!
//! `PATH` is a Hugging Face folder or a `.gguf` file whose tokenizer and chat
//! template come with it. Type a message and press Enter; `/reset` starts a
//! new conversation, `/exit` (or end of input) quits. Each turn renders the
//! whole conversation with the model's chat template; the answer ends at the
//! model's EOS or end-of-turn token or at `--max-new-tokens`. A conversation
//! that no longer fits the context window is refused (never cut): `/reset`.
//! Timings for each answer go to stderr.
//!
//! Flags: `--max-new-tokens N` (512), `--max-context N` (2048, capped at the
//! model's), `--system TEXT`, `--temperature T` (0.7; 0 is greedy),
//! `--top-p P` (0.9), `--seed S` (0), `--kv-dtype f32|f16|bf16|fp8` (f32),
//! `--threads N` (all cores), `--backend cpu|cuda` (cpu; cuda: GPU 0 with
//! KV pages in device memory, in a build with `--features cuda`).

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use handoff::backend::{Backend, CpuBackend};
use handoff::model::Model;
use handoff::text::{Message, StreamDecoder, TextModel};
use handoff::{
    Engine, EngineConfig, Event, HttpStatus, KvDtype, Outcome, Request, RequestId, SamplingParams,
    TenantId,
};

const USAGE: &str = "usage: chat --model PATH [--max-new-tokens N] [--max-context N] \
[--system TEXT] [--temperature T] [--top-p P] [--seed S] [--kv-dtype f32|f16|bf16|fp8] [--threads N] \
[--backend cpu|cuda]";

#[path = "support/on_gpu.rs"]
mod on_gpu;

struct Args {
    model: PathBuf,
    max_new: usize,
    max_context: usize,
    system: Option<String>,
    temperature: f32,
    top_p: f32,
    seed: u64,
    kv_dtype: KvDtype,
    threads: Option<usize>,
    cuda: bool,
}

fn num<T: std::str::FromStr>(flag: &str, v: &str) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    v.parse().map_err(|e| format!("{flag} {v:?}: {e}"))
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        model: PathBuf::new(),
        max_new: 512,
        max_context: 2048,
        system: None,
        temperature: 0.7,
        top_p: 0.9,
        seed: 0,
        kv_dtype: KvDtype::F32,
        threads: None,
        cuda: false,
    };
    let mut have_model = false;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let v = it.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--model" => {
                a.model = PathBuf::from(v);
                have_model = true;
            }
            "--max-new-tokens" => a.max_new = num(&flag, &v)?,
            "--max-context" => a.max_context = num(&flag, &v)?,
            "--system" => a.system = Some(v),
            "--temperature" => a.temperature = num(&flag, &v)?,
            "--top-p" => a.top_p = num(&flag, &v)?,
            "--seed" => a.seed = num(&flag, &v)?,
            "--kv-dtype" => {
                a.kv_dtype =
                    KvDtype::parse(&v).ok_or(format!("--kv-dtype {v:?}: f32, f16, bf16 or fp8"))?
            }
            "--threads" => a.threads = Some(num(&flag, &v)?),
            "--backend" => {
                a.cuda = match v.as_str() {
                    "cpu" => false,
                    "cuda" => true,
                    _ => return Err(format!("--backend {v:?}: cpu or cuda")),
                }
            }
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if a.cuda && a.threads.is_some() {
        return Err("--threads sets the CPU backend's threads; --backend cuda has none".into());
    }
    if !have_model || a.max_new == 0 || a.max_context == 0 {
        return Err("--model is required; --max-new-tokens and --max-context must be > 0".into());
    }
    Ok(a)
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "error: {e}\n{USAGE}");
            ExitCode::from(2)
        }
    }
}

fn run() -> Result<(), String> {
    let args = parse()?;
    if args.cuda {
        let gpu = on_gpu::open("chat")?;
        return chat(on_gpu::backend(&gpu), on_gpu::describe(&gpu), &args);
    }
    let backend = match args.threads {
        Some(n) => CpuBackend::with_threads(n),
        None => CpuBackend::new(),
    };
    let on = format!("{} threads", backend.threads());
    chat(backend, on, &args)
}

/// The conversation, with the model on `backend` (`on` in the log).
fn chat<B: Backend>(backend: B, on: String, args: &Args) -> Result<(), String> {
    let shown = |e: &dyn std::fmt::Display| format!("{}: {e}", args.model.display());
    let text = TextModel::load(&args.model).map_err(|e| shown(&e))?;
    text.chat_template().map_err(|e| shown(&e))?;
    let model = Model::load(backend, &args.model).map_err(|e| shown(&e))?;
    let max_context = args.max_context.min(model.config().max_seq_len);
    let pool_tokens = max_context
        .checked_mul(2)
        .ok_or("--max-context is too large")?;
    let cfg = EngineConfig::colocated(model.kv_geometry(args.kv_dtype))
        .max_context(max_context)
        .page_size(16.min(max_context.next_power_of_two()))
        .pool_tokens(pool_tokens)
        .build()
        .map_err(|e| e.to_string())?;
    let mut engine = Engine::new(model, cfg).map_err(|e| e.to_string())?;
    let tok = text.tokenizer();
    let mut err = std::io::stderr();
    let _ = writeln!(
        err,
        "chat with {} ({max_context}-token context, on {on}); /reset starts over, /exit quits",
        args.model.display()
    );

    let fresh = || -> Vec<Message> {
        args.system
            .iter()
            .map(|s| Message::new("system", s.as_str()))
            .collect()
    };
    let mut history = fresh();
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    for turn in 0u64.. {
        {
            let mut out = std::io::stdout().lock();
            let _ = write!(out, "\n> ");
            let _ = out.flush();
        }
        let Some(line) = lines.next() else { break };
        let line = line.map_err(|e| format!("cannot read stdin: {e}"))?;
        match line.trim() {
            "" => continue,
            "/exit" => break,
            "/reset" => {
                history = fresh();
                let _ = writeln!(err, "(new conversation)");
                continue;
            }
            _ => {}
        }
        history.push(Message::new("user", line.as_str()));
        let prompt = match text.render_chat(&history) {
            Ok((_, ids)) => ids,
            Err(e) => {
                let _ = writeln!(err, "cannot render this conversation: {e}");
                history.pop();
                continue;
            }
        };
        let sampling = SamplingParams {
            temperature: args.temperature,
            top_k: None,
            top_p: (args.temperature > 0.0).then_some(args.top_p),
            seed: args.seed.wrapping_add(turn),
            stop_ids: text.stop_ids().to_vec(),
            logprobs: None,
        };
        let room = max_context.saturating_sub(prompt.len()).min(args.max_new);
        let req = Request::new(RequestId(turn), TenantId(0), prompt.clone(), room.max(1))
            .with_sampling(sampling);
        let handle = match engine.submit(req) {
            Ok(h) => h,
            Err(r) => {
                let _ = writeln!(
                    err,
                    "refused ({}): {r}; the conversation is {} tokens: /reset to start over",
                    r.http_status(),
                    prompt.len()
                );
                history.pop();
                continue;
            }
        };
        let t0 = Instant::now();
        let mut first = None;
        let mut n = 0usize;
        let mut decoder = StreamDecoder::after(tok, &prompt, true);
        let mut answer = String::new();
        let mut outcome = None;
        while outcome.is_none() {
            if !engine.step().progressed() && engine.is_idle() {
                break;
            }
            for ev in handle.events().try_iter() {
                match ev {
                    Event::Token(t) => {
                        first.get_or_insert_with(|| t0.elapsed());
                        n += 1;
                        if text.stop_ids().contains(&t) {
                            continue;
                        }
                        match decoder.push(t) {
                            Ok(Some(chunk)) => {
                                answer.push_str(&chunk);
                                let mut out = std::io::stdout().lock();
                                let _ = out.write_all(chunk.as_bytes());
                                let _ = out.flush();
                            }
                            Ok(None) => {}
                            Err(e) => {
                                let _ = writeln!(err, "\n{e}");
                                engine.cancel(handle.id());
                            }
                        }
                    }
                    Event::Logprobs(_) => {}
                    Event::Done(o) => outcome = Some(o),
                }
            }
        }
        let tail = decoder.finish().map_err(|e| e.to_string())?;
        answer.push_str(&tail);
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{tail}");
        let elapsed = t0.elapsed();
        let _ = writeln!(
            err,
            "[{n} tokens in {elapsed:.2?}: {:.1} tokens/s; time to first token {:.2?}]",
            n as f64 / elapsed.as_secs_f64().max(1e-9),
            first.unwrap_or_default()
        );
        match outcome {
            Some(Outcome::Finished(_)) => history.push(Message::new("assistant", answer)),
            other => {
                let _ = writeln!(err, "the answer ended with {other:?}; it is not kept");
                history.pop();
            }
        }
    }
    Ok(())
}
