//! `handoff-server`: an OpenAI-compatible HTTP server that embeds the engine.
//!
//! ```sh
//! cargo install --path crates/handoff-server                 # or: cargo run --release -p handoff-server --
//! handoff-server                                             # embedded random-weights model
//! handoff-server --model PATH --port 8000 --api-keys keys.txt
//! handoff-server --disaggregated                             # prefill + decode workers
//! curl -s localhost:8000/v1/completions -H 'content-type: application/json' \
//!     -d '{"model": "handoff-random", "prompt": "Hello", "max_tokens": 8}'
//! ```
//!
//! `handoff-server --help` lists every argument.
//!
//! Routes: `GET /v1/models`, `POST /v1/completions`,
//! `POST /v1/chat/completions` (`stream: true` gives server-sent events in
//! OpenAI's chunk format ending with `data: [DONE]`), `GET /metrics`
//! (Prometheus text; `--metrics-key KEY` puts it behind
//! `Authorization: Bearer KEY`), `GET /health` (200 while the process is
//! up) and `GET /ready` (503 while the model loads or the server drains,
//! 200 while it serves). Request fields: `max_tokens`
//! (`max_completion_tokens`), `temperature` (default 1, 0 is greedy),
//! `top_p`, `seed`, `stop` (up to 4 strings), `n` (1 only),
//! `stream_options.include_usage`, log-probabilities (chat: `logprobs:
//! true` with `top_logprobs` 0-20; completions: `logprobs` 0-20; the
//! model's distribution at temperature 1, in OpenAI's shapes, per token and
//! per chunk; see `logprobs.rs`), and the extension `return_token_ids`
//! (each choice, and each chunk, carries the generated ids). Answers carry
//! `usage` and `finish_reason` (`stop` or `length`).
//!
//! Errors are OpenAI-style JSON bodies (`{"error": {"message", "type",
//! "param", "code"}}`) with the status the crate maps the cause to:
//!
//! | cause | status | code |
//! |---|---|---|
//! | prompt alone longer than the context window | 413 (the crate's `PromptTooLong`) | `context_length_exceeded` |
//! | prompt + `max_tokens` over the window | 400 (the crate's `ExceedsWindow`) | `context_length_exceeded` |
//! | bad JSON, bad or unsupported parameter | 400 | `invalid_value` / `unsupported_parameter` |
//! | missing or unknown API key | 401 | `invalid_api_key` |
//! | unknown model name | 404 | `model_not_found` |
//! | queue full | 429 with `Retry-After: 1` | `rate_limit_exceeded` |
//! | shutting down | 503 | `service_unavailable` |
//! | KV transfer integrity failure (disaggregated) | 500 | `kv_integrity_failure` |
//!
//! The over-window prompt keeps the crate's status rather than OpenAI's
//! blanket 400: both statuses are errors to every client, and the code
//! `context_length_exceeded` is what clients match on. A request that fails
//! never gets a 200: a streaming answer waits for the first token before
//! sending its status, and a failure after that ends the stream with an
//! error event and no `[DONE]`.
//!
//! Tenants: `--api-keys FILE` (`KEY TENANT_ID` per line) maps
//! `Authorization: Bearer KEY` to a `TenantId` on the server; without it
//! the server is open, binds loopback only, says so at startup, and every
//! request is tenant 0. `/metrics`, `/health` and `/ready` need no tenant
//! key (a scraper's view: counts and pool pages, no tenant's data;
//! `--metrics-key` guards `/metrics` with a key of its own). A client that disconnects has its request
//! cancelled (pages released once no write can land; a transfer in flight
//! is fenced by the decode worker, not aborted mid-write), counted in
//! `/metrics`. SIGTERM or Ctrl-C: the listener closes, new requests get
//! 503, live ones run for `--grace-secs` (10), the rest end with 503; the
//! process exits 0 only if every pool is full again with no isolation
//! violation.
//!
//! Text: the embedded random-weights model has no tokenizer, so it is
//! served with a byte-level codec (its output is noise; see `codec.rs`); a
//! model file (`--model`) is served with its own tokenizer and chat
//! template (`handoff::text`), or ids-only when it ships none. The chat
//! template is code from the model file: it renders under a fuel budget,
//! an output cap and a deadline (`--template-*`); one that exceeds them on
//! the probe conversations at load is refused (exit 2), one that exceeds
//! them on a request fails that request alone (500). Message content is
//! encoded as text: special-token text a user writes never becomes a
//! control token (`--allow-special-tokens-in-messages` lifts that).
//! Connections: hyper's header-read timeout, tower-http's request-body
//! idle timeout and a connection cap (`listen.rs`). Logs (`tracing`, one span per request with phases `admission`,
//! `prefill` or `prefill_transfer`, and `decode`) go to stderr; `RUST_LOG`
//! filters them. Each API request also gets one line under the target
//! `access` when it is answered (tenant, endpoint, outcome, status, prompt
//! and completion tokens, duration; never text: `access.rs`). The port is
//! bound before the model loads (`bound: loading the model` on stderr,
//! `/ready` 503 meanwhile); stdout gets one line, `listening on
//! http://ADDR`, once the model is loaded and served, and the pool report at
//! exit. At start the descriptors' soft limit is raised to the hard one
//! (`nofile.rs`), so thousands of streams are not refused for sockets.

