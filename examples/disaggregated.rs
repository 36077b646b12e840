//! A prefill worker and a decode worker serving a mixed multi-tenant
//! workload through the verified-receipt handoff.
//!
//! ```sh
//! cargo run --release --example disaggregated
//! cargo run --release --example disaggregated -- --transport tcp --inject-corrupt-receipt
//! cargo run --release --example disaggregated -- --model ../shared/models/stories260K.bin
//! ```
//!
//! The workload: six ordinary requests from three tenants, one prompt
//! longer than the context window (rejected with a typed error before
//! anything is allocated), one request cancelled while its KV is in flight
//! (fenced, pages released), and one whose receipt is corrupted on purpose
//! with `--inject-corrupt-receipt` (fails verification: HTTP 500, no token).
//! Every successful request is checked token for token against the
//! colocated engine. The last line is the audit.
//!
//! Flags: `--transport inproc|tcp` (threads in one process, the default, or
//! a second process of this example on 127.0.0.1), `--model PATH` (a
//! llama2.c `.bin` file or a Hugging Face folder; default: an embedded model
//! with seeded random weights), `--inject-corrupt-receipt`.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use handoff::model::{Model, ModelConfig, ModelWeights, load_hf, load_llama2c, random_weights};
use handoff::transfer::{
    DecodeLink, DecodeWorker, Fault, FaultPlan, FaultRule, InProcess, PrefillWorker, Step,
    TcpDecodeListener, TcpPrefill, Transfer, TransferConfig,
};
use handoff::{
    Engine, EngineConfig, HttpStatus, KvDtype, Outcome, PoolStats, Request, RequestId, Role,
    TenantId,
};

const CANCELLED: RequestId = RequestId(8);
const CORRUPTED: RequestId = RequestId(9);
const MAX_NEW: usize = 16;

struct Args {
    tcp: bool,
    model: Option<PathBuf>,
    corrupt: bool,
    /// Internal: run as the prefill process, connecting to this address.
    prefill_of: Option<SocketAddr>,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        tcp: false,
        model: None,
        corrupt: false,
        prefill_of: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--transport" => match it.next().as_deref() {
                Some("tcp") => a.tcp = true,
                Some("inproc") | Some("threads") => a.tcp = false,
                other => return Err(format!("--transport inproc|tcp, got {other:?}")),
            },
            "--model" => a.model = Some(it.next().ok_or("--model needs a path")?.into()),
            "--inject-corrupt-receipt" => a.corrupt = true,
            "--role-prefill-of" => {
                let v = it.next().ok_or("--role-prefill-of needs an address")?;
                a.prefill_of = Some(v.parse().map_err(|e| format!("{v}: {e}"))?);
            }
            "-h" | "--help" => {
                return Err(
                    "usage: disaggregated [--transport inproc|tcp] [--model PATH] \
                            [--inject-corrupt-receipt]"
                        .into(),
                );
            }
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(a)
}

fn weights(path: Option<&Path>) -> Result<ModelWeights, String> {
    match path {
        None => Ok(random_weights(&ModelConfig::tiny_gqa(), 2026)),
        Some(p) if p.is_dir() => load_hf(p).map_err(|e| format!("{}: {e}", p.display())),
        Some(p) => load_llama2c(p).map_err(|e| format!("{}: {e}", p.display())),
    }
}

fn window(w: &ModelWeights) -> usize {
    w.config.max_seq_len.min(256)
}

fn config(w: &ModelWeights, role: Role) -> Result<EngineConfig, String> {
    let win = window(w);
    let pool = match role {
        Role::Decode => 4 * win,
        _ => 2 * win,
    };
    EngineConfig::builder(role, w.config.kv_geometry(KvDtype::F32))
        .max_context(win)
        .page_size(16)
        .pool_tokens(pool)
        // The audit line below counts violations only if the trail is kept.
        .audit(true)
        .build()
        .map_err(|e| e.to_string())
}

