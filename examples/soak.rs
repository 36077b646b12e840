//! Soak: many requests through a decode worker (this process) and a prefill
//! worker (a second process) over TCP on 127.0.0.1, with random client
//! cancels and injected faults, checking every output and every page.
//!
//! ```sh
//! cargo run --release --example soak                      # 100,000 requests
//! cargo run --release --example soak -- --requests 20000 --cancel-pct 10 --fault-pct 5
//! ```
//!
//! - Model: a tiny random Llama-shaped model (seeded), greedy sampling.
//!   Prompts come from a fixed set of 256, so every output is checked
//!   against the colocated engine: a finished request must match exactly,
//!   any other must have streamed a prefix of it (never a wrong token).
//! - Cancels: `--cancel-pct` of the requests are cancelled by their client
//!   after a random number of decode steps (maybe after they finished).
//! - Faults: `--fault-pct` of the requests get one fault, chosen by a
//!   function of (seed, request) that both processes evaluate: one of the
//!   7 message faults or the 4 worker faults, at one of the 5 protocol
//!   steps. A fault that ends the link (disconnect, kill) makes both
//!   workers restart: decode finishes what it was generating, then accepts
//!   the prefill process's new connection.
//! - At the end: requests/s, outcomes, faults injected, restarts, peak RSS
//!   (VmHWM) of both processes, and pages held or leaked and isolation
//!   violations over every incarnation of both pools (all must be zero).
//!   The exit status is non-zero if any check failed.

use handoff::{
    Colocated, Decode, DecodeWorker, EngineConfigBuilder, Prefill, PrefillWorker, RoleKind,
};
use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use handoff::model::{Model, ModelConfig, ModelWeights, RopeStyle, random_weights};
use handoff::transfer::{
    Fault, FaultPlan, LinkError, Step, TcpDecodeListener, TcpPrefill, TransferConfig,
};
use handoff::{
    Engine, EngineConfig, Event, HttpStatus, KvDtype, Outcome, PoolStats, Request, RequestHandle,
    RequestId, TenantId,
};

const WINDOW: usize = 64;
const PAGE: usize = 8;
const PROMPTS: u64 = 256;

#[derive(Clone)]
struct Args {
    requests: u64,
    concurrency: usize,
    cancel_pct: u64,
    fault_pct: u64,
    seed: u64,
    prefill_of: Option<SocketAddr>,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        requests: 100_000,
        concurrency: 48,
        cancel_pct: 10,
        fault_pct: 5,
        seed: 2026,
        prefill_of: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut num = |name: &str| -> Result<u64, String> {
            let v = it.next().ok_or(format!("{name} needs a value"))?;
            v.parse().map_err(|e| format!("{name} {v}: {e}"))
        };
        match flag.as_str() {
            "--requests" => a.requests = num("--requests")?,
            "--concurrency" => a.concurrency = num("--concurrency")?.max(1) as usize,
            "--cancel-pct" => a.cancel_pct = num("--cancel-pct")?.min(100),
            "--fault-pct" => a.fault_pct = num("--fault-pct")?.min(100),
            "--seed" => a.seed = num("--seed")?,
            "--role-prefill-of" => {
                let v = it.next().ok_or("--role-prefill-of needs an address")?;
                a.prefill_of = Some(v.parse().map_err(|e| format!("{v}: {e}"))?);
            }
            other => {
                return Err(format!(
                    "unknown flag {other}; usage: soak [--requests N] [--concurrency N] \
                     [--cancel-pct P] [--fault-pct P] [--seed S]"
                ));
            }
        }
    }
    Ok(a)
}

fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

fn model_config() -> ModelConfig {
    ModelConfig {
        dim: 32,
        hidden_dim: 64,
        n_layers: 2,
        n_heads: 2,
        n_kv_heads: 1,
        head_dim: 16,
        vocab_size: 97,
        max_seq_len: WINDOW,
        rope_theta: 10_000.0,
        rope_style: RopeStyle::Interleaved,
        rope_scaling: Default::default(),
        norm_eps: 1e-5,
        tied_embeddings: false,
        attention_bias: false,
        qk_norm: false,
        gemma: None,
    }
}

fn config<R: RoleKind>(w: &ModelWeights, pool_tokens: usize) -> Result<EngineConfig<R>, String> {
    EngineConfigBuilder::<R>::new(w.config.kv_geometry(KvDtype::F32))
        .max_context(WINDOW)
        .page_size(PAGE)
        .pool_tokens(pool_tokens)
        .build()
        .map_err(|e| e.to_string())
}