mod access;
mod args;
mod auth;
mod codec;
mod errors;
mod gate;
mod generation;
mod gpu;
mod listen;
mod logprobs;
mod metrics;
#[cfg(unix)]
mod nofile;
mod reply;
mod routes;
mod sse;
mod stack;
// The lying-peer test aid the library's examples share (no crate feature).
#[path = "../../../examples/support/staged_link.rs"]
mod staged_link;
mod wire;

use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Parser;
use handoff::TenantId;
use handoff::text::ContentTokens;
use tokio::sync::watch;
use tracing::{info, warn};

use crate::auth::Auth;
use crate::codec::{ByteCodec, IdsOnly, ModelCodec, TextCodec, Untextual};
use crate::routes::AppState;
use crate::stack::Stack;

/// A line on stdout (tests read it); a closed pipe is not worth a panic.
fn say(s: &str) {
    let mut out = std::io::stdout();
    let _ = writeln!(out, "{s}");
    let _ = out.flush();
}

fn main() -> ExitCode {
    // A bad or missing value: clap's message and exit 2; --help: exit 0.
    let args = args::Args::parse();
    if let Err(e) = args.check() {
        let _ = writeln!(std::io::stderr(), "error: {e}");
        return ExitCode::from(2);
    }
    // Each span's close is logged with its busy and idle time: the
    // request's phases, timed.
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "error: no async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match rt.block_on(run(args)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "error: {e}");
            ExitCode::from(2)
        }
    }
}

/// SIGTERM and Ctrl-C, registered when made: a signal that comes after
/// the `listening` line is never the default (kill) action.
#[cfg(unix)]
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

#[cfg(unix)]
impl Signals {
    fn register() -> Result<Signals, String> {
        use tokio::signal::unix::{SignalKind, signal};
        let err = |e: std::io::Error| format!("cannot handle signals: {e}");
        Ok(Signals {
            term: signal(SignalKind::terminate()).map_err(err)?,
            int: signal(SignalKind::interrupt()).map_err(err)?,
        })
    }

    async fn recv(mut self) {
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
    }
}

#[cfg(not(unix))]
struct Signals;

#[cfg(not(unix))]
impl Signals {
    fn register() -> Result<Signals, String> {
        Ok(Signals)
    }
    async fn recv(self) {
        let _ = tokio::signal::ctrl_c().await;
    }
}