/// The faults the prefill side injects: the cancelled request's second
/// write batch is slow (so the cancel lands mid-transfer), and with
/// `--inject-corrupt-receipt` one receipt has a flipped checksum bit.
fn transfer_config(corrupt: bool) -> TransferConfig {
    let mut plan = FaultPlan::new().with(
        FaultRule::at(Step::KvWriting, Fault::Delay(Duration::from_millis(600)))
            .for_request(CANCELLED)
            .skip(1),
    );
    if corrupt {
        plan = plan.with(FaultRule::at(Step::ReceiptSent, Fault::Corrupt).for_request(CORRUPTED));
    }
    TransferConfig::default().with_faults(Arc::new(plan))
}

fn workload(w: &ModelWeights) -> Vec<Request> {
    let vocab = w.config.vocab_size as u64;
    let win = window(w);
    let mut x = 0x2026_u64;
    let mut prompt = |len: usize| -> Vec<u32> {
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % vocab) as u32
            })
            .collect()
    };
    let mut reqs = vec![
        (1, 1, prompt(12)),
        (CANCELLED.0, 2, prompt(win / 2)),
        (2, 1, prompt(40)),
        (3, 2, prompt(75)),
        (4, 3, prompt(20)),
        (5, 3, prompt(win / 2 + 3)),
        (6, 1, prompt(64)),
        // Longer than the context window: refused at admission.
        (7, 3, prompt(win + 50)),
        (CORRUPTED.0, 2, prompt(33)),
    ];
    reqs.sort_by_key(|r| r.0 != CANCELLED.0);
    reqs.into_iter()
        .map(|(id, tenant, p)| Request::new(RequestId(id), TenantId(tenant), p, MAX_NEW))
        .collect()
}

/// The prefill process of `--transport tcp`.
fn prefill_process(addr: SocketAddr, args: &Args) -> Result<(), String> {
    let w = weights(args.model.as_deref())?;
    let cfg = config(&w, Role::Prefill)?;
    let tcfg = transfer_config(args.corrupt);
    let link = TcpPrefill::connect(addr, &tcfg).map_err(|e| e.to_string())?;
    let model = Model::cpu(w).map_err(|e| e.to_string())?;
    let mut worker = PrefillWorker::new(link, model, &cfg, tcfg).map_err(|e| e.to_string())?;
    // Serves until decode closes the link.
    let stop = AtomicBool::new(false);
    let _ = worker.run(&stop);
    worker.shutdown();
    let s = worker.pool().stats();
    println!(
        "prefill-pool in_use={} held={} violations={}",
        s.in_use, s.held, s.isolation_violations
    );
    Ok(())
}

struct Served {
    tokens: Vec<u32>,
    outcome: Outcome,
}

/// Submits the workload, cancels one request mid-transfer, and steps the
/// decode worker until every request has ended.
fn serve<L: DecodeLink + 'static>(
    decode: &mut DecodeWorker<L>,
    reqs: &[Request],
) -> (Vec<Served>, Late) {
    let mut handles = Vec::new();
    let mut served: Vec<Option<Served>> = reqs.iter().map(|_| None).collect();
    for (i, r) in reqs.iter().enumerate() {
        match decode.submit(r.clone()) {
            Ok(h) => handles.push((i, h)),
            Err(rejection) => {
                served[i] = Some(Served {
                    tokens: Vec::new(),
                    outcome: Outcome::Rejected(rejection),
                })
            }
        }
    }
    let start = Instant::now();
    let mut cancelled = false;
    while !decode.is_idle() {
        decode.step(Duration::from_millis(10));
        if !cancelled && start.elapsed() > Duration::from_millis(200) {
            // The client of the slow request goes away mid-transfer.
            if let Some((_, h)) = handles.iter().find(|(i, _)| reqs[*i].id == CANCELLED) {
                h.cancel();
            }
            cancelled = true;
        }
    }
    for (i, h) in handles {
        let (tokens, outcome) = h.try_collect();
        served[i] = Some(Served {
            tokens,
            outcome: outcome.unwrap_or(Outcome::Cancelled),
        });
    }
    // Give late writes and receipts of the cancelled transfer time to
    // arrive: they must land nowhere.
    let until = Instant::now() + Duration::from_millis(800);
    while Instant::now() < until {
        decode.step(Duration::from_millis(20));
    }
    let late = Late {
        writes: decode.side().landing().stray_writes(),
        receipts: decode.side().stats().ignored_receipts,
    };
    (served.into_iter().flatten().collect(), late)
}

