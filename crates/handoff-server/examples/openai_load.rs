//! A bounded load run against `handoff-server` on loopback:
//! concurrent streaming clients for a fixed time, then the latencies they
//! saw and the server's pools and isolation counter.
//!
//! ```sh
//! cargo run --release -p handoff-server -- --port 8000 &
//! cargo run --release -p handoff-server --example openai_load -- --url http://127.0.0.1:8000 --clients 64 --seconds 30
//! ```
//!
//! Each client sends streaming `/v1/completions` requests one after another
//! (prompt: `--prompt-tokens` token ids, distinct per request;
//! `--max-tokens` new tokens; greedy; `return_token_ids` so every token is
//! its own chunk) until `--seconds` have passed (at most 30), and times the
//! first token (TTFT) and the gaps between tokens (ITL) as the client
//! reads them. The last line:
//!
//! ```text
//! load: clients=64 seconds=30.0 requests=N ok=N errors=N req_per_s=R tokens_per_s=T ttft_p50_ms=.. ttft_p99_ms=.. itl_p50_ms=.. itl_p99_ms=.. pools_idle=true isolation_violations=0
//! ```
//!
//! The exit status is 0 only if every request finished with a 200 and
//! `[DONE]`, the server's pools were idle afterwards and its isolation
//! counter is 0. Flags: `--url` (loopback only), `--clients`, `--seconds`,
//! `--max-tokens`, `--prompt-tokens`, `--vocab` (ids are drawn below it;
//! 256 by default), `--model`, `--api-key`.

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

type Http = Client<HttpConnector, Full<Bytes>>;

#[derive(Clone)]
struct Args {
    url: String,
    clients: usize,
    seconds: f64,
    max_tokens: usize,
    prompt_tokens: usize,
    vocab: u32,
    model: String,
    api_key: Option<String>,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        url: "http://127.0.0.1:8000".into(),
        clients: 64,
        seconds: 10.0,
        max_tokens: 32,
        prompt_tokens: 16,
        vocab: 256,
        model: "handoff-random".into(),
        api_key: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let v = it.next().ok_or(format!("{flag} needs a value"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {v:?}: {e}");
        match flag.as_str() {
            "--url" => a.url = v.trim_end_matches('/').to_string(),
            "--clients" => a.clients = v.parse().map_err(|e| bad(&e))?,
            "--seconds" => a.seconds = v.parse().map_err(|e| bad(&e))?,
            "--max-tokens" => a.max_tokens = v.parse().map_err(|e| bad(&e))?,
            "--prompt-tokens" => a.prompt_tokens = v.parse().map_err(|e| bad(&e))?,
            "--vocab" => a.vocab = v.parse().map_err(|e| bad(&e))?,
            "--model" => a.model = v,
            "--api-key" => a.api_key = Some(v),
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if !(a.seconds > 0.0 && a.seconds <= 30.0) {
        return Err(format!("--seconds {}: between 0 and 30", a.seconds));
    }
    if a.clients == 0 || a.max_tokens == 0 || a.prompt_tokens == 0 || a.vocab == 0 {
        return Err("--clients, --max-tokens, --prompt-tokens and --vocab must be positive".into());
    }
    let loopback = ["http://127.0.0.1:", "http://localhost:", "http://[::1]:"];
    if !loopback.iter().any(|p| a.url.starts_with(p)) {
        return Err(format!("--url {}: loopback only", a.url));
    }
    Ok(a)
}

/// What one client saw.
#[derive(Default)]
struct Seen {
    ok: usize,
    errors: Vec<String>,
    tokens: usize,
    ttft: Vec<Duration>,
    itl: Vec<Duration>,
}

/// One streaming request: its TTFT, ITLs and token count, or what went wrong.
async fn one(http: &Http, a: &Args, prompt: Vec<u32>, seen: &mut Seen) {
    let body = serde_json::json!({
        "model": a.model,
        "prompt": prompt,
        "max_tokens": a.max_tokens,
        "temperature": 0,
        "stream": true,
        "return_token_ids": true,
    })
    .to_string();
    let mut req = hyper::Request::post(format!("{}/v1/completions", a.url))
        .header("content-type", "application/json");
    if let Some(k) = &a.api_key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    let req = match req.body(Full::new(Bytes::from(body))) {
        Ok(r) => r,
        Err(e) => return seen.errors.push(e.to_string()),
    };
    let start = Instant::now();
    let resp = match http.request(req).await {
        Ok(r) => r,
        Err(e) => return seen.errors.push(format!("request: {e}")),
    };
    if resp.status() != 200 {
        let status = resp.status();
        let text = match resp.into_body().collect().await {
            Ok(b) => String::from_utf8_lossy(&b.to_bytes()).into_owned(),
            Err(e) => e.to_string(),
        };
        return seen.errors.push(format!("{status}: {text}"));
    }
    let mut body = resp.into_body();
    let mut buf = String::new();
    let mut last: Option<Instant> = None;
    let mut tokens = 0;
    let mut done = false;
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(f) => f,
            Err(e) => return seen.errors.push(format!("body: {e}")),
        };
        let Some(data) = frame.data_ref() else {
            continue;
        };
        buf.push_str(&String::from_utf8_lossy(data));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            for line in event.lines() {
                let Some(payload) = line.strip_prefix("data: ") else {
                    continue;
                };
                if payload == "[DONE]" {
                    done = true;
                    continue;
                }
                let v: serde_json::Value = match serde_json::from_str(payload) {
                    Ok(v) => v,
                    Err(e) => return seen.errors.push(format!("chunk: {e}")),
                };
                if v.get("error").is_some() {
                    return seen.errors.push(format!("stream error: {payload}"));
                }
                let n = v["choices"][0]["token_ids"].as_array().map_or(0, Vec::len);
                for _ in 0..n {
                    let now = Instant::now();
                    match last {
                        None => seen.ttft.push(now - start),
                        Some(t) => seen.itl.push(now - t),
                    }
                    last = Some(now);
                    tokens += 1;
                }
            }
        }
    }
    if done && tokens == a.max_tokens {
        seen.ok += 1;
        seen.tokens += tokens;
    } else {
        seen.errors
            .push(format!("stream ended after {tokens} tokens, [DONE] {done}"));
    }
}