/// The fault request `id` gets at `step`, if any; both processes agree.
fn fault_for(seed: u64, pct: u64, step: Step, id: RequestId) -> Option<Fault> {
    let h = mix(seed ^ mix(id.0 ^ 0xFA17));
    if h % 100 >= pct || Step::ALL[(h >> 8) as usize % Step::ALL.len()] != step {
        return None;
    }
    let decode_step = matches!(step, Step::PlanSent | Step::AckSent);
    Some(match (h >> 16) % 11 {
        0 => Fault::Drop,
        1 => Fault::Delay(Duration::from_millis(5)),
        2 => Fault::Duplicate,
        3 => Fault::Reorder,
        4 => Fault::Truncate,
        5 => Fault::Corrupt,
        6 => Fault::Disconnect,
        7 => Fault::Kill,
        // A client cancel needs the decode process: at prefill's steps it
        // becomes a corruption instead.
        8 if decode_step => Fault::CancelClient,
        8 => Fault::Corrupt,
        9 => Fault::ExhaustPool(Duration::from_millis(20)),
        _ => Fault::RejectAdmission,
    })
}

/// The link settings, and the fault plan (to count the faults it fired).
fn transfer_config(args: &Args) -> (TransferConfig, Arc<FaultPlan>) {
    let (seed, pct) = (args.seed, args.fault_pct);
    let plan =
        Arc::new(FaultPlan::new().with_source(move |step, id| fault_for(seed, pct, step, id)));
    let cfg = TransferConfig::default()
        .with_receipt_timeout(Duration::from_millis(300))
        .with_ack_timeout(Duration::from_millis(300))
        .with_write_timeout(Duration::from_millis(300))
        .with_plan_timeout(Duration::from_secs(2))
        .with_max_batch_bytes(2048)
        .with_faults(plan.clone());
    (cfg, plan)
}

fn peak_rss_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// Pages in use or held, and violations, of pools at the end of their
/// workers' lives.
#[derive(Default, Clone, Copy)]
struct PoolAudit {
    incarnations: u64,
    leaked: u64,
    held: u64,
    violations: u64,
}

impl PoolAudit {
    fn add(&mut self, s: PoolStats) {
        self.incarnations += 1;
        self.leaked += s.in_use as u64;
        self.held += s.held as u64;
        self.violations += s.isolation_violations;
    }
}

/// The prefill process: serves each connection until it ends, then
/// reconnects, until decode stops listening.
fn prefill_process(addr: SocketAddr, args: &Args) -> Result<(), String> {
    let w = random_weights(&model_config(), args.seed);
    let cfg = config::<Prefill>(&w, 40 * WINDOW)?;
    let (tcfg, plan) = transfer_config(args);
    let mut audit = PoolAudit::default();
    while let Ok(link) = TcpPrefill::connect(addr, &tcfg) {
        let model = Model::cpu(w.clone()).map_err(|e| e.to_string())?;
        let mut worker = PrefillWorker::new(link, model, cfg, tcfg.clone())
            .map_err(|e| e.to_string())?
            .with_max_batch_tokens(8 * WINDOW);
        // Returns when the link ends (a fault, or decode restarting).
        let _ = worker.run(&AtomicBool::new(false));
        worker.shutdown();
        audit.add(worker.pool().stats());
    }
    println!(
        "prefill-report incarnations={} leaked={} held={} violations={} faults={} vmhwm_kb={}",
        audit.incarnations,
        audit.leaked,
        audit.held,
        audit.violations,
        plan.fired(),
        peak_rss_kb()
    );
    Ok(())
}

struct Live {
    handle: RequestHandle,
    prompt: usize,
    tokens: Vec<u32>,
    cancel_at: Option<u64>,
}

#[derive(Default)]
struct Tally {
    done: u64,
    ok: u64,
    cancelled: u64,
    rejected: BTreeMap<u16, u64>,
    failed: BTreeMap<u16, u64>,
    wrong: u64,
}

fn reference(w: &ModelWeights, prompts: &[(Vec<u32>, usize)]) -> Result<Vec<Vec<u32>>, String> {
    let cfg = config::<Colocated>(w, 2 * WINDOW * prompts.len())?;
    let mut engine = Engine::new(Model::cpu(w.clone()).map_err(|e| e.to_string())?, cfg)
        .map_err(|e| e.to_string())?;
    let handles: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, (p, n))| {
            let r = Request::new(RequestId(i as u64), TenantId(0), p.clone(), *n);
            engine.submit(r).map_err(|e| e.to_string())
        })
        .collect::<Result<_, _>>()?;
    engine.run_until_idle();
    Ok(handles.into_iter().map(|h| h.try_collect().0).collect())
}

