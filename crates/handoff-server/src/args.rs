//! Command-line arguments (clap's derive): what `--help` prints is what
//! the server reads.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use handoff::text::TemplateLimits;

/// The link between the workers of `--disaggregated`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LinkKind {
    /// Channels in this process (the default).
    #[value(name = "inproc")]
    InProcess,
    /// Loopback TCP, authenticated with fresh worker keys (Noise IK,
    /// every frame sealed): the wire path of two machines.
    Tcp,
}

/// Where the models run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    Cpu,
    /// GPU 0, KV pages in its memory (a build with the `cuda` feature).
    Cuda,
}

/// An OpenAI-compatible HTTP server embedding the handoff engine.
#[derive(Clone, Debug, Parser)]
#[command(name = "handoff-server", version, about)]
pub struct Args {
    /// A model file (GGUF, llama2.c `.bin`) or Hugging Face folder;
    /// `random` (the default): the embedded random-weights model.
    #[arg(long, value_name = "PATH|random")]
    pub model: Option<PathBuf>,
    /// Address to listen on; without --api-keys only loopback is allowed.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Port; 0 picks a free one (printed on stdout).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// `KEY TENANT_ID` per line: `Authorization: Bearer KEY` maps to the tenant.
    #[arg(long, value_name = "FILE")]
    pub api_keys: Option<PathBuf>,
    /// A prefill worker and a decode worker, joined by --transport.
    #[arg(long)]
    pub disaggregated: bool,
    /// How the two workers of --disaggregated are joined.
    #[arg(long, value_enum, default_value = "inproc")]
    pub transport: LinkKind,
    /// The context window; default: the model's, capped at 2048.
    #[arg(long, value_name = "N")]
    pub max_context: Option<usize>,
    /// KV pool size in tokens; default: 8 windows.
    #[arg(long, value_name = "N")]
    pub pool_tokens: Option<usize>,
    /// Requests waiting for admission before 429.
    #[arg(long, value_name = "N")]
    pub max_queue: Option<usize>,
    /// At SIGTERM, how long live requests may still run.
    #[arg(long = "grace-secs", value_name = "S", default_value = "10", value_parser = seconds)]
    pub grace: Duration,
    /// The model name clients ask for; default: the file's stem.
    #[arg(long = "served-model-name", value_name = "NAME")]
    pub served_name: Option<String>,
    /// The CPU backend's threads.
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
    /// Where the models run.
    #[arg(long, value_enum, default_value = "cpu")]
    pub backend: BackendKind,
    /// The KV pages' element type: f32, f16, bf16 or fp8 (bf16 or f16 run
    /// the GPU's tensor-core attention). f16 by default, as llama.cpp and
    /// vLLM: half of f32's bytes per attended position, so long contexts
    /// decode faster on the CPU too (BENCHMARKS.md, long context).
    #[arg(long, default_value = "f16", value_parser = kv_dtype)]
    pub kv_dtype: handoff::KvDtype,
    /// Drop the audit trail (every KV read checked against its writer).
    #[arg(long)]
    pub no_audit: bool,
    /// Time a connection has to send a request's complete head, counted
    /// from when the server starts waiting for it (so an idle keep-alive
    /// connection is closed after it too).
    #[arg(long = "header-timeout-secs", value_name = "S", default_value = "10", value_parser = seconds)]
    pub header_timeout: Duration,
    /// Longest pause between two pieces of a request's body.
    #[arg(long = "body-idle-timeout-secs", value_name = "S", default_value = "30", value_parser = seconds)]
    pub body_idle_timeout: Duration,
    /// Open connections at most; further ones wait in the kernel's backlog
    /// until one closes. Keep it under the process's descriptor limit.
    #[arg(long, value_name = "N", default_value_t = 512)]
    pub max_connections: usize,
    /// The chat template's fuel per render (minijinja: about one per
    /// instruction and per 64 bytes of data); default: the library's.
    #[arg(long, value_name = "N")]
    pub template_fuel: Option<u64>,
    /// The chat template's rendered prompt at most (bytes).
    #[arg(long, value_name = "BYTES")]
    pub template_max_output: Option<usize>,
    /// The chat template's time per render (milliseconds).
    #[arg(long, value_name = "MS")]
    pub template_deadline_ms: Option<u64>,
    /// Let special-token text in chat messages (`<|im_end|>`) encode as
    /// control tokens. Off by default: message content is text, and only
    /// the template's own text produces control tokens.
    #[arg(long)]
    pub allow_special_tokens_in_messages: bool,
    /// `/metrics` answers only requests with `Authorization: Bearer KEY`
    /// (401 otherwise); without it `/metrics` is open.
    #[arg(long, value_name = "KEY")]
    pub metrics_key: Option<String>,
    /// Test aid: the model loads this much slower, so `/ready`'s 503 while
    /// loading can be observed.
    #[arg(long = "load-delay-ms", value_name = "MS", hide = true)]
    pub load_delay_ms: Option<u64>,
    /// Test aid: the prefill worker corrupts this request's receipt (the
    /// decode worker's verifier must fail it with a 500).
    #[arg(long = "corrupt-receipt-of-request", value_name = "ID", hide = true)]
    pub corrupt_receipt_of: Option<u64>,
}

fn seconds(v: &str) -> Result<Duration, String> {
    let s: f64 = v.parse().map_err(|e| format!("{v:?}: {e}"))?;
    Duration::try_from_secs_f64(s).map_err(|e| format!("{s}: {e}"))
}

fn kv_dtype(v: &str) -> Result<handoff::KvDtype, String> {
    handoff::KvDtype::parse(v).ok_or(format!("--kv-dtype {v:?}: f32, f16, bf16 or fp8"))
}

impl Args {
    /// The model file, `None` for the embedded random-weights model.
    pub fn model(&self) -> Option<&std::path::Path> {
        self.model.as_deref().filter(|m| m.as_os_str() != "random")
    }

    pub fn cuda(&self) -> bool {
        self.backend == BackendKind::Cuda
    }

    /// Keep the audit trail.
    pub fn audit(&self) -> bool {
        !self.no_audit
    }

    /// The chat template's bounds: the library's defaults, with any flag.
    pub fn template_limits(&self) -> TemplateLimits {
        let d = TemplateLimits::default();
        TemplateLimits {
            fuel: self.template_fuel.unwrap_or(d.fuel),
            max_output_bytes: self.template_max_output.unwrap_or(d.max_output_bytes),
            deadline: self
                .template_deadline_ms
                .map_or(d.deadline, Duration::from_millis),
        }
    }

    /// The checks clap cannot express: combinations, and an open server
    /// on a public address.
    pub fn check(&self) -> Result<(), String> {
        if self.cuda() && self.threads.is_some() {
            return Err("--threads sets the CPU backend's threads; --backend cuda has none".into());
        }
        if self.transport != LinkKind::InProcess && !self.disaggregated {
            return Err("--transport needs --disaggregated".into());
        }
        if self.corrupt_receipt_of.is_some() && !self.disaggregated {
            return Err("--corrupt-receipt-of-request needs --disaggregated".into());
        }
        if self
            .metrics_key
            .as_deref()
            .is_some_and(|k| k.trim().is_empty())
        {
            return Err("--metrics-key must not be empty".into());
        }
        if self.max_connections == 0 {
            return Err("--max-connections must be at least 1".into());
        }
        if self.api_keys.is_none() && !self.host.is_loopback() {
            return Err(format!(
                "--host {} is not a loopback address: without --api-keys the server is open to \
                 anyone who can reach it, so it binds loopback only; give --api-keys FILE",
                self.host
            ));
        }
        Ok(())
    }
}
