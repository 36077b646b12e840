//! The prefix cache and chunked prefill of the colocated [`Engine`], on the
//! embedded random-weights model, in the two workloads of issue #20, each
//! run with and without:
//!
//! 1. Multi-turn chat: a shared system prompt (1,000 tokens), 8 tenants,
//!    32 conversations of two turns, each turn a request to the engine;
//!    time to first token with and without the prefix cache, hit rate by
//!    tenant, and the cross-tenant hits: pages a tenant's first request
//!    reused (every tenant's prompts begin with the same system prompt, so
//!    any reuse there is another tenant's page) plus cross-tenant reads the
//!    pool's audit trail saw. Must be 0.
//! 2. One long prompt (16k tokens) arriving among 32 running decodes: the
//!    decodes' inter-token latency p99 with and without chunked prefill.
//!
//! ```sh
//! cargo run --release --example prefix_cache
//! cargo run --release --example prefix_cache -- --long-prompt 4096 --system-tokens 500
//! ```
//!
//! Both runs of each workload must stream the same tokens, and every pool
//! must be full at the end (all free once the cache is emptied); the exit
//! status is non-zero otherwise or on any cross-tenant hit. The last line
//! is `prefix_cache: cross_tenant_hits=N same_tenant_hit_rate=R ttft_speedup=S chunked_itl_p99_ratio=Q`.

use std::collections::BTreeMap;
use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use handoff::model::{Model, ModelConfig, random_weights};
use handoff::{
    BatchLimits, Engine, EngineConfig, EngineOptions, Event, Headroom, KvDtype, Outcome, Request,
    RequestHandle, RequestId, TenantId,
};

const PAGE: usize = 16;
/// Tokens each chat turn generates.
const ANSWER: usize = 8;
/// Tokens of a conversation's own message in each turn.
const MESSAGE: usize = 40;

fn say(s: String) {
    let _ = writeln!(std::io::stdout(), "{s}");
}