fn run(args: &Args) -> Result<bool, String> {
    let w = random_weights(&model_config(), args.seed);
    let prompts: Vec<(Vec<u32>, usize)> = (0..PROMPTS)
        .map(|i| {
            let h = mix(args.seed ^ (i << 20));
            let len = 4 + (h % 40) as usize;
            let toks = (0..len as u64).map(|j| (mix(h ^ j) % 97) as u32).collect();
            (toks, 1 + ((h >> 32) % 8) as usize)
        })
        .collect();
    let want = reference(&w, &prompts)?;
    let dcfg = config::<Decode>(&w, 3200)?;
    let (tcfg, plan) = transfer_config(args);

    let mut listener = TcpDecodeListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Reaped(
        Command::new(exe)
            .args(["--role-prefill-of", &addr.to_string()])
            .args(["--seed", &args.seed.to_string()])
            .args(["--fault-pct", &args.fault_pct.to_string()])
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("starting the prefill process: {e}"))?,
    );

    eprintln!(
        "soak: {} requests, {} in flight, {}% cancelled, {}% with a fault; decode pid {}, prefill pid {}",
        args.requests,
        args.concurrency,
        args.cancel_pct,
        args.fault_pct,
        std::process::id(),
        child.0.id()
    );
    let started = Instant::now();
    let mut tally = Tally::default();
    let mut audit = PoolAudit::default();
    let mut next = 0u64;
    let mut steps = 0u64;
    let mut restarts = 0u64;
    let mut last_report = Instant::now();
    while tally.done < args.requests {
        // The prefill process reconnects after each restart, unless it died
        // or hangs.
        let until = Instant::now() + Duration::from_secs(60);
        let link = loop {
            match listener.accept_within(&tcfg, Duration::from_millis(200)) {
                Ok(link) => break link,
                Err(LinkError::AcceptTimeout { .. }) => {
                    if let Some(status) = child.0.try_wait().map_err(|e| e.to_string())? {
                        return Err(format!("the prefill process exited: {status}"));
                    }
                    if Instant::now() > until {
                        return Err("the prefill process did not reconnect within 60 s".into());
                    }
                }
                Err(e) => return Err(e.to_string()),
            }
        };
        let model = Model::cpu(w.clone()).map_err(|e| e.to_string())?;
        let mut decode =
            DecodeWorker::new(link, model, dcfg, tcfg.clone()).map_err(|e| e.to_string())?;
        let mut live: HashMap<RequestId, Live> = HashMap::new();
        loop {
            // A request's plan may end the link (an injected kill): submit
            // only while it is up.
            while decode.side().link_error().is_none()
                && live.len() < args.concurrency
                && next < args.requests
            {
                let id = RequestId(next);
                next += 1;
                let h = mix(args.seed ^ mix(id.0));
                let p = (h % PROMPTS) as usize;
                let req = Request::new(
                    id,
                    TenantId((h >> 40) as u32 % 5),
                    prompts[p].0.clone(),
                    prompts[p].1,
                );
                let cancel_at = ((h >> 20) % 100 < args.cancel_pct).then(|| steps + (h >> 48) % 24);
                match decode.submit(req) {
                    Ok(handle) => {
                        live.insert(
                            id,
                            Live {
                                handle,
                                prompt: p,
                                tokens: Vec::new(),
                                cancel_at,
                            },
                        );
                    }
                    Err(r) => {
                        tally.done += 1;
                        *tally.rejected.entry(r.http_status()).or_default() += 1;
                    }
                }
            }
            decode.step();
            steps += 1;
            let mut ended = Vec::new();
            for (&id, l) in live.iter_mut() {
                if l.cancel_at.is_some_and(|at| steps >= at) {
                    l.handle.cancel();
                    l.cancel_at = None;
                }
                while let Ok(ev) = l.handle.events().try_recv() {
                    match ev {
                        Event::Token(t) => l.tokens.push(t),
                        Event::Logprobs(_) => {}
                        Event::Done(o) => ended.push((id, o)),
                    }
                }
            }
            for (id, outcome) in ended {
                let Some(l) = live.remove(&id) else { continue };
                let reference = &want[l.prompt];
                tally.done += 1;
                if !reference.starts_with(&l.tokens) {
                    tally.wrong += 1;
                    eprintln!(
                        "WRONG OUTPUT {id}: {:?} vs {reference:?} ({outcome:?})",
                        l.tokens
                    );
                }
                match outcome {
                    Outcome::Finished(_) if l.tokens == *reference => tally.ok += 1,
                    Outcome::Finished(_) => tally.wrong += 1,
                    Outcome::Cancelled => tally.cancelled += 1,
                    Outcome::Rejected(r) => {
                        *tally.rejected.entry(r.http_status()).or_default() += 1
                    }
                    Outcome::Failed(e) => *tally.failed.entry(e.http_status()).or_default() += 1,
                }
            }
            if last_report.elapsed() > Duration::from_secs(10) {
                last_report = Instant::now();
                eprintln!(
                    "  {:>7} done, {:.0} req/s, {restarts} restarts",
                    tally.done,
                    tally.done as f64 / started.elapsed().as_secs_f64()
                );
            }
            let link_up = decode.side().link_error().is_none();
            let finished = tally.done >= args.requests;
            if (!link_up || finished) && decode.is_idle() {
                break;
            }
        }
        // This incarnation is over (its link ended, or all requests did):
        // its pool must be full, with every fenced transfer released.
        decode.step();
        audit.add(decode.pool().stats());
        if tally.done < args.requests {
            restarts += 1;
        }
        // Only after the listener is gone may the link close for the last
        // time, so that the prefill process sees no one to reconnect to.
        if tally.done >= args.requests {
            drop(listener);
            drop(decode);
            break;
        }
    }
    let elapsed = started.elapsed();
    let out = child.0.stdout.take().ok_or("no prefill stdout")?;
    let mut report = None;
    for line in BufReader::new(out).lines().map_while(Result::ok) {
        if let Some(rest) = line.strip_prefix("prefill-report ") {
            let kv: HashMap<&str, u64> = rest
                .split(' ')
                .filter_map(|kv| {
                    kv.split_once('=')
                        .and_then(|(k, v)| Some((k, v.parse().ok()?)))
                })
                .collect();
            report = Some((
                PoolAudit {
                    incarnations: kv.get("incarnations").copied().unwrap_or(0),
                    leaked: kv.get("leaked").copied().unwrap_or(u64::MAX),
                    held: kv.get("held").copied().unwrap_or(u64::MAX),
                    violations: kv.get("violations").copied().unwrap_or(u64::MAX),
                },
                kv.get("faults").copied().unwrap_or(0),
                kv.get("vmhwm_kb").copied().unwrap_or(0),
            ));
        }
    }
    let status = child.0.wait().map_err(|e| e.to_string())?;
    let (p_audit, p_faults, p_rss) = report.ok_or("the prefill process reported nothing")?;

    let mut o = std::io::stdout().lock();
    let _ = writeln!(
        o,
        "soak: {} requests in {:.1} s = {:.0} requests/s, 2 processes over TCP loopback, {} restarts \
         (decode incarnations {}, prefill incarnations {})",
        tally.done,
        elapsed.as_secs_f64(),
        tally.done as f64 / elapsed.as_secs_f64(),
        restarts,
        audit.incarnations,
        p_audit.incarnations
    );
    let _ = writeln!(
        o,
        "outcomes: ok={} cancelled={} rejected={:?} failed={:?} (by HTTP status) wrong_outputs={}",
        tally.ok, tally.cancelled, tally.rejected, tally.failed, tally.wrong
    );
    let _ = writeln!(
        o,
        "faults injected: {} by decode, {} by prefill",
        plan.fired(),
        p_faults
    );
    let _ = writeln!(
        o,
        "peak RSS (VmHWM): decode {:.1} MiB, prefill {:.1} MiB",
        peak_rss_kb() as f64 / 1024.0,
        p_rss as f64 / 1024.0
    );
    let _ = writeln!(
        o,
        "end: held_pages={} leaked_pages={} isolation_violations={}",
        audit.held + p_audit.held,
        audit.leaked + p_audit.leaked,
        audit.violations + p_audit.violations
    );
    Ok(status.success()
        && tally.wrong == 0
        && audit.held + p_audit.held == 0
        && audit.leaked + p_audit.leaked == 0
        && audit.violations + p_audit.violations == 0)
}

/// The prefill process: killed (if still running) and reaped when dropped,
/// so no error path leaves it behind.
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
        }
        let _ = self.0.wait();
    }
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    if let Some(addr) = args.prefill_of {
        return match prefill_process(addr, &args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("prefill process: {e}");
                ExitCode::FAILURE
            }
        };
    }
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
