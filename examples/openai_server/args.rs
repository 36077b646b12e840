//! Command-line flags.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

pub const USAGE: &str = "usage: openai_server [--model PATH|random] [--host 127.0.0.1] [--port 8000] \
[--api-keys FILE] [--disaggregated [--transport inproc|tcp]] [--max-context N] [--pool-tokens N] [--max-queue N] \
[--grace-secs S] [--served-model-name NAME] [--threads N] [--backend cpu|cuda] \
[--kv-dtype f32|f16|bf16|fp8] [--no-audit] \
[--corrupt-receipt-of-request ID (test aid, with --disaggregated)]";

/// The link between the workers of `--disaggregated`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkKind {
    /// Channels in this process (the default).
    InProcess,
    /// Loopback TCP, authenticated under a fresh link key (Noise NNpsk0,
    /// every frame sealed): the wire path of two machines.
    Tcp,
}

#[derive(Clone, Debug)]
pub struct Args {
    /// `None`: the embedded random-weights model.
    pub model: Option<PathBuf>,
    pub host: IpAddr,
    /// 0 picks a free port (printed on stdout).
    pub port: u16,
    pub api_keys: Option<PathBuf>,
    pub disaggregated: bool,
    /// How the two workers of `--disaggregated` are joined.
    pub transport: LinkKind,
    /// The context window; default: the model's, capped at 2048.
    pub max_context: Option<usize>,
    /// KV pool size in tokens; default: 8 windows.
    pub pool_tokens: Option<usize>,
    pub max_queue: Option<usize>,
    pub grace: Duration,
    pub served_name: Option<String>,
    pub threads: Option<usize>,
    /// `--backend cuda`: every model on GPU 0, KV pages in its memory.
    pub cuda: bool,
    /// The KV pages' element type (f32 by default; bf16 or f16 run the
    /// GPU's tensor-core attention).
    pub kv_dtype: handoff::KvDtype,
    /// Keep the audit trail (every KV read checked against its writer).
    pub audit: bool,
    /// Test aid: the prefill worker corrupts this request's receipt (the
    /// decode worker's verifier must fail it with a 500).
    pub corrupt_receipt_of: Option<u64>,
}

fn num<T: std::str::FromStr>(flag: &str, v: &str) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    v.parse().map_err(|e| format!("{flag} {v:?}: {e}"))
}

pub fn parse(mut it: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut a = Args {
        model: None,
        host: IpAddr::from([127, 0, 0, 1]),
        port: 8000,
        api_keys: None,
        disaggregated: false,
        transport: LinkKind::InProcess,
        max_context: None,
        pool_tokens: None,
        max_queue: None,
        grace: Duration::from_secs(10),
        served_name: None,
        threads: None,
        cuda: false,
        kv_dtype: handoff::KvDtype::F32,
        audit: true,
        corrupt_receipt_of: None,
    };
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => {
                let v = value()?;
                a.model = (v != "random").then(|| PathBuf::from(v));
            }
            "--host" => a.host = num(&flag, &value()?)?,
            "--port" => a.port = num(&flag, &value()?)?,
            "--api-keys" => a.api_keys = Some(PathBuf::from(value()?)),
            "--disaggregated" => a.disaggregated = true,
            "--transport" => {
                a.transport = match value()?.as_str() {
                    "inproc" => LinkKind::InProcess,
                    "tcp" => LinkKind::Tcp,
                    // NIXL is not built yet (issue #17).
                    other => return Err(format!("--transport {other:?}: expected inproc or tcp")),
                }
            }
            "--max-context" => a.max_context = Some(num(&flag, &value()?)?),
            "--pool-tokens" => a.pool_tokens = Some(num(&flag, &value()?)?),
            "--max-queue" => a.max_queue = Some(num(&flag, &value()?)?),
            "--grace-secs" => {
                let s: f64 = num(&flag, &value()?)?;
                a.grace =
                    Duration::try_from_secs_f64(s).map_err(|e| format!("--grace-secs {s}: {e}"))?;
            }
            "--served-model-name" => a.served_name = Some(value()?),
            "--threads" => a.threads = Some(num(&flag, &value()?)?),
            "--backend" => {
                a.cuda = match value()?.as_str() {
                    "cpu" => false,
                    "cuda" => true,
                    other => return Err(format!("--backend {other:?}: expected cpu or cuda")),
                }
            }
            "--kv-dtype" => {
                let v = value()?;
                a.kv_dtype = handoff::KvDtype::parse(&v)
                    .ok_or(format!("--kv-dtype {v:?}: f32, f16, bf16 or fp8"))?
            }
            "--no-audit" => a.audit = false,
            "--corrupt-receipt-of-request" => a.corrupt_receipt_of = Some(num(&flag, &value()?)?),
            "-h" | "--help" => return Err("help".into()),
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if a.cuda && a.threads.is_some() {
        return Err("--threads sets the CPU backend's threads; --backend cuda has none".into());
    }
    if a.transport != LinkKind::InProcess && !a.disaggregated {
        return Err("--transport needs --disaggregated".into());
    }
    if a.corrupt_receipt_of.is_some() && !a.disaggregated {
        return Err("--corrupt-receipt-of-request needs --disaggregated".into());
    }
    if a.api_keys.is_none() && !a.host.is_loopback() {
        return Err(format!(
            "--host {} is not a loopback address: without --api-keys the server is open to \
             anyone who can reach it, so it binds loopback only; give --api-keys FILE",
            a.host
        ));
    }
    Ok(a)
}