/// What arrived for transfers that had already ended.
#[derive(Clone, Copy, Default)]
struct Late {
    writes: u64,
    receipts: u64,
}

fn colocated(w: ModelWeights, reqs: &[Request]) -> Result<Vec<Vec<u32>>, String> {
    let mut cfg = config(&w, Role::Colocated)?;
    if cfg.pool_tokens() < 4 * cfg.max_context() {
        cfg = EngineConfig::builder(Role::Colocated, cfg.geometry())
            .max_context(cfg.max_context())
            .page_size(cfg.page_size())
            .pool_tokens(4 * cfg.max_context())
            .audit(true)
            .build()
            .map_err(|e| e.to_string())?;
    }
    let mut engine =
        Engine::new(Model::cpu(w).map_err(|e| e.to_string())?, cfg).map_err(|e| e.to_string())?;
    let handles: Vec<_> = reqs
        .iter()
        .map(|r| engine.submit(r.clone()).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    engine.run_until_idle();
    Ok(handles.into_iter().map(|h| h.try_collect().0).collect())
}

fn run(args: &Args) -> Result<bool, String> {
    let w = weights(args.model.as_deref())?;
    let name = args.model.as_ref().map_or(
        "embedded random-weights model (seed 2026)".to_string(),
        |p| p.display().to_string(),
    );
    let reqs = workload(&w);
    let dcfg = config(&w, Role::Decode)?;
    let tcfg = transfer_config(args.corrupt);
    eprintln!(
        "model: {name}; window {} tokens; transport {}; corrupt receipt: {}",
        dcfg.max_context(),
        if args.tcp {
            "tcp (two processes)"
        } else {
            "in-process (threads)"
        },
        args.corrupt
    );
    let model = Model::cpu(w.clone()).map_err(|e| e.to_string())?;

    type Run = (Vec<Served>, Late, PoolStats, (usize, usize, u64));
    let (served, late, decode_stats, prefill): Run = if args.tcp {
        let listener = TcpDecodeListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .map_err(|e| e.to_string())?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut cmd = Command::new(exe);
        cmd.arg("--role-prefill-of").arg(addr.to_string());
        if let Some(m) = &args.model {
            cmd.arg("--model").arg(m);
        }
        if args.corrupt {
            cmd.arg("--inject-corrupt-receipt");
        }
        let mut child = cmd
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("starting the prefill process: {e}"))?;
        let link = listener.accept(&tcfg).map_err(|e| e.to_string())?;
        let mut decode = DecodeWorker::new(link, model, &dcfg, tcfg).map_err(|e| e.to_string())?;
        let (served, late) = serve(&mut decode, &reqs);
        // Let the last answers reach prefill, then close the link: the
        // prefill process releases everything and reports its pool.
        std::thread::sleep(Duration::from_millis(100));
        let stats = decode.pool().stats();
        drop(decode);
        let out = child.stdout.take().ok_or("no prefill stdout")?;
        let mut prefill = None;
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if let Some(rest) = line.strip_prefix("prefill-pool ") {
                let v: Vec<u64> = rest
                    .split(' ')
                    .filter_map(|kv| kv.split_once('=').and_then(|(_, v)| v.parse().ok()))
                    .collect();
                if let [in_use, held, violations] = v[..] {
                    prefill = Some((in_use as usize, held as usize, violations));
                }
            }
        }
        let status = child.wait().map_err(|e| e.to_string())?;
        if !status.success() {
            return Err(format!("the prefill process failed: {status}"));
        }
        let prefill = prefill.ok_or("the prefill process reported no audit")?;
        (served, late, stats, prefill)
    } else {
        let (pl, dl) = InProcess.connect(&tcfg).map_err(|e| e.to_string())?;
        let pcfg = config(&w, Role::Prefill)?;
        let pmodel = Model::cpu(w.clone()).map_err(|e| e.to_string())?;
        let mut prefill =
            PrefillWorker::new(pl, pmodel, &pcfg, tcfg.clone()).map_err(|e| e.to_string())?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let _ = prefill.run(&stop);
                // Answers already sent are handled before shutting down.
                let _ = prefill.step(Duration::from_millis(50));
                prefill.shutdown();
                let s = prefill.pool().stats();
                (s.in_use, s.held, s.isolation_violations)
            })
        };
        let mut decode = DecodeWorker::new(dl, model, &dcfg, tcfg).map_err(|e| e.to_string())?;
        let (served, late) = serve(&mut decode, &reqs);
        stop.store(true, Ordering::Release);
        let prefill = thread.join().map_err(|_| "the prefill thread panicked")?;
        (served, late, decode.pool().stats(), prefill)
    };

    let ok_reqs: Vec<Request> = reqs
        .iter()
        .zip(&served)
        .filter(|(_, s)| matches!(s.outcome, Outcome::Finished(_)))
        .map(|(r, _)| r.clone())
        .collect();
    let reference = colocated(w, &ok_reqs)?;
    let mut reference = ok_reqs.iter().map(|r| r.id).zip(reference);

    let (mut ok, mut rejected, mut cancelled, mut failed, mut mismatched) = (0, 0, 0, 0, 0);
    let mut out = std::io::stdout().lock();
    for (r, s) in reqs.iter().zip(&served) {
        let head = format!("{} {} prompt={:>3}:", r.id, r.tenant, r.prompt.len());
        let line = match &s.outcome {
            Outcome::Finished(_) => {
                ok += 1;
                let same = reference
                    .find(|(id, _)| *id == r.id)
                    .is_some_and(|(_, want)| want == s.tokens);
                if !same {
                    mismatched += 1;
                }
                format!(
                    "{head} ok, {} tokens {:?}{} ({} colocated)",
                    s.tokens.len(),
                    &s.tokens[..s.tokens.len().min(6)],
                    if s.tokens.len() > 6 { "..." } else { "" },
                    if same { "matches" } else { "DIFFERS FROM" }
                )
            }
            Outcome::Rejected(e) => {
                rejected += 1;
                format!("{head} rejected, HTTP {}: {e}", e.http_status())
            }
            Outcome::Cancelled => {
                cancelled += 1;
                format!(
                    "{head} cancelled by the client mid-transfer: fenced and released, {} tokens; \
                     {} late KV writes and {} late receipt landed nowhere",
                    s.tokens.len(),
                    late.writes,
                    late.receipts
                )
            }
            Outcome::Failed(e) => {
                failed += 1;
                format!(
                    "{head} failed, HTTP {}, {} tokens generated: {e}",
                    e.http_status(),
                    s.tokens.len()
                )
            }
        };
        let _ = writeln!(out, "{line}");
    }
    let (p_in_use, p_held, p_violations) = prefill;
    let _ = writeln!(
        out,
        "audit: requests={} ok={ok} rejected={rejected} cancelled={cancelled} failed={failed} \
         leaked_pages={} held_pages={} isolation_violations={}",
        reqs.len(),
        decode_stats.in_use + p_in_use,
        decode_stats.held + p_held,
        decode_stats.isolation_violations + p_violations
    );
    let clean = decode_stats.is_full() && p_in_use == 0 && p_held == 0;
    Ok(clean && mismatched == 0 && decode_stats.isolation_violations + p_violations == 0)
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
