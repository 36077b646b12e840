//! Shared rig for the fault stories: a prefill worker (on its own thread)
//! and a decode worker (driven by the test) running a tiny random model over
//! a transport, with the colocated engine as the reference for outputs.

use handoff::{Decode, DecodeWorker, EngineConfigBuilder, Prefill, PrefillWorker, RoleKind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::TryRecvError;
use handoff::model::{Model, ModelConfig, ModelWeights, RopeStyle, random_weights};
use handoff::transfer::{Transfer, TransferConfig, TransferError};
use handoff::{
    Engine, EngineConfig, Event, HttpStatus, KvDtype, KvPool, Outcome, PoolStats, Request,
    RequestHandle, Role,
};

/// Context window of every worker here.
pub const WINDOW: usize = 64;
/// Token slots per page.
pub const PAGE: usize = 8;

/// A model small enough that a forward pass costs microseconds.
pub fn tiny_model() -> ModelConfig {
    ModelConfig {
        dim: 32,
        hidden_dim: 64,
        n_layers: 2,
        n_heads: 2,
        n_kv_heads: 1,
        head_dim: 16,
        vocab_size: 97,
        max_seq_len: 128,
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

pub fn weights() -> ModelWeights {
    random_weights(&tiny_model(), 2026)
}

/// A validated configuration for `role` (prefilling roles get twice the
/// window, decode a window per two requests plus one).
pub fn engine_config<R: RoleKind>(w: &ModelWeights) -> EngineConfig<R> {
    let pool = match R::ROLE {
        Role::Decode => 3 * WINDOW,
        _ => 2 * WINDOW,
    };
    EngineConfigBuilder::<R>::new(w.config.kv_geometry(KvDtype::F32))
        .max_context(WINDOW)
        .page_size(PAGE)
        .pool_tokens(pool)
        .build()
        .unwrap()
}

/// What the colocated engine generates for each request (greedy).
pub fn reference(w: &ModelWeights, reqs: &[Request]) -> Vec<Vec<u32>> {
    reference_in_window(w, reqs, WINDOW)
}

/// [`reference`] with another context window.
pub fn reference_in_window(w: &ModelWeights, reqs: &[Request], window: usize) -> Vec<Vec<u32>> {
    let cfg = EngineConfig::colocated(w.config.kv_geometry(KvDtype::F32))
        .max_context(window)
        .page_size(PAGE)
        .pool_tokens(2 * window * reqs.len().max(1))
        .build()
        .unwrap();
    let mut engine = Engine::new(Model::cpu(w.clone()).unwrap(), cfg).unwrap();
    super::finished_tokens(&mut engine, reqs.iter().cloned())
}

/// One request as its client sees it.
pub struct Tracked {
    pub req: Request,
    pub tokens: Vec<u32>,
    /// Each token's log-probabilities, for a request that asked.
    pub logprobs: Vec<handoff::sampling::TokenLogprobs>,
    pub outcome: Option<Outcome>,
    handle: Option<RequestHandle>,
}

impl Tracked {
    /// A request as submitted: its handle, or its admission rejection.
    pub fn new(req: Request, submitted: Result<RequestHandle, handoff::Rejection>) -> Self {
        let (handle, outcome) = match submitted {
            Ok(h) => (Some(h), None),
            Err(r) => (None, Some(Outcome::Rejected(r))),
        };
        Tracked {
            req,
            tokens: Vec::new(),
            logprobs: Vec::new(),
            outcome,
            handle,
        }
    }
    pub fn done(&self) -> bool {
        self.outcome.is_some()
    }
    /// Reads what has arrived on the request's stream.
    pub fn drain(&mut self) {
        let Some(h) = &self.handle else { return };
        loop {
            match h.events().try_recv() {
                Ok(Event::Token(t)) => self.tokens.push(t),
                Ok(Event::Logprobs(lp)) => self.logprobs.push(lp),
                Ok(Event::Done(o)) => {
                    self.outcome = Some(o);
                    self.handle = None;
                    return;
                }
                Err(TryRecvError::Empty) => return,
                Err(TryRecvError::Disconnected) => {
                    self.outcome = Some(Outcome::Failed(handoff::EngineError::Shutdown));
                    self.handle = None;
                    return;
                }
            }
        }
    }
    /// The client cancels.
    pub fn cancel(&self) {
        if let Some(h) = &self.handle {
            h.cancel();
        }
    }

    /// Checks the client-visible result against the fault-free output:
    /// finished with exactly `want`, or ended with a typed error after a
    /// prefix of `want` (never a wrong token). Returns a short code for
    /// reports ("ok", "cancelled", or the HTTP status).
    pub fn judge(&self, want: &[u32]) -> Result<String, String> {
        let id = self.req.id;
        let Some(outcome) = &self.outcome else {
            return Err(format!("{id} never ended"));
        };
        if !want.starts_with(&self.tokens) {
            return Err(format!(
                "{id}: WRONG OUTPUT {:?}, the fault-free run gives {want:?} ({outcome:?})",
                self.tokens
            ));
        }
        match outcome {
            Outcome::Finished(_) if self.tokens == want => Ok("ok".into()),
            Outcome::Finished(r) => Err(format!(
                "{id}: finished ({r:?}) after {} of {} tokens",
                self.tokens.len(),
                want.len()
            )),
            Outcome::Cancelled => Ok("cancelled".into()),
            Outcome::Rejected(r) => status(r.http_status(), id, r),
            Outcome::Failed(e) => status(e.http_status(), id, e),
        }
    }
}

fn status(code: u16, id: handoff::RequestId, e: &dyn std::fmt::Display) -> Result<String, String> {
    if (400..600).contains(&code) {
        Ok(code.to_string())
    } else {
        Err(format!("{id}: untyped status {code}: {e}"))
    }
}

type PrefillEnd = Result<(), TransferError>;

/// A prefill worker on its own thread and a decode worker, over one link.
pub struct Pair<T: Transfer> {
    pub decode: DecodeWorker<T::Decode>,
    pub prefill_pool: KvPool,
    pub decode_pool: KvPool,
    stop: Arc<AtomicBool>,
    prefill: Option<JoinHandle<PrefillEnd>>,
}

impl<T: Transfer> Pair<T> {
    pub fn start(t: &T, cfg: TransferConfig, w: &ModelWeights) -> Self {
        Self::start_with(t, cfg, w, w)
    }

    /// [`Pair::start`] with prefill serving `prefill_w` and decode `decode_w`.
    pub fn start_with(
        t: &T,
        cfg: TransferConfig,
        prefill_w: &ModelWeights,
        decode_w: &ModelWeights,
    ) -> Self {
        let (pl, dl) = t.connect(&cfg).unwrap();
        let pcfg = engine_config::<Prefill>(prefill_w);
        let model = Model::cpu(prefill_w.clone()).unwrap();
        let mut prefill = PrefillWorker::new(pl, model, pcfg, cfg.clone()).unwrap();
        let prefill_pool = prefill.pool().clone();
        let dcfg = engine_config::<Decode>(decode_w);
        let decode = DecodeWorker::new(dl, Model::cpu(decode_w.clone()).unwrap(), dcfg, cfg)
            .unwrap()
            .with_idle_wait(Duration::from_millis(5));
        let decode_pool = decode.pool().clone();
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("prefill-worker".into())
                .spawn(move || {
                    // Runs until stopped or its link ends (a dead worker is
                    // dropped at once, as its process would be).
                    let end = prefill.run(&stop);
                    prefill.shutdown();
                    end
                })
                .unwrap()
        };
        Pair {
            decode,
            prefill_pool,
            decode_pool,
            stop,
            prefill: Some(thread),
        }
    }

    pub fn submit(&mut self, req: Request) -> Tracked {
        let submitted = self.decode.submit(req.clone());
        Tracked::new(req, submitted)
    }

    /// Steps decode until `done()` or the deadline; false on the deadline.
    pub fn run_until(&mut self, reqs: &mut [Tracked], deadline: Instant) -> bool {
        loop {
            for r in reqs.iter_mut() {
                r.drain();
            }
            if reqs.iter().all(Tracked::done) {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            self.decode.step();
        }
    }

    fn stats(&self) -> (PoolStats, PoolStats) {
        (self.prefill_pool.stats(), self.decode_pool.stats())
    }

    /// Waits, both workers still running, until both pools are full again
    /// (deferred releases happen on answers and timeouts); fails with the
    /// stats if they are not within `within`. Also fails on any isolation
    /// violation or unbalanced accounting.
    pub fn pools_return_to_full(&mut self, within: Duration) -> Result<(), String> {
        let until = Instant::now() + within;
        loop {
            let (p, d) = self.stats();
            for (side, s) in [("prefill", p), ("decode", d)] {
                if s.isolation_violations != 0 {
                    return Err(format!(
                        "{side}: {} isolation violations",
                        s.isolation_violations
                    ));
                }
                if !s.balanced() {
                    return Err(format!("{side} pool unbalanced: {s:?}"));
                }
            }
            if p.is_full() && d.is_full() {
                return Ok(());
            }
            if Instant::now() > until {
                return Err(format!(
                    "pools not full {within:?} after the last request ended: prefill {p:?}, decode {d:?}"
                ));
            }
            self.decode.step();
        }
    }

    /// True once the prefill worker's thread has ended (killed, or its link
    /// ended).
    pub fn prefill_ended(&self) -> bool {
        self.prefill.as_ref().is_none_or(|h| h.is_finished())
    }

    /// Stops both workers; fails if the prefill thread panicked or does not
    /// stop, or if a pool is not full afterwards.
    pub fn stop(mut self) -> Result<(), String> {
        self.stop.store(true, Ordering::Release);
        let until = Instant::now() + Duration::from_secs(10);
        if let Some(h) = self.prefill.take() {
            while !h.is_finished() {
                if Instant::now() > until {
                    return Err("the prefill worker did not stop".into());
                }
                self.decode.step();
            }
            if h.join().is_err() {
                return Err("the prefill worker panicked".into());
            }
        }
        self.decode.shutdown();
        let (p, d) = self.stats();
        if !(p.is_full() && d.is_full()) {
            return Err(format!("after shutdown: prefill {p:?}, decode {d:?}"));
        }
        Ok(())
    }
}

/// Runs `f` on its own thread and fails if it does not finish within
/// `limit` (the cell hung) or if it panicked.
pub fn watchdog<R: Send + 'static>(
    name: &str,
    limit: Duration,
    f: impl FnOnce() -> R + Send + 'static,
) -> Result<R, String> {
    let (tx, rx) = crossbeam_channel::bounded(1);
    let handle = std::thread::Builder::new()
        .name(name.chars().take(60).collect())
        .spawn(move || {
            let r = f();
            let _ = tx.send(());
            r
        })
        .map_err(|e| e.to_string())?;
    match rx.recv_timeout(limit) {
        Ok(()) | Err(crossbeam_channel::RecvTimeoutError::Disconnected) => handle
            .join()
            .map_err(|p| format!("{name}: panicked: {}", panic_text(&p))),
        Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
            Err(format!("{name}: HUNG (still running after {limit:?})"))
        }
    }
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "(non-string panic)".into())
}
