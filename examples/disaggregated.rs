//! A prefill worker and a decode worker serving a mixed multi-tenant
//! workload through the verified-receipt handoff.
//!
//! ```sh
//! cargo run --release --example disaggregated
//! cargo run --release --example disaggregated -- --transport tcp --inject-corrupt-receipt
//! bash scripts/install-nixl.sh   # prints: export HANDOFF_NIXL_LIB=...
//! cargo run --release --features nixl --example disaggregated -- --transport nixl
//! cargo run --release --example disaggregated -- --model ../shared/models/stories260K.bin
//! ```
//!
//! The workload: six ordinary requests from three tenants, one prompt
//! longer than the context window (rejected with a typed error before
//! anything is allocated), one request cancelled while its KV is in flight
//! (fenced, pages released), and one whose receipt is corrupted on purpose
//! with `--inject-corrupt-receipt` (fails verification: HTTP 500, no token).
//! Every successful request is checked token for token against the
//! colocated engine. The last line is the audit:
//!
//! ```text
//! audit: requests=N ok=N rejected=N cancelled=N failed=N leaked_pages=0 held_pages=0 isolation_violations=0
//! ```
//!
//! Every request is counted once; one that never got an outcome is lost
//! and counts as failed. `held_pages` is read in both pools once the
//! workload has drained, before shutdown (which releases everything held,
//! so only then does it show whether decode's answers released the source
//! pages); `leaked_pages` counts pages in use then or not free after
//! shutdown. The exit status is 0 only when nothing was lost, leaked, held
//! or seen by another request, and every output matches colocated serving.
//!
//! Flags: `--transport inproc|tcp|nixl` (threads in one process, the
//! default, or a second process of this example on 127.0.0.1; the TCP link
//! authenticates both processes with their own fresh worker keys, each
//! trusting only the other (the prefill worker's key goes to it in a file
//! only this user reads, named in its environment with the decode worker's
//! id), and seals every frame; `--no-auth` runs it unauthenticated, as
//! loopback without identities allows; `nixl` moves the KV
//! bytes by NIXL READ between the processes, beside the same TCP link, and
//! needs the `nixl` feature and `$HANDOFF_NIXL_LIB`), `--model PATH` (a
//! llama2.c `.bin` file or a Hugging Face folder; default: an embedded model
//! with seeded random weights), `--inject-corrupt-receipt`, `--backend
//! cpu|cuda` (`cuda`: both workers and the colocated reference on GPU 0,
//! KV pages in device memory, KV moved device to device in one process;
//! needs the `cuda` feature and a GPU, and is refused with the reason
//! otherwise).

use handoff::{
    Colocated, Decode, DecodeWorker, EngineConfigBuilder, Prefill, PrefillWorker, RoleKind,
};
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use handoff::backend::{Backend, CpuBackend};
use handoff::model::{Model, ModelConfig, ModelWeights, load_hf, load_llama2c, random_weights};
use handoff::transfer::{
    Allowlist, DecodeLink, Identity, InProcess, LinkError, PeerId, PrefillLink, TcpDecodeListener,
    TcpPrefill, Transfer, TransferConfig, WorkerKey,
};
use handoff::{
    Engine, EngineConfig, HttpStatus, KvDtype, Outcome, PoolStats, Rejection, Request,
    RequestHandle, RequestId, Role, TenantId,
};

#[path = "support/on_gpu.rs"]
mod on_gpu;
#[path = "support/staged_link.rs"]
mod staged_link;
use staged_link::{StagedLink, Staging};

const CANCELLED: RequestId = RequestId(8);
const CORRUPTED: RequestId = RequestId(9);
const MAX_NEW: usize = 16;
/// The environment variable that names the prefill worker's key file (a
/// file only this user reads).
const KEY_ENV: &str = "HANDOFF_WORKER_KEY_FILE";
/// The environment variable that hands the decode worker's id (its public
/// key) to the prefill process: the one peer it trusts and dials.
const DECODE_ID_ENV: &str = "HANDOFF_DECODE_ID";

/// The prefill worker's key file, written by the decode process, and the
/// decode worker's id; the file is removed when this is dropped.
struct KeyFile {
    path: std::path::PathBuf,
    decode_id: PeerId,
}

