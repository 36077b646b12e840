//! The engine behind the HTTP server: colocated (one [`Engine`] behind a
//! [`Service`]) or disaggregated (a decode worker behind a [`Service`] and
//! a prefill worker on its own thread, joined in-process or, with
//! `--transport tcp`, over an authenticated loopback TCP link, each worker
//! with a fresh key of its own). The routes see only a [`Submitter`] either way.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use handoff::backend::{Backend, CpuBackend};
use handoff::model::{Model, ModelConfig, random_weights};
use handoff::service::{Service, Submitter};
use handoff::transfer::{InProcess, LinkError, TcpAuth, Transfer, TransferConfig, TransferError};
use handoff::{
    Colocated, Decode, DecodeWorker, Engine, EngineConfig, EngineConfigBuilder, KvPool, PoolStats,
    Prefill, PrefillWorker, RequestId, RoleKind,
};

use crate::args::{Args, LinkKind};
use crate::staged_link::{StagedLink, Staging};

/// Seed of the embedded random-weights model (as in the other examples).
pub const RANDOM_SEED: u64 = 2026;

enum Kind {
    Colocated(Box<dyn Colo>),
    Disaggregated(Box<dyn Pair>),
}

/// One engine behind a [`Service`], on whichever backend.
trait Colo: Send {
    fn submitter(&self) -> Submitter;
    fn shutdown(self: Box<Self>, grace: Duration) -> Result<Stopped, String>;
}

impl<B: Backend + Send + 'static> Colo for Service<Engine<B>> {
    fn submitter(&self) -> Submitter {
        Service::submitter(self)
    }

    fn shutdown(self: Box<Self>, grace: Duration) -> Result<Stopped, String> {
        let engine = Service::shutdown(*self, grace).map_err(|e| e.to_string())?;
        Ok(Stopped {
            pools: vec![("colocated", engine.pool_stats())],
        })
    }
}

/// A decode worker behind a [`Service`] and a prefill worker on its own
/// thread, over one transport; stopped as one.
trait Pair: Send {
    fn submitter(&self) -> Submitter;
    fn shutdown(self: Box<Self>, grace: Duration) -> Result<Stopped, String>;
}

struct PairOver<T: Transfer, B: Backend> {
    decode: Service<DecodeWorker<T::Decode, B>>,
    prefill: JoinHandle<PrefillWorker<StagedLink<T::Prefill>, B>>,
    stop: Arc<AtomicBool>,
}

impl<T: Transfer, B: Backend + Send + 'static> Pair for PairOver<T, B>
where
    T::Decode: Send,
    T::Prefill: Send,
{
    fn submitter(&self) -> Submitter {
        self.decode.submitter()
    }

    fn shutdown(self: Box<Self>, grace: Duration) -> Result<Stopped, String> {
        let PairOver {
            decode,
            prefill,
            stop,
        } = *self;
        let worker = decode.shutdown(grace);
        stop.store(true, Ordering::Release);
        let prefill = prefill
            .join()
            .map_err(|_| "the prefill worker's thread panicked".to_string())?;
        let worker = worker.map_err(|e| e.to_string())?;
        Ok(Stopped {
            pools: vec![
                ("decode", worker.pool().stats()),
                ("prefill", prefill.pool().stats()),
            ],
        })
    }
}

/// A running engine (or pair of workers).
pub struct Stack {
    kind: Kind,
    pools: Vec<(&'static str, KvPool)>,
    pub window: usize,
    pub vocab: usize,
    pub kv_bytes_per_token: u64,
}

/// Each pool's accounting once everything has stopped.
pub struct Stopped {
    pub pools: Vec<(&'static str, PoolStats)>,
}

impl Stopped {
    /// Every page free and no isolation violation, in every pool.
    pub fn clean(&self) -> bool {
        self.pools
            .iter()
            .all(|(_, s)| s.is_full() && s.isolation_violations == 0)
    }
}

fn model<B: Backend>(backend: B, path: Option<&Path>) -> Result<Model<B>, String> {
    match path {
        None => Model::new(
            backend,
            random_weights(&ModelConfig::tiny_gqa(), RANDOM_SEED),
        )
        .map_err(|e| e.to_string()),
        Some(p) => Model::load(backend, p).map_err(|e| format!("{}: {e}", p.display())),
    }
}

fn config<R: RoleKind, B: Backend>(args: &Args, m: &Model<B>) -> Result<EngineConfig<R>, String> {
    let window = args.max_context.unwrap_or(m.config().max_seq_len.min(2048));
    let pool = args.pool_tokens.unwrap_or(window.saturating_mul(8));
    let mut b = EngineConfigBuilder::<R>::new(m.kv_geometry(args.kv_dtype))
        .max_context(window)
        .page_size(16.min(window.max(1).next_power_of_two()))
        .pool_tokens(pool)
        .audit(args.audit());
    if let Some(q) = args.max_queue {
        b = b.max_queue(q);
    }
    b.build()
        .map_err(|e| format!("{:?} configuration refused: {e}", R::ROLE))
}

impl Stack {
    pub fn start(args: &Args) -> Result<Stack, String> {
        if args.cuda() {
            let gpu = crate::gpu::open()?;
            tracing::info!(on = %crate::gpu::describe(&gpu), "the models run on the GPU");
            return Stack::start_on(args, &|| crate::gpu::backend(&gpu));
        }
        let threads = args.threads;
        Stack::start_on(args, &move || match threads {
            Some(n) => CpuBackend::with_threads(n),
            None => CpuBackend::new(),
        })
    }