async fn client(http: Http, a: Arc<Args>, c: usize, until: Instant) -> Seen {
    let mut seen = Seen::default();
    let mut r = 0u32;
    while Instant::now() < until {
        let prompt = (0..a.prompt_tokens as u32)
            .map(|i| (i * 31 + c as u32 * 7 + r * 13 + 1) % a.vocab)
            .collect();
        one(&http, &a, prompt, &mut seen).await;
        r += 1;
    }
    seen
}

fn pct(v: &mut [Duration], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort();
    let i = ((v.len() - 1) as f64 * q).round() as usize;
    v[i].as_secs_f64() * 1e3
}

/// Sums the samples of `name` whose label set contains `label`.
fn metric(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(label))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

async fn scrape(http: &Http, url: &str) -> Result<String, String> {
    let req = hyper::Request::get(format!("{url}/metrics"))
        .body(Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    let resp = http.request(req).await.map_err(|e| e.to_string())?;
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?;
    Ok(String::from_utf8_lossy(&body.to_bytes()).into_owned())
}

async fn run(a: Args) -> Result<bool, String> {
    let http: Http = Client::builder(TokioExecutor::new()).build_http();
    let a = Arc::new(a);
    let start = Instant::now();
    let until = start + Duration::from_secs_f64(a.seconds);
    let tasks: Vec<_> = (0..a.clients)
        .map(|c| tokio::spawn(client(http.clone(), a.clone(), c, until)))
        .collect();
    let mut all = Seen::default();
    for t in tasks {
        let s = t.await.map_err(|e| format!("a client task failed: {e}"))?;
        all.ok += s.ok;
        all.tokens += s.tokens;
        all.errors.extend(s.errors);
        all.ttft.extend(s.ttft);
        all.itl.extend(s.itl);
    }
    let wall = start.elapsed().as_secs_f64();
    for e in all.errors.iter().take(5) {
        eprintln!("error: {e}");
    }
    // The pools once the load has drained (cancels and releases land at
    // the engine's next steps).
    let mut idle = false;
    let mut violations = f64::NAN;
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        let m = scrape(&http, &a.url).await?;
        let busy = metric(&m, "handoff_pool_pages{", "state=\"in_use\"")
            + metric(&m, "handoff_pool_pages{", "state=\"held\"");
        violations = metric(&m, "handoff_isolation_violations{", "pool=");
        if busy == 0.0 {
            idle = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let requests = all.ok + all.errors.len();
    let line = format!(
        "load: clients={} seconds={wall:.1} requests={requests} ok={} errors={} req_per_s={:.1} tokens_per_s={:.0} ttft_p50_ms={:.2} ttft_p99_ms={:.2} itl_p50_ms={:.2} itl_p99_ms={:.2} pools_idle={idle} isolation_violations={violations}",
        a.clients,
        all.ok,
        all.errors.len(),
        all.ok as f64 / wall,
        all.tokens as f64 / wall,
        pct(&mut all.ttft, 0.5),
        pct(&mut all.ttft, 0.99),
        pct(&mut all.itl, 0.5),
        pct(&mut all.itl, 0.99),
    );
    let _ = writeln!(std::io::stdout(), "{line}");
    Ok(all.errors.is_empty() && idle && violations == 0.0)
}

fn main() -> ExitCode {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: no async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match rt.block_on(run(a)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