impl Drop for KeyFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        if let Some(dir) = self.path.parent() {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// Where the models compute.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BackendKind {
    Cpu,
    Cuda,
}

/// Places a model's weights on one backend (each worker gets its own).
trait Place {
    type B: Backend;
    fn place(&self, w: ModelWeights) -> Result<Model<Self::B>, String>;
    fn describe(&self) -> String;
}

/// The CPU backend, every core.
struct OnCpu;

impl Place for OnCpu {
    type B = CpuBackend;
    fn place(&self, w: ModelWeights) -> Result<Model<CpuBackend>, String> {
        Model::cpu(w).map_err(|e| e.to_string())
    }
    fn describe(&self) -> String {
        "cpu".into()
    }
}

/// How the two workers are joined.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Link {
    Threads,
    Tcp,
    Nixl,
}

struct Args {
    link: Link,
    backend: BackendKind,
    /// `--no-auth`: the TCP link without worker identities (loopback only).
    no_auth: bool,
    model: Option<PathBuf>,
    corrupt: bool,
    /// Internal: run as the prefill process, connecting to this address.
    prefill_of: Option<SocketAddr>,
    /// Test aid: the prefill process waits this long after connecting
    /// before serving, so its requests are certainly in flight meanwhile.
    prefill_stall_ms: u64,
    /// The KV pages' element type, in every pool (f32 by default).
    kv_dtype: KvDtype,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        link: Link::Threads,
        backend: BackendKind::Cpu,
        no_auth: false,
        model: None,
        corrupt: false,
        prefill_of: None,
        prefill_stall_ms: 0,
        kv_dtype: KvDtype::F32,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--transport" => match it.next().as_deref() {
                Some("tcp") => a.link = Link::Tcp,
                Some("nixl") => a.link = Link::Nixl,
                Some("inproc") | Some("threads") => a.link = Link::Threads,
                other => return Err(format!("--transport inproc|tcp|nixl, got {other:?}")),
            },
            "--backend" => match it.next().as_deref() {
                Some("cpu") => a.backend = BackendKind::Cpu,
                Some("cuda") => a.backend = BackendKind::Cuda,
                other => return Err(format!("--backend cpu|cuda, got {other:?}")),
            },
            "--model" => a.model = Some(it.next().ok_or("--model needs a path")?.into()),
            "--kv-dtype" => {
                let v = it.next().ok_or("--kv-dtype needs f32, f16, bf16 or fp8")?;
                a.kv_dtype =
                    KvDtype::parse(&v).ok_or(format!("--kv-dtype {v:?}: f32, f16, bf16 or fp8"))?;
            }
            "--inject-corrupt-receipt" => a.corrupt = true,
            "--no-auth" => a.no_auth = true,
            "--prefill-stall-ms" => {
                let v = it.next().ok_or("--prefill-stall-ms needs a number")?;
                a.prefill_stall_ms = v.parse().map_err(|e| format!("{v}: {e}"))?;
            }
            "--role-prefill-of" => {
                let v = it.next().ok_or("--role-prefill-of needs an address")?;
                a.prefill_of = Some(v.parse().map_err(|e| format!("{v}: {e}"))?);
            }
            "-h" | "--help" => {
                return Err(
                    "usage: disaggregated [--transport inproc|tcp|nixl] [--backend cpu|cuda] \
                            [--no-auth (tcp or nixl without worker keys)] [--model PATH] \
                            [--kv-dtype f32|f16|bf16|fp8] \
                            [--inject-corrupt-receipt] [--prefill-stall-ms N (tcp: the prefill \
                            process waits N ms after connecting; a test aid)]"
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

fn config<R: RoleKind>(w: &ModelWeights, kv: KvDtype) -> Result<EngineConfig<R>, String> {
    let win = window(w);
    let pool = match R::ROLE {
        Role::Decode => 4 * win,
        _ => 2 * win,
    };
    EngineConfigBuilder::<R>::new(w.config.kv_geometry(kv))
        .max_context(win)
        .page_size(16)
        .pool_tokens(pool)
        // The audit line below counts violations only if the trail is kept.
        .audit(true)
        .build()
        .map_err(|e| e.to_string())
}

/// What the prefill end of the link stages (see `support/staged_link.rs`,
/// which needs no test-only crate feature): the cancelled request's second
/// write batch is slow (so the cancel lands mid-transfer), and with
/// `--inject-corrupt-receipt` one receipt has a flipped checksum bit.
fn staging(corrupt: bool) -> Staging {
    Staging {
        slow_second_write: Some((CANCELLED, Duration::from_millis(600))),
        corrupt_receipt_of: corrupt.then_some(CORRUPTED),
    }
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

/// The prefill process of `--transport tcp`. It serves until the decode
/// process writes a line on its stdin (the workload has drained), reports
/// its pool then, serves on until decode closes the link, shuts down and
/// reports its pool again.
fn prefill_process<P: Place>(addr: SocketAddr, args: &Args, on: &P) -> Result<(), String> {
    let w = weights(args.model.as_deref())?;
    let cfg = config::<Prefill>(&w, args.kv_dtype)?;
    let mut tcfg = TransferConfig::default();
    // The decode process hands over this worker's key and its own id, if
    // the link authenticates.
    let mut decode_id = None;
    if let Ok(path) = std::env::var(KEY_ENV) {
        let key = WorkerKey::load(&path).map_err(|e| e.to_string())?;
        let hex = std::env::var(DECODE_ID_ENV).map_err(|e| format!("{DECODE_ID_ENV}: {e}"))?;
        let id = PeerId::from_hex(&hex).map_err(|e| e.to_string())?;
        tcfg = tcfg.with_identity(Identity::new(key, Allowlist::of([id])));
        decode_id = Some(id);
    }
    let link = match (args.link, decode_id) {
        (Link::Nixl, _) => nixl::connect(addr, decode_id.as_ref(), &tcfg)?,
        (_, Some(id)) => TcpPrefill::connect_to(addr, &id, &tcfg).map_err(|e| e.to_string())?,
        (_, None) => TcpPrefill::connect(addr, &tcfg).map_err(|e| e.to_string())?,
    };
    let link = StagedLink::new(link, staging(args.corrupt));
    std::thread::sleep(Duration::from_millis(args.prefill_stall_ms));
    let model = on.place(w)?;
    let mut worker = PrefillWorker::new(link, model, cfg, tcfg).map_err(|e| e.to_string())?;
    let drained = Arc::new(AtomicBool::new(false));
    {
        let drained = drained.clone();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = std::io::stdin().read_line(&mut line);
            drained.store(true, Ordering::Release);
        });
    }
    worker
        .run(&drained)
        .map_err(|e| format!("the link ended before the workload drained: {e}"))?;
    let s = drained_stats(&mut worker)?;
    println!(
        "prefill-pool drained in_use={} held={} ack_timeouts={}",
        s.in_use,
        s.held,
        worker.side().stats().ack_timeouts
    );
    // Decode closes the link once it has read the line above.
    while worker.step(Duration::from_millis(20)).is_ok() {}
    worker.shutdown();
    let s = worker.pool().stats();
    println!(
        "prefill-pool shutdown not_free={} violations={}",
        s.capacity - s.free,
        s.isolation_violations
    );
    Ok(())
}

/// The prefill pool once the workload has drained, before shutdown (which
/// drops every held transfer, so only figures taken before it show whether
/// decode's answers released the source pages). Answers already sent are
/// handled first, for at most two seconds (far below the ack timeout, so
/// an answer that released nothing still shows as held pages).
fn drained_stats<L: PrefillLink, B: Backend>(
    worker: &mut PrefillWorker<L, B>,
) -> Result<PoolStats, String> {
    let until = Instant::now() + Duration::from_secs(2);
    loop {
        worker
            .step(Duration::from_millis(20))
            .map_err(|e| format!("the link ended before the prefill pool was audited: {e}"))?;
        let s = worker.pool().stats();
        if (s.in_use == 0 && s.held == 0) || Instant::now() >= until {
            return Ok(s);
        }
    }
}

/// One pool's audit: pages still in use or held once the workload has
/// drained (every transfer was acked or failed, every request ended), and
/// pages not free after its worker shut down.
#[derive(Clone, Copy, Debug, Default)]
struct PoolAudit {
    drained_in_use: usize,
    drained_held: usize,
    not_free_after_shutdown: usize,
    violations: u64,
    /// Prefill only: held transfers released by the ack timeout rather
    /// than by decode's answer (every transfer here gets an answer, so an
    /// answer released nothing).
    ack_timeouts: u64,
}

impl PoolAudit {
    fn new(drained: PoolStats, after: PoolStats) -> Self {
        PoolAudit {
            drained_in_use: drained.in_use,
            drained_held: drained.held,
            not_free_after_shutdown: after.capacity - after.free,
            violations: drained.isolation_violations.max(after.isolation_violations),
            ack_timeouts: 0,
        }
    }
    /// Pages leaked: in use once drained, or not free after shutdown.
    fn leaked(&self) -> usize {
        self.drained_in_use.max(self.not_free_after_shutdown)
    }
}

/// How one request ended, as its client saw it. `outcome` is `None` when
/// the request never got one: it was lost, and counts as failed.
struct Served {
    tokens: Vec<u32>,
    outcome: Option<Outcome>,
}

/// The longest the workload may take before the requests without an
/// outcome are declared lost (a debug build needs a few seconds).
const WORKLOAD_DEADLINE: Duration = Duration::from_secs(120);

/// Submits the workload, cancels one request mid-transfer, and steps the
/// decode worker until every request has ended (or the deadline passed).
/// Returns one entry per request, in order.
fn serve<L: DecodeLink + 'static, B: Backend>(
    decode: &mut DecodeWorker<L, B>,
    reqs: &[Request],
) -> (Vec<Served>, Late) {
    let handles: Vec<Result<RequestHandle, Rejection>> =
        reqs.iter().map(|r| decode.submit(r.clone())).collect();
    let start = Instant::now();
    let mut cancelled = false;
    while !decode.is_idle() && start.elapsed() < WORKLOAD_DEADLINE {
        decode.step();
        if !cancelled && start.elapsed() > Duration::from_millis(200) {
            // The client of the slow request goes away mid-transfer.
            if let Some(Ok(h)) = reqs
                .iter()
                .zip(&handles)
                .find_map(|(r, h)| (r.id == CANCELLED).then_some(h))
            {
                h.cancel();
            }
            cancelled = true;
        }
    }
    let served = handles
        .into_iter()
        .map(|h| match h {
            Err(rejection) => Served {
                tokens: Vec::new(),
                outcome: Some(Outcome::Rejected(rejection)),
            },
            Ok(h) => {
                let (tokens, outcome) = h.try_collect();
                Served { tokens, outcome }
            }
        })
        .collect();
    // Give late writes and receipts of the cancelled transfer time to
    // arrive: they must land nowhere.
    let until = Instant::now() + Duration::from_millis(800);
    while Instant::now() < until {
        decode.step();
    }
    let late = Late {
        writes: decode.side().landing().stray_writes(),
        receipts: decode.side().stats().ignored_receipts,
    };
    (served, late)
}