struct Args {
    system_tokens: usize,
    tenants: u32,
    conversations: u32,
    long_prompt: usize,
    decodes: usize,
    step_tokens: usize,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        system_tokens: 1000,
        tenants: 8,
        conversations: 32,
        long_prompt: 16_384,
        decodes: 32,
        step_tokens: 512,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let v = it.next().ok_or(format!("{flag} needs a value"))?;
        let n = v
            .parse::<usize>()
            .ok()
            .filter(|&n| n > 0)
            .ok_or(format!("{flag} takes a positive integer, not {v:?}"))?;
        let small = |n: usize| u32::try_from(n).map_err(|_| format!("{flag} is too large"));
        match flag.as_str() {
            "--system-tokens" => a.system_tokens = n,
            "--tenants" => a.tenants = small(n)?,
            "--conversations" => a.conversations = small(n)?,
            "--long-prompt" => a.long_prompt = n,
            "--decodes" => a.decodes = n,
            "--step-tokens" => a.step_tokens = n,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    Ok(a)
}

fn percentile(xs: &mut [Duration], p: f64) -> Duration {
    if xs.is_empty() {
        return Duration::ZERO;
    }
    xs.sort();
    let i = ((xs.len() as f64 * p).ceil() as usize).clamp(1, xs.len()) - 1;
    xs[i]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn mean(xs: &[Duration]) -> Duration {
    xs.iter().sum::<Duration>() / xs.len().max(1) as u32
}

/// An engine over `weights` with a window of `window` tokens and a pool of
/// `pool_tokens`, the audit trail on.
fn engine(
    weights: &handoff::model::ModelWeights,
    window: usize,
    pool_tokens: usize,
    opts: EngineOptions,
) -> Result<Engine, String> {
    let model = Model::cpu(weights.clone()).map_err(|e| e.to_string())?;
    let headroom = Headroom::new(1.0).map_err(|e| e.to_string())?;
    let cfg = EngineConfig::colocated(model.kv_geometry(KvDtype::F32))
        .max_context(window)
        .page_size(PAGE)
        .pool_tokens(pool_tokens)
        .headroom(headroom)
        .audit(true)
        .build()
        .map_err(|e| e.to_string())?;
    Engine::with_options(model, cfg, opts).map_err(|e| e.to_string())
}

/// True when the engine's pool is full, balanced and saw no cross-request
/// read, and every page is free once the cache lets go of its idle pages.
fn pool_comes_back(e: &Engine) -> bool {
    let st = e.pool_stats();
    let ok = st.is_full() && st.balanced() && st.isolation_violations == 0;
    if let Some(cache) = e.prefix_cache() {
        cache.evict_idle();
    }
    ok && e.pool_stats().all_free()
}

/// Steps `e` until `h` streams its first token (or ends); the time that
/// took.
fn first_token(e: &mut Engine, h: &RequestHandle, start: Instant) -> Result<Duration, String> {
    loop {
        if !h.events().is_empty() {
            return Ok(start.elapsed());
        }
        if e.is_idle() {
            return Err(format!("request {} ended without a token", h.id()));
        }
        let _ = e.step();
    }
}

/// Everything `h` streamed, once its request has ended.
fn finished(h: &RequestHandle) -> Result<Vec<u32>, String> {
    let mut tokens = Vec::new();
    for ev in h.events().try_iter() {
        match ev {
            Event::Token(t) => tokens.push(t),
            Event::Logprobs(_) => {}
            Event::Done(Outcome::Finished(_) | Outcome::Cancelled) => return Ok(tokens),
            Event::Done(o) => return Err(format!("request {}: {o:?}", h.id())),
        }
    }
    Err(format!("request {} did not end", h.id()))
}

/// Workload 1's figures for one run.
struct Chat {
    ttft: Vec<Duration>,
    tokens: Vec<Vec<u32>>,
    /// Per tenant: (tokens reused, reusable tokens: full pages before each
    /// prompt's last token).
    hits: BTreeMap<TenantId, (u64, u64)>,
    cross_tenant_hits: u64,
    pool_full: bool,
}

fn chat(weights: &handoff::model::ModelWeights, a: &Args, cache: bool) -> Result<Chat, String> {
    let vocab = weights.config.vocab_size as u32;
    let system: Vec<u32> = (0..a.system_tokens as u32)
        .map(|i| (i * 31 + 7) % vocab)
        .collect();
    let window = a.system_tokens + 2 * (MESSAGE + ANSWER) + PAGE;
    // Room for the running request and most of the cache: eviction runs.
    let pool_tokens = window * (a.tenants as usize + 1).min(a.conversations as usize + 1);
    let opts = EngineOptions {
        prefix_cache: cache,
        ..EngineOptions::default()
    };
    let mut e = engine(weights, window, pool_tokens, opts)?;
    let mut out = Chat {
        ttft: Vec::new(),
        tokens: Vec::new(),
        hits: BTreeMap::new(),
        cross_tenant_hits: 0,
        pool_full: false,
    };
    let mut history: Vec<Vec<u32>> = vec![system; a.conversations as usize];
    let mut seen = std::collections::HashSet::new();
    let mut id = 0;
    for turn in 0..2u32 {
        for conv in 0..a.conversations {
            let tenant = TenantId(conv % a.tenants);
            let prompt = &mut history[conv as usize];
            prompt.extend((0..MESSAGE as u32).map(|j| (conv * 97 + turn * 13 + j * 5 + 1) % vocab));
            id += 1;
            let before = e.tally().reused_tokens;
            let start = Instant::now();
            let h = e
                .submit(Request::new(RequestId(id), tenant, prompt.clone(), ANSWER))
                .map_err(|r| r.to_string())?;
            out.ttft.push(first_token(&mut e, &h, start)?);
            let reused = e.tally().reused_tokens - before;
            e.run_until_idle();
            let answer = finished(&h)?;
            if cache {
                let hit = out.hits.entry(tenant).or_default();
                hit.0 += reused;
                hit.1 += ((prompt.len() - 1) / PAGE * PAGE) as u64;
                // A tenant's first request can only have reused another
                // tenant's pages: its own tenant has cached nothing yet.
                if seen.insert(tenant) {
                    out.cross_tenant_hits += reused.div_ceil(PAGE as u64);
                }
            }
            prompt.extend(&answer);
            out.tokens.push(answer);
        }
    }
    out.cross_tenant_hits += e.pool_stats().isolation_violations;
    out.pool_full = pool_comes_back(&e);
    Ok(out)
}

/// Workload 2's figures for one run.
struct Mixed {
    itl: Vec<Duration>,
    long_ttft: Duration,
    tokens: Vec<Vec<u32>>,
    steps: usize,
    pool_full: bool,
}

fn mixed(weights: &handoff::model::ModelWeights, a: &Args, chunked: bool) -> Result<Mixed, String> {
    let vocab = weights.config.vocab_size as u32;
    let short = 32;
    let after = 8; // steps after the long prompt's first token
    let per_step = a.step_tokens.saturating_sub(a.decodes).max(16);
    let max_steps = 4 + a.long_prompt.div_ceil(per_step) + after + 1;
    let window = (a.long_prompt + ANSWER).max(short + max_steps + 1);
    let dec_tokens = short + max_steps + 1;
    let pool_tokens = a.decodes * dec_tokens.div_ceil(PAGE) * PAGE + (a.long_prompt + PAGE) * 2;
    let opts = EngineOptions {
        limits: BatchLimits {
            max_running: a.decodes + 1,
            max_prefill_tokens: if chunked { a.step_tokens } else { 1 << 30 },
        },
        prefix_cache: false,
        chunked_prefill: chunked,
        speculative: None,
    };
    let mut e = engine(weights, window, pool_tokens.max(window), opts)?;
    // The running decodes, each past its own short prompt.
    let mut chats = Vec::new();
    for d in 0..a.decodes {
        let prompt: Vec<u32> = (0..short as u32)
            .map(|j| (d as u32 * 7 + j * 3 + 2) % vocab)
            .collect();
        let req = Request::new(RequestId(d as u64), TenantId(0), prompt, max_steps + 1);
        chats.push(e.submit(req).map_err(|r| r.to_string())?);
    }
    while e.running() < a.decodes {
        if e.is_idle() {
            return Err("the decodes ended before the long prompt came".into());
        }
        let _ = e.step();
    }
    for _ in 0..4 {
        let _ = e.step();
    }
    let long: Vec<u32> = (0..a.long_prompt as u32)
        .map(|j| (j * 11 + 5) % vocab)
        .collect();
    let req = Request::new(RequestId(1_000_000), TenantId(1), long, after);
    let arrived = Instant::now();
    let lh = e.submit(req).map_err(|r| r.to_string())?;
    let mut itl = Vec::new();
    let (mut long_ttft, mut steps, mut steps_after) = (None, 0, 0);
    while steps_after <= after && !e.is_idle() {
        let t0 = Instant::now();
        let r = e.step();
        // Every decode in this step waited the whole step for its token.
        itl.extend(std::iter::repeat_n(t0.elapsed(), r.decoded as usize));
        steps += 1;
        if long_ttft.is_none() && !lh.events().is_empty() {
            long_ttft = Some(arrived.elapsed());
        }
        if long_ttft.is_some() {
            steps_after += 1;
        }
    }
    for h in &chats {
        h.cancel();
    }
    lh.cancel();
    e.run_until_idle();
    let mut tokens = Vec::new();
    for h in chats.iter().chain([&lh]) {
        tokens.push(finished(h)?);
    }
    Ok(Mixed {
        itl,
        long_ttft: long_ttft.ok_or("the long prompt never produced a token")?,
        tokens,
        steps,
        pool_full: pool_comes_back(&e),
    })
}

fn run(a: &Args) -> Result<bool, String> {
    let cfg = ModelConfig {
        max_seq_len: (a.long_prompt + 64).max(a.system_tokens + 512),
        ..ModelConfig::tiny_gqa()
    };
    let weights = random_weights(&cfg, 20);
    say(format!(
        "model: tiny_gqa random weights (dim {}, {} layers), page size {PAGE}, {} threads; \
         every figure is a colocated Engine's",
        cfg.dim,
        cfg.n_layers,
        rayon::current_num_threads()
    ));

    // Workload 1.
    let off = chat(&weights, a, false)?;
    let on = chat(&weights, a, true)?;
    let (mut t_off, mut t_on) = (off.ttft.clone(), on.ttft.clone());
    say(format!(
        "chat: {} conversations x 2 turns, {} tenants, {}-token system prompt",
        a.conversations, a.tenants, a.system_tokens
    ));
    for (name, p) in [("p50", 0.5), ("p99", 0.99)] {
        say(format!(
            "  ttft {name}   without cache {:8.2} ms   with cache {:8.2} ms",
            ms(percentile(&mut t_off, p)),
            ms(percentile(&mut t_on, p))
        ));
    }
    say(format!(
        "  ttft mean  without cache {:8.2} ms   with cache {:8.2} ms",
        ms(mean(&off.ttft)),
        ms(mean(&on.ttft))
    ));
    let (mut hit, mut looked) = (0, 0);
    for (t, &(h, l)) in &on.hits {
        say(format!(
            "  {t}: hit rate {:.3} ({h} of {l} reusable tokens)",
            h as f64 / l.max(1) as f64
        ));
        hit += h;
        looked += l;
    }
    let same_tenant_rate = hit as f64 / looked.max(1) as f64;
    let ttft_speedup = mean(&off.ttft).as_secs_f64() / mean(&on.ttft).as_secs_f64().max(1e-12);
    let chat_same = off.tokens == on.tokens;
    say(format!(
        "  same tokens with and without the cache: {chat_same}; pools full: {} {}",
        off.pool_full, on.pool_full
    ));

    // Workload 2.
    let whole = mixed(&weights, a, false)?;
    let parts = mixed(&weights, a, true)?;
    let (mut i_whole, mut i_parts) = (whole.itl.clone(), parts.itl.clone());
    let p99_whole = percentile(&mut i_whole, 0.99);
    let p99_parts = percentile(&mut i_parts, 0.99);
    say(format!(
        "mixed: one {}-token prompt among {} running decodes, step budget {} tokens",
        a.long_prompt, a.decodes, a.step_tokens
    ));
    say(format!(
        "  decode itl p50  unchunked {:8.2} ms   chunked {:8.2} ms",
        ms(percentile(&mut i_whole, 0.5)),
        ms(percentile(&mut i_parts, 0.5))
    ));
    say(format!(
        "  decode itl p99  unchunked {:8.2} ms   chunked {:8.2} ms",
        ms(p99_whole),
        ms(p99_parts)
    ));
    say(format!(
        "  long prompt ttft unchunked {:8.2} ms ({} steps)   chunked {:8.2} ms ({} steps)",
        ms(whole.long_ttft),
        whole.steps,
        ms(parts.long_ttft),
        parts.steps
    ));
    // The runs stop after different numbers of steps: compare what both
    // streamed.
    let mixed_same = whole.tokens.iter().zip(&parts.tokens).all(|(x, y)| {
        let n = x.len().min(y.len());
        x[..n] == y[..n]
    }) && whole.tokens.last().map(Vec::len) == parts.tokens.last().map(Vec::len);
    say(format!(
        "  same tokens chunked and unchunked: {mixed_same}; pools full: {} {}",
        whole.pool_full, parts.pool_full
    ));
    let ratio = p99_parts.as_secs_f64() / p99_whole.as_secs_f64().max(1e-12);
    say(format!(
        "prefix_cache: cross_tenant_hits={} same_tenant_hit_rate={same_tenant_rate:.3} \
         ttft_speedup={ttft_speedup:.2} chunked_itl_p99_ratio={ratio:.3}",
        on.cross_tenant_hits
    ));
    Ok(on.cross_tenant_hits == 0
        && chat_same
        && mixed_same
        && off.pool_full
        && on.pool_full
        && whole.pool_full
        && parts.pool_full)
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("prefix_cache: {e}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("prefix_cache: {e}");
            ExitCode::FAILURE
        }
    }
}