async fn run(args: args::Args) -> Result<bool, String> {
    let auth = match &args.api_keys {
        Some(path) => Auth::from_file(path)?,
        None => Auth::Open(TenantId(0)),
    };
    #[cfg(unix)]
    match nofile::raise() {
        Ok(n) => info!(limit = n, "descriptors: soft limit raised to the hard one"),
        Err(e) => warn!(error = %e, "descriptors: the soft limit could not be raised"),
    }
    // Signals first: one that comes while loading is not the default (kill)
    // action, and shuts the server down once it has loaded.
    let signals = Signals::register()?;
    let (stop_tx, mut stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        signals.recv().await;
        let _ = stop_tx.send(true);
    });
    // The port is bound and served before the model loads: `/health`
    // answers 200 and `/ready` 503 until it has (see gate.rs).
    let addr = SocketAddr::new(args.host, args.port);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let bound = listener.local_addr().map_err(|e| e.to_string())?;
    let gate = gate::Gate::default();
    let mut graceful = stop_rx.clone();
    let limits = listen::ConnLimits {
        header_timeout: args.header_timeout,
        body_idle_timeout: args.body_idle_timeout,
        max_connections: args.max_connections,
    };
    let server = tokio::spawn(listen::serve(listener, gate.router(), limits, async move {
        let _ = graceful.wait_for(|s| *s).await;
    }));
    info!(addr = %bound, "bound: loading the model (/ready answers 503 until it has)");
    if let Some(ms) = args.load_delay_ms {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }

    let stack = Stack::start(&args)?;
    let content = if args.allow_special_tokens_in_messages {
        ContentTokens::Special
    } else {
        ContentTokens::Text
    };
    let codec: Arc<dyn TextCodec> = match (args.model(), ByteCodec::new(stack.vocab)) {
        (None, Some(bytes)) => Arc::new(bytes),
        // A model file with a tokenizer (GGUF metadata, or tokenizer.json in a
        // Hugging Face folder) serves text; one without serves token ids only.
        (Some(path), _) => match ModelCodec::load(path, args.template_limits(), content) {
            Ok(codec) => Arc::new(codec),
            Err(Untextual::IdsOnly(why)) => {
                tracing::warn!(%why, "no tokenizer in the model: serving token ids only");
                Arc::new(IdsOnly)
            }
            Err(Untextual::Refused(e)) => return Err(format!("{}: {e}", path.display())),
        },
        _ => Arc::new(IdsOnly),
    };
    let model_name = args
        .served_name
        .clone()
        .unwrap_or_else(|| match args.model() {
            None => "handoff-random".into(),
            Some(p) => p
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "model".into()),
        });
    let metrics = metrics::Metrics::install(
        stack.pools(),
        args.audit(),
        stack.kv_bytes_per_token,
        stack.submitter(),
    )?;
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let state = Arc::new(AppState {
        submitter: stack.submitter(),
        codec: codec.clone(),
        auth,
        metrics,
        model_name: model_name.clone(),
        window: stack.window,
        created: now.as_secs(),
        next_id: AtomicU64::new(1),
        seed_base: now.as_nanos() as u64,
        draining: AtomicBool::new(false),
        disaggregated: stack.disaggregated(),
        metrics_key: args.metrics_key.clone(),
    });
    gate.open(routes::router(state.clone()));
    info!(
        model = %model_name,
        window = stack.window,
        disaggregated = stack.disaggregated(),
        audit = args.audit(),
        text = %codec.describe(),
        "serving"
    );
    match &state.auth {
        Auth::Open(_) => warn!(
            "no --api-keys: the server is open to anyone who can reach {bound} (loopback only); \
             every request is tenant 0"
        ),
        Auth::Keys(k) => info!(
            keys = k.len(),
            "API keys loaded: requests need a Bearer key"
        ),
    }
    say(&format!("listening on http://{bound}"));

    // Until a signal: serve. Then drain.
    let _ = stop_rx.wait_for(|s| *s).await;
    state.draining.store(true, Ordering::Release);
    info!(
        grace_s = args.grace.as_secs_f64(),
        "shutting down: no new requests; live ones have the grace period"
    );
    let grace = args.grace;
    let stopped = tokio::task::spawn_blocking(move || stack.shutdown(grace))
        .await
        .map_err(|e| format!("the shutdown task failed: {e}"))??;
    // Every live request has its outcome now; the connections finish
    // writing them. A connection that does not close in time is dropped.
    match tokio::time::timeout(Duration::from_secs(10), server).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => warn!(error = %e, "the HTTP server task failed"),
        Err(_) => warn!("connections still open 10 s after shutdown: dropped"),
    }
    for (name, s) in &stopped.pools {
        say(&format!(
            "pool {name}: capacity={} free={} in_use={} held={} isolation_violations={} full={}",
            s.capacity,
            s.free,
            s.in_use,
            s.held,
            s.isolation_violations,
            s.is_full()
        ));
    }
    Ok(stopped.clean())
}