/// What arrived for transfers that had already ended.
#[derive(Clone, Copy, Default)]
struct Late {
    writes: u64,
    receipts: u64,
}

fn colocated<P: Place>(
    w: ModelWeights,
    kv: KvDtype,
    reqs: &[Request],
    on: &P,
) -> Result<Vec<Vec<u32>>, String> {
    let mut cfg = config::<Colocated>(&w, kv)?;
    if cfg.pool_tokens() < 4 * cfg.max_context() {
        cfg = EngineConfig::colocated(cfg.geometry())
            .max_context(cfg.max_context())
            .page_size(cfg.page_size())
            .pool_tokens(4 * cfg.max_context())
            .audit(true)
            .build()
            .map_err(|e| e.to_string())?;
    }
    let mut engine = Engine::new(on.place(w)?, cfg).map_err(|e| e.to_string())?;
    let handles: Vec<_> = reqs
        .iter()
        .map(|r| engine.submit(r.clone()).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    engine.run_until_idle();
    Ok(handles.into_iter().map(|h| h.try_collect().0).collect())
}

fn run<P: Place>(args: &Args, on: &P) -> Result<bool, String> {
    let w = weights(args.model.as_deref())?;
    let name = args.model.as_ref().map_or(
        "embedded random-weights model (seed 2026)".to_string(),
        |p| p.display().to_string(),
    );
    let reqs = workload(&w);
    let dcfg = config::<Decode>(&w, args.kv_dtype)?;
    let mut tcfg = TransferConfig::default();
    let two_processes = args.link != Link::Threads;
    // Each process its own worker key, each trusting only the other; the
    // prefill worker's goes to it in a file only this user reads.
    let key = if two_processes && !args.no_auth {
        let err = |e: handoff::transfer::IdentityError| e.to_string();
        let (dkey, pkey) = (
            WorkerKey::generate().map_err(err)?,
            WorkerKey::generate().map_err(err)?,
        );
        let dir =
            std::env::temp_dir().join(format!("handoff-disaggregated-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let path = dir.join("prefill.key");
        let _ = std::fs::remove_file(&path);
        pkey.save(&path).map_err(err)?;
        let decode_id = dkey.peer_id();
        tcfg = tcfg.with_identity(Identity::new(dkey, Allowlist::of([pkey.peer_id()])));
        Some(KeyFile { path, decode_id })
    } else {
        None
    };
    eprintln!(
        "model: {name}; window {} tokens; backend {}; transport {}; corrupt receipt: {}",
        dcfg.max_context(),
        on.describe(),
        match (args.link, &key) {
            (Link::Tcp, Some(_)) =>
                "tcp (two processes, authenticated: Noise IK with worker keys, sealed frames)",
            (Link::Tcp, None) => "tcp (two processes, unauthenticated loopback)",
            (Link::Nixl, Some(_)) =>
                "nixl (two processes: KV by NIXL READ over UCX; plans and receipts on \
                 authenticated tcp)",
            (Link::Nixl, None) => "nixl (two processes; control link unauthenticated loopback)",
            (Link::Threads, _) => "in-process (threads)",
        },
        args.corrupt
    );
    let model = on.place(w.clone())?;

    type Run = (Vec<Served>, Late, PoolAudit, Result<PoolAudit, String>);
    let (served, late, decode_audit, prefill_audit): Run = if two_processes {
        let mut listener = match args.link {
            Link::Nixl => nixl::bind()?,
            _ => TcpDecodeListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
                .map_err(|e| e.to_string())?,
        };
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut cmd = Command::new(exe);
        cmd.arg("--role-prefill-of").arg(addr.to_string());
        if args.link == Link::Nixl {
            cmd.arg("--transport").arg("nixl");
        }
        if args.backend == BackendKind::Cuda {
            cmd.arg("--backend").arg("cuda");
        }
        cmd.arg("--kv-dtype").arg(args.kv_dtype.name());
        match &key {
            Some(k) => cmd
                .env(KEY_ENV, &k.path)
                .env(DECODE_ID_ENV, k.decode_id.to_string()),
            None => cmd.env_remove(KEY_ENV).env_remove(DECODE_ID_ENV),
        };
        if let Some(m) = &args.model {
            cmd.arg("--model").arg(m);
        }
        if args.corrupt {
            cmd.arg("--inject-corrupt-receipt");
        }
        if args.prefill_stall_ms > 0 {
            cmd.arg("--prefill-stall-ms")
                .arg(args.prefill_stall_ms.to_string());
        }
        let mut child = PrefillProcess(
            cmd.stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .map_err(|e| format!("starting the prefill process: {e}"))?,
        );
        // Wait for the prefill process to connect, unless it dies or hangs.
        let until = Instant::now() + PREFILL_DEADLINE;
        let link = loop {
            let accepted = match args.link {
                Link::Nixl => nixl::accept_within(&listener, &tcfg, Duration::from_millis(200)),
                _ => listener.accept_within(&tcfg, Duration::from_millis(200)),
            };
            match accepted {
                Ok(link) => break link,
                Err(LinkError::AcceptTimeout { .. }) => {
                    if let Some(status) = child.0.try_wait().map_err(|e| e.to_string())? {
                        return Err(format!(
                            "the prefill process exited before connecting: {status}"
                        ));
                    }
                    if Instant::now() > until {
                        return Err(format!(
                            "the prefill process did not connect within {PREFILL_DEADLINE:?}"
                        ));
                    }
                }
                Err(e) => return Err(e.to_string()),
            }
        };
        let mut decode = DecodeWorker::new(link, model, dcfg, tcfg).map_err(|e| e.to_string())?;
        let (served, late) = serve(&mut decode, &reqs);
        let d_drained = decode.pool().stats();
        let pool = decode.pool().clone();
        // Closing the link (dropping decode) makes the prefill process shut
        // down; its figures are read before and after.
        let prefill = audit_prefill_process(&mut child.0, move || drop(decode));
        let d_after = pool.stats();
        drop(child); // reaped, or killed and reaped if the audit failed
        (served, late, PoolAudit::new(d_drained, d_after), prefill)
    } else {
        let (pl, dl) = InProcess.connect(&tcfg).map_err(|e| e.to_string())?;
        let pl = StagedLink::new(pl, staging(args.corrupt));
        let pcfg = config::<Prefill>(&w, args.kv_dtype)?;
        let pmodel = on.place(w.clone())?;
        let mut prefill =
            PrefillWorker::new(pl, pmodel, pcfg, tcfg.clone()).map_err(|e| e.to_string())?;
        let drained = Arc::new(AtomicBool::new(false));
        let thread = {
            let drained = drained.clone();
            std::thread::spawn(move || -> Result<PoolAudit, String> {
                prefill
                    .run(&drained)
                    .map_err(|e| format!("the link ended before the workload drained: {e}"))?;
                let before = drained_stats(&mut prefill)?;
                let ack_timeouts = prefill.side().stats().ack_timeouts;
                prefill.shutdown();
                Ok(PoolAudit {
                    ack_timeouts,
                    ..PoolAudit::new(before, prefill.pool().stats())
                })
            })
        };
        let mut decode = DecodeWorker::new(dl, model, dcfg, tcfg).map_err(|e| e.to_string())?;
        let (served, late) = serve(&mut decode, &reqs);
        let d_drained = decode.pool().stats();
        drained.store(true, Ordering::Release);
        let prefill = thread
            .join()
            .map_err(|_| "the prefill thread panicked".to_string())
            .and_then(|r| r);
        let pool = decode.pool().clone();
        drop(decode);
        (
            served,
            late,
            PoolAudit::new(d_drained, pool.stats()),
            prefill,
        )
    };
    if served.len() != reqs.len() {
        return Err(format!(
            "{} outcomes for {} requests",
            served.len(),
            reqs.len()
        ));
    }

    let ok_reqs: Vec<Request> = reqs
        .iter()
        .zip(&served)
        .filter(|(_, s)| matches!(s.outcome, Some(Outcome::Finished(_))))
        .map(|(r, _)| r.clone())
        .collect();
    let reference = colocated(w, args.kv_dtype, &ok_reqs, on)?;
    let mut reference = ok_reqs.iter().map(|r| r.id).zip(reference);

    let (mut ok, mut rejected, mut cancelled, mut failed) = (0usize, 0usize, 0usize, 0usize);
    let (mut mismatched, mut lost) = (0, 0);
    let mut out = std::io::stdout().lock();
    for (r, s) in reqs.iter().zip(&served) {
        let head = format!("{} {} prompt={:>3}:", r.id, r.tenant, r.prompt.len());
        let line = match &s.outcome {
            Some(Outcome::Finished(_)) => {
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
            Some(Outcome::Rejected(e)) => {
                rejected += 1;
                format!("{head} rejected, HTTP {}: {e}", e.http_status())
            }
            Some(Outcome::Cancelled) => {
                cancelled += 1;
                format!(
                    "{head} cancelled by the client mid-transfer: fenced and released, {} tokens; \
                     {} late KV writes and {} late receipt landed nowhere",
                    s.tokens.len(),
                    late.writes,
                    late.receipts
                )
            }
            Some(Outcome::Failed(e)) => {
                failed += 1;
                format!(
                    "{head} failed, HTTP {}, {} tokens generated: {e}",
                    e.http_status(),
                    s.tokens.len()
                )
            }
            None => {
                // Lost: the worker went idle (or the deadline passed)
                // without ever ending it. Counted as failed.
                failed += 1;
                lost += 1;
                format!(
                    "{head} LOST: no outcome after {} tokens, counted as failed",
                    s.tokens.len()
                )
            }
        };
        let _ = writeln!(out, "{line}");
    }
    // A prefill worker that could not be audited (its process died, its
    // link ended early) fails the run; the line still reports decode's side.
    let audited = match &prefill_audit {
        Ok(_) => true,
        Err(e) => {
            eprintln!("the prefill worker's pool could not be audited: {e}");
            false
        }
    };
    let prefill_audit = prefill_audit.unwrap_or_default();
    let leaked = decode_audit.leaked() + prefill_audit.leaked();
    let held = decode_audit.drained_held + prefill_audit.drained_held;
    let violations = decode_audit.violations + prefill_audit.violations;
    let _ = writeln!(
        out,
        "audit: requests={} ok={ok} rejected={rejected} cancelled={cancelled} failed={failed} \
         leaked_pages={leaked} held_pages={held} isolation_violations={violations}",
        reqs.len(),
    );
    if prefill_audit.ack_timeouts > 0 {
        eprintln!(
            "prefill released {} transfers only at the ack timeout: decode's answers did not",
            prefill_audit.ack_timeouts
        );
    }
    let counted = ok + rejected + cancelled + failed == reqs.len();
    Ok(audited
        && counted
        && leaked == 0
        && held == 0
        && violations == 0
        && prefill_audit.ack_timeouts == 0
        && mismatched == 0
        && lost == 0)
}

/// How long the prefill process may take to connect, and to report its
/// pool's figures once told the workload has drained.
const PREFILL_DEADLINE: Duration = Duration::from_secs(60);

/// The prefill process: killed (if still running) and reaped when dropped,
/// so no error path leaves it behind.
struct PrefillProcess(Child);

impl Drop for PrefillProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
        }
        let _ = self.0.wait();
    }
}

/// Tells the prefill process the workload has drained and reads its pool's
/// figures, then runs `close` (which ends the link, so the process shuts
/// down) and reads them again. `close` runs whatever happened before it.
/// Every wait is bounded by [`PREFILL_DEADLINE`]: a wedged process fails
/// the audit instead of hanging the run.
fn audit_prefill_process(child: &mut Child, close: impl FnOnce()) -> Result<PoolAudit, String> {
    let (stdin, out) = (child.stdin.take(), child.stdout.take());
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    if let Some(out) = out {
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
    }
    let until = Instant::now() + PREFILL_DEADLINE;
    let next = |prefix: &str| -> Result<Vec<u64>, String> {
        loop {
            let left = until.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    if let Some(f) = figures(&line, prefix) {
                        return Ok(f);
                    }
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    return Err(format!(
                        "the prefill process printed no \"{prefix}\" line within {PREFILL_DEADLINE:?}"
                    ));
                }
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(format!(
                        "the prefill process ended without a \"{prefix}\" line"
                    ));
                }
            }
        }
    };
    let drained = (|| -> Result<Vec<u64>, String> {
        let mut stdin = stdin.ok_or("no prefill stdin")?;
        writeln!(stdin, "drained").map_err(|e| format!("telling prefill: {e}"))?;
        drop(stdin);
        next("prefill-pool drained ")
    })();
    close();
    let p_drained = drained?;
    let p_after = next("prefill-pool shutdown ")?;
    let status = loop {
        if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
            break status;
        }
        if Instant::now() > until {
            return Err(format!(
                "the prefill process did not exit within {PREFILL_DEADLINE:?}"
            ));
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    if !status.success() {
        return Err(format!("the prefill process failed: {status}"));
    }
    match (&p_drained[..], &p_after[..]) {
        (&[in_use, held, ack_timeouts], &[not_free, violations]) => Ok(PoolAudit {
            drained_in_use: in_use as usize,
            drained_held: held as usize,
            not_free_after_shutdown: not_free as usize,
            violations,
            ack_timeouts,
        }),
        _ => Err("the prefill process's figures are malformed".into()),
    }
}