    /// [`Stack::start`] with every model on a backend `backend` makes.
    fn start_on<B: Backend + Send + 'static>(
        args: &Args,
        backend: &dyn Fn() -> B,
    ) -> Result<Stack, String> {
        let m = model(backend(), args.model())?;
        let vocab = m.config().vocab_size;
        if !args.disaggregated {
            let cfg = config::<Colocated, B>(args, &m)?;
            let per_token = (cfg.bytes_per_page() / cfg.page_size()) as u64;
            let engine = Engine::new(m, cfg).map_err(|e| e.to_string())?;
            let pools = vec![("colocated", engine.pool().clone())];
            let service = Service::spawn(engine).map_err(|e| e.to_string())?;
            return Ok(Stack {
                kind: Kind::Colocated(Box::new(service)),
                pools,
                window: cfg.max_context(),
                vocab,
                kv_bytes_per_token: per_token,
            });
        }
        let pm = model(backend(), args.model())?;
        let dcfg = config::<Decode, B>(args, &m)?;
        let pcfg = config::<Prefill, B>(args, &pm)?;
        let per_token = (dcfg.bytes_per_page() / dcfg.page_size()) as u64;
        let window = dcfg.max_context();
        let (pair, pools) = match args.transport {
            LinkKind::InProcess => start_pair(&InProcess, args, pm, pcfg, m, dcfg)?,
            // Fresh worker keys, each trusting only the other, so only this
            // process's two workers can join.
            LinkKind::Tcp => start_pair(&TcpAuth, args, pm, pcfg, m, dcfg)?,
        };
        Ok(Stack {
            kind: Kind::Disaggregated(pair),
            pools,
            window,
            vocab,
            kv_bytes_per_token: per_token,
        })
    }

    pub fn submitter(&self) -> Submitter {
        match &self.kind {
            Kind::Colocated(s) => s.submitter(),
            Kind::Disaggregated(pair) => pair.submitter(),
        }
    }

    pub fn pools(&self) -> Vec<(&'static str, KvPool)> {
        self.pools.clone()
    }

    pub fn disaggregated(&self) -> bool {
        matches!(self.kind, Kind::Disaggregated(_))
    }

    /// Stops taking requests, lets live ones run for `grace`, ends the rest
    /// with 503, stops every worker and reports the pools. Blocks.
    pub fn shutdown(self, grace: Duration) -> Result<Stopped, String> {
        match self.kind {
            Kind::Colocated(service) => service.shutdown(grace),
            Kind::Disaggregated(pair) => pair.shutdown(grace),
        }
    }
}

type Pools = Vec<(&'static str, KvPool)>;

/// Starts a prefill worker on its own thread and a decode worker behind a
/// service, joined by `t`.
fn start_pair<T: Transfer + 'static, B: Backend + Send + 'static>(
    t: &T,
    args: &Args,
    pm: Model<B>,
    pcfg: EngineConfig<Prefill>,
    m: Model<B>,
    dcfg: EngineConfig<Decode>,
) -> Result<(Box<dyn Pair>, Pools), String>
where
    T::Decode: Send,
    T::Prefill: Send,
{
    let transfer = TransferConfig::default();
    let (to_decode, to_prefill) = t.connect(&transfer).map_err(|e| e.to_string())?;
    // The test aid acts as a lying prefill peer through the public link
    // trait (examples/support/staged_link.rs): no test-only feature.
    let staging = Staging {
        corrupt_receipt_of: args.corrupt_receipt_of.map(RequestId),
        ..Staging::default()
    };
    let to_decode = StagedLink::new(to_decode, staging);
    let mut prefill =
        PrefillWorker::new(to_decode, pm, pcfg, transfer.clone()).map_err(|e| e.to_string())?;
    let decode = DecodeWorker::new(to_prefill, m, dcfg, transfer).map_err(|e| e.to_string())?;
    let pools = vec![
        ("decode", decode.pool().clone()),
        ("prefill", prefill.pool().clone()),
    ];
    let stop = Arc::new(AtomicBool::new(false));
    let prefill = {
        let stop = stop.clone();
        std::thread::Builder::new()
            .name("prefill-worker".into())
            .spawn(move || {
                match prefill.run(&stop) {
                    Ok(()) => {}
                    // The decode worker closes the link when it shuts down.
                    Err(TransferError::Link(LinkError::Disconnected)) => {
                        tracing::info!("the decode worker closed the link: prefill stops")
                    }
                    Err(e) => tracing::error!(error = %e, "the prefill worker's link failed"),
                }
                prefill.shutdown();
                prefill
            })
            .map_err(|e| e.to_string())?
    };
    let decode = Service::spawn(decode).map_err(|e| e.to_string())?;
    let pair = PairOver::<T, B> {
        decode,
        prefill,
        stop,
    };
    Ok((Box::new(pair), pools))
}
