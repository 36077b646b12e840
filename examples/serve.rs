//! A serving stack in miniature: one [`Service`] owns the engine, client
//! threads submit and stream concurrently, and the service shuts down with
//! a grace period at the end.
//!
//! ```sh
//! cargo run --release --example serve                       # embedded random model
//! cargo run --release --example serve -- --clients 16 --requests 8 --max-new-tokens 64
//! cargo run --release --example serve -- --model ../shared/models/stories260K.bin
//! ```
//!
//! Every client sends the same prompts in the same order (greedy), so every
//! client must get the same tokens for each, however the engine batched them.
//! Per-client figures and a last line
//! `serve: clients=N requests=N ok=N rejected=N failed=N mismatched=0 tokens=N ... pool_full=true`
//! go to stdout; the exit status is non-zero if a request failed, two
//! clients disagreed, or a page was not returned.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use handoff::backend::CpuBackend;
use handoff::engine::Event;
use handoff::model::{Model, ModelConfig, random_weights};
use handoff::service::{Service, Submitter};
use handoff::{Engine, EngineConfig, KvDtype, Outcome, Request, RequestId, TenantId};

/// A line on stdout; a closed pipe is not an error worth a panic.
fn say(s: String) {
    let _ = writeln!(std::io::stdout(), "{s}");
}

struct Args {
    clients: usize,
    requests: usize,
    max_new: usize,
    model: Option<PathBuf>,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        clients: 8,
        requests: 4,
        max_new: 32,
        model: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let count = |v: String| {
            v.parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or(format!("{flag} takes a positive integer, not {v:?}"))
        };
        match flag.as_str() {
            "--clients" => a.clients = count(value()?)?,
            "--requests" => a.requests = count(value()?)?,
            "--max-new-tokens" => a.max_new = count(value()?)?,
            "--model" => a.model = Some(PathBuf::from(value()?)),
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    Ok(a)
}

/// What one client saw.
#[derive(Default)]
struct Seen {
    outputs: Vec<Option<Vec<u32>>>,
    ttft: Vec<Duration>,
    rejected: usize,
    failed: usize,
}

/// Sends `n` requests one after another, streaming each to its end.
fn client(s: Submitter, c: usize, n: usize, max_new: usize, vocab: u32) -> Seen {
    let mut seen = Seen::default();
    for r in 0..n {
        // The same prompt for request r on every client.
        let prompt: Vec<u32> = (0..(4 + 5 * r as u32))
            .map(|t| (t * 31 + r as u32 + 1) % vocab)
            .collect();
        let id = RequestId((c * n + r) as u64);
        let t = Instant::now();
        let h = match s.submit(Request::new(id, TenantId(c as u32), prompt, max_new)) {
            Ok(h) => h,
            Err(_) => {
                seen.rejected += 1;
                seen.outputs.push(None);
                continue;
            }
        };
        let mut tokens = Vec::new();
        let outcome = loop {
            match h.events().recv_timeout(Duration::from_secs(120)) {
                Ok(Event::Token(tok)) => {
                    if tokens.is_empty() {
                        seen.ttft.push(t.elapsed());
                    }
                    tokens.push(tok);
                }
                Ok(Event::Logprobs(_)) => {}
                Ok(Event::Done(o)) => break Some(o),
                Err(_) => break None,
            }
        };
        match outcome {
            Some(Outcome::Finished(_)) => seen.outputs.push(Some(tokens)),
            Some(Outcome::Rejected(_)) => {
                seen.rejected += 1;
                seen.outputs.push(None);
            }
            _ => {
                seen.failed += 1;
                seen.outputs.push(None);
            }
        }
    }
    seen
}

fn run() -> Result<bool, String> {
    let a = parse()?;
    let backend = CpuBackend::new();
    let model = match &a.model {
        Some(p) => Model::load(backend, p).map_err(|e| format!("{}: {e}", p.display()))?,
        None => Model::new(backend, random_weights(&ModelConfig::tiny_gqa(), 2026))
            .map_err(|e| e.to_string())?,
    };
    let vocab = model.config().vocab_size as u32;
    let window = (4 + 5 * a.requests + a.max_new).next_multiple_of(16);
    if window > model.config().max_seq_len {
        return Err(format!(
            "--requests {} and --max-new-tokens {} need a {window}-token window; the model has {}",
            a.requests,
            a.max_new,
            model.config().max_seq_len
        ));
    }
    let cfg = EngineConfig::colocated(model.kv_geometry(KvDtype::F32))
        .max_context(window)
        .pool_tokens(2 * window * a.clients)
        .build()
        .map_err(|e| e.to_string())?;
    let service = Service::spawn(Engine::new(model, cfg).map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?;

    let t = Instant::now();
    let threads: Vec<_> = (0..a.clients)
        .map(|c| {
            let s = service.submitter();
            let (n, max_new) = (a.requests, a.max_new);
            std::thread::spawn(move || client(s, c, n, max_new, vocab))
        })
        .collect();
    let seen: Vec<Seen> = threads
        .into_iter()
        .map(|t| t.join().map_err(|_| "a client thread panicked".to_string()))
        .collect::<Result<_, _>>()?;
    let wall = t.elapsed();
    let engine = service
        .shutdown(Duration::from_secs(10))
        .map_err(|e| e.to_string())?;
    let pool_full = engine.pool_stats().is_full();

    let mut mismatched = 0;
    for r in 0..a.requests {
        let mut first: Option<&Vec<u32>> = None;
        for s in &seen {
            if let Some(out) = &s.outputs[r] {
                match first {
                    None => first = Some(out),
                    Some(f) if f != out => mismatched += 1,
                    Some(_) => {}
                }
            }
        }
    }
    let mut ttft: Vec<Duration> = seen.iter().flat_map(|s| s.ttft.iter().copied()).collect();
    ttft.sort();
    let ok: usize = seen
        .iter()
        .map(|s| s.outputs.iter().flatten().count())
        .sum();
    let tokens: usize = seen
        .iter()
        .flat_map(|s| s.outputs.iter().flatten())
        .map(Vec::len)
        .sum();
    let (rejected, failed): (usize, usize) = seen
        .iter()
        .fold((0, 0), |(r, f), s| (r + s.rejected, f + s.failed));
    for (c, s) in seen.iter().enumerate() {
        let mean = s.ttft.iter().sum::<Duration>() / s.ttft.len().max(1) as u32;
        say(format!(
            "client {c}: {} of {} finished, mean time to first token {mean:.2?}",
            s.outputs.iter().flatten().count(),
            a.requests
        ));
    }
    let pct = |q: f64| {
        ttft.get(((ttft.len() as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or_default()
    };
    say(format!(
        "serve: clients={} requests={} ok={ok} rejected={rejected} failed={failed} mismatched={mismatched} tokens={tokens} wall={wall:.2?} tokens_per_s={:.0} ttft_p50={:.2?} ttft_max={:.2?} pool_full={pool_full}",
        a.clients,
        a.clients * a.requests,
        tokens as f64 / wall.as_secs_f64(),
        pct(0.5),
        pct(1.0),
    ));
    Ok(failed == 0 && rejected == 0 && mismatched == 0 && pool_full)
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "error: {e}");
            ExitCode::from(2)
        }
    }
}