/// The numbers of a `PREFIX key=value ...` line of the prefill process.
fn figures(line: &str, prefix: &str) -> Option<Vec<u64>> {
    let rest = line.strip_prefix(prefix)?;
    rest.split(' ')
        .map(|kv| kv.split_once('=').and_then(|(_, v)| v.parse().ok()))
        .collect()
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
        let done = match args.backend {
            BackendKind::Cpu => prefill_process(addr, &args, &OnCpu),
            BackendKind::Cuda => gpu::on_gpu().and_then(|on| prefill_process(addr, &args, &on)),
        };
        return match done {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("prefill process: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let ran = match args.backend {
        BackendKind::Cpu => run(&args, &OnCpu),
        BackendKind::Cuda => gpu::on_gpu().and_then(|on| run(&args, &on)),
    };
    match ran {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `--transport nixl`: both processes on this host, UCX on the loopback
/// device (shared memory between the processes where UCX offers it).
#[cfg(feature = "nixl")]
mod nixl {
    use handoff::transfer::{
        LinkError, Nixl, NixlConfig, PeerId, TcpDecode, TcpDecodeListener, TcpPrefill,
        TransferConfig,
    };
    use std::net::SocketAddr;
    use std::time::Duration;

    fn config() -> NixlConfig {
        NixlConfig {
            ucx_devices: Some("lo".into()),
        }
    }

    pub fn bind() -> Result<TcpDecodeListener, String> {
        handoff::transfer::nixl::available().map_err(|e| e.to_string())?;
        handoff::transfer::nixl::bind_loopback().map_err(|e| e.to_string())
    }

    pub fn accept_within(
        l: &TcpDecodeListener,
        cfg: &TransferConfig,
        limit: Duration,
    ) -> Result<TcpDecode, LinkError> {
        Nixl::accept_within(l, cfg, &config(), limit)
    }

    pub fn connect(
        addr: SocketAddr,
        decode: Option<&PeerId>,
        cfg: &TransferConfig,
    ) -> Result<TcpPrefill, String> {
        Nixl::connect(addr, decode, cfg, &config()).map_err(|e| e.to_string())
    }
}

/// `--transport nixl` in a build without the `nixl` feature: refused.
#[cfg(not(feature = "nixl"))]
mod nixl {
    use handoff::transfer::{LinkError, TcpDecode, TcpDecodeListener, TcpPrefill, TransferConfig};
    use std::net::SocketAddr;
    use std::time::Duration;

    const WHY: &str = "--transport nixl needs a build with the nixl feature: \
                       cargo run --release --features nixl --example disaggregated";

    pub fn bind() -> Result<TcpDecodeListener, String> {
        Err(WHY.into())
    }

    pub fn accept_within(
        _: &TcpDecodeListener,
        _: &TransferConfig,
        _: Duration,
    ) -> Result<TcpDecode, LinkError> {
        Err(LinkError::Config { what: WHY })
    }

    pub fn connect(
        _: SocketAddr,
        _: Option<&handoff::transfer::PeerId>,
        _: &TransferConfig,
    ) -> Result<TcpPrefill, String> {
        Err(WHY.into())
    }
}

/// `--backend cuda`: every model on GPU 0, KV pages in its memory (each
/// placed model gets its own backend there, so an in-process transfer
/// copies device to device); in a build without the `cuda` feature,
/// refused with the flag it needs (`support/on_gpu.rs`).
mod gpu {
    use super::{Model, ModelWeights, Place, on_gpu};

    pub struct OnGpu(on_gpu::Gpu);

    pub fn on_gpu() -> Result<OnGpu, String> {
        on_gpu::open("disaggregated").map(OnGpu)
    }

    impl Place for OnGpu {
        type B = on_gpu::GpuBackend;
        fn place(&self, w: ModelWeights) -> Result<Model<Self::B>, String> {
            Model::new(on_gpu::backend(&self.0), w).map_err(|e| e.to_string())
        }
        fn describe(&self) -> String {
            format!("cuda ({})", on_gpu::describe(&self.0))
        }
    }
}
