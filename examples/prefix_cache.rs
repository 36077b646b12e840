//! The prefix cache and chunked prefill on the embedded random-weights
//! model, in the two workloads of issue #20, each run with and without:
//!
//! 1. Multi-turn chat: a shared system prompt (1,000 tokens), 8 tenants,
//!    32 conversations of two turns; time to first token with and without
//!    the cache, hit rate by tenant, and the cross-tenant hits (pages one
//!    tenant leased that another published: must be 0).
//! 2. One long prompt (16k tokens) arriving among 32 running decodes: the
//!    decodes' inter-token latency p99 with and without chunked prefill.
//!
//! ```sh
//! cargo run --release --example prefix_cache
//! cargo run --release --example prefix_cache -- --long-prompt 4096 --system-tokens 500
//! ```
//!
//! The driver calls the model's passes the way an engine step does (reserve
//! from the cache, prefill what was not reused, publish, decode in batches;
//! a step = the decode pass plus that step's prefill chunk), one request at
//! a time in workload 1. Both runs of each workload must produce the same
//! tokens (and, for the long prompt, the same logits bit for bit), and every
//! pool must be full at the end; the exit status is non-zero otherwise or
//! on any cross-tenant hit. The last line is
//! `prefix_cache: cross_tenant_hits=N same_tenant_hit_rate=R ttft_speedup=S chunked_itl_p99_ratio=Q`.

use std::collections::HashMap;
use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use handoff::kv::{CacheSecret, Filling, KvSeq, PrefixCache, Ready};
use handoff::model::{Model, ModelConfig, random_weights};
use handoff::sched::{ChunkBudget, PartialPrefill, plan_chunks};
use handoff::{KvDtype, KvPool, PoolConfig, RequestId, TenantId};

const PAGE: usize = 16;

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

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
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

/// Workload 1's figures for one run.
struct Chat {
    ttft: Vec<Duration>,
    tokens: Vec<Vec<u32>>,
    /// Per tenant: (pages reused, reusable pages looked up).
    hits: HashMap<TenantId, (usize, usize)>,
    cross_tenant_hits: usize,
    pool_full: bool,
}

const ANSWER: usize = 8;

fn chat(model: &Model, a: &Args, use_cache: bool) -> Result<Chat, String> {
    let vocab = model.config().vocab_size as u32;
    let system: Vec<u32> = (0..a.system_tokens as u32)
        .map(|i| (i * 31 + 7) % vocab)
        .collect();
    let longest = a.system_tokens + 3 * 40 + 2 * ANSWER;
    let pages = (a.conversations as usize + 2) * (longest + ANSWER).div_ceil(PAGE);
    let pool = KvPool::new(PoolConfig::new(
        model.kv_geometry(KvDtype::F32),
        PAGE,
        pages,
    ))
    .map_err(|e| e.to_string())?;
    let cache = PrefixCache::new(
        &pool,
        model.fingerprint().to_u64(),
        CacheSecret::random().map_err(|e| e.to_string())?,
    );
    let mut published_by: HashMap<u32, TenantId> = HashMap::new();
    let mut out = Chat {
        ttft: Vec::new(),
        tokens: Vec::new(),
        hits: HashMap::new(),
        cross_tenant_hits: 0,
        pool_full: false,
    };
    let mut history: Vec<Vec<u32>> = vec![system.clone(); a.conversations as usize];
    let mut scratch = model.scratch();
    let mut id = 0;
    for turn in 0..2u32 {
        for conv in 0..a.conversations {
            let tenant = TenantId(conv % a.tenants);
            let prompt = &mut history[conv as usize];
            prompt.extend((0..40).map(|j| (conv * 97 + turn * 13 + j * 5 + 1) % vocab));
            id += 1;
            let start = Instant::now();
            let total = prompt.len() + ANSWER;
            let (mut seq, keys): (KvSeq<Filling>, _) = if use_cache {
                let keys = cache.keys(tenant, prompt);
                let seq = cache
                    .reserve(RequestId(id), &keys, total)
                    .map_err(|e| e.to_string())?;
                (seq, Some(keys))
            } else {
                let seq = pool
                    .reserve(RequestId(id), total)
                    .map_err(|e| e.to_string())?;
                (seq, None)
            };
            let rest = &prompt[seq.written(0)..];
            let first = argmax(
                model
                    .prefill(&mut scratch, &mut [&mut seq], &[rest])
                    .map_err(|e| e.to_string())?
                    .row(0),
            );
            out.ttft.push(start.elapsed());
            if let Some(keys) = &keys {
                let h = out.hits.entry(tenant).or_default();
                h.0 += seq.shared_pages();
                h.1 += keys.reusable_pages();
                for p in &seq.pages()[..seq.shared_pages()] {
                    if published_by.get(&p.index()) != Some(&tenant) {
                        out.cross_tenant_hits += 1;
                    }
                }
                let before = seq.shared_pages();
                let n = cache.publish(&mut seq, keys).map_err(|e| e.to_string())?;
                for p in &seq.pages()[before..before + n] {
                    published_by.insert(p.index(), tenant);
                }
            }
            let mut seq: KvSeq<Ready> = seq.seal(prompt.len()).map_err(|e| e.to_string())?;
            let mut answer = vec![first];
            while answer.len() < ANSWER {
                let last = answer[answer.len() - 1];
                let logits = model
                    .decode(&mut scratch, &mut [&mut seq], &[last])
                    .map_err(|e| e.to_string())?;
                answer.push(argmax(logits.row(0)));
            }
            prompt.extend(&answer);
            out.tokens.push(answer);
        }
    }
    let st = pool.stats();
    out.pool_full = st.is_full() && st.isolation_violations == 0;
    cache.evict_idle();
    out.pool_full &= pool.stats().all_free();
    Ok(out)
}

/// Workload 2's figures for one run.
struct Mixed {
    itl: Vec<Duration>,
    long_ttft: Duration,
    long_logits: Vec<u32>,
    tokens: Vec<Vec<u32>>,
    passes: usize,
    pool_full: bool,
}

fn mixed(model: &Model, a: &Args, chunked: bool) -> Result<Mixed, String> {
    let vocab = model.config().vocab_size as u32;
    let short = 32;
    let after = 8; // decode steps after the long prompt's first token
    let budget = ChunkBudget {
        step_tokens: a.step_tokens,
        min_chunk: 16,
    };
    let per_step = a.step_tokens.saturating_sub(a.decodes).max(16);
    let max_steps = 4 + a.long_prompt.div_ceil(per_step) + after + 1;
    let dec_tokens = short + max_steps + 1;
    let pages = a.decodes * dec_tokens.div_ceil(PAGE) + (a.long_prompt + 1).div_ceil(PAGE) + 4;
    let pool = KvPool::new(PoolConfig::new(
        model.kv_geometry(KvDtype::F32),
        PAGE,
        pages,
    ))
    .map_err(|e| e.to_string())?;
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let mut scratch = model.scratch();
    // 32 running decodes, each past its own short prompt.
    let mut running = Vec::new();
    let mut last = Vec::new();
    for d in 0..a.decodes {
        let prompt: Vec<u32> = (0..short as u32)
            .map(|j| (d as u32 * 7 + j * 3 + 2) % vocab)
            .collect();
        let mut seq = pool
            .reserve(RequestId(d as u64), dec_tokens)
            .map_err(|e| err(&e))?;
        let row = model
            .prefill(&mut scratch, &mut [&mut seq], &[&prompt])
            .map_err(|e| err(&e))?
            .row(0)
            .to_vec();
        last.push(argmax(&row));
        running.push(seq.seal(short).map_err(|e| err(&e))?);
    }
    let long: Vec<u32> = (0..a.long_prompt as u32)
        .map(|j| (j * 11 + 5) % vocab)
        .collect();
    let mut tokens = vec![Vec::new(); a.decodes];
    let mut itl = Vec::new();
    let mut long_seq: Option<KvSeq<Filling>> = None;
    let mut progress = PartialPrefill {
        id: RequestId(1_000_000),
        done: 0,
        total: long.len(),
    };
    let (mut arrived, mut long_ttft, mut long_logits) = (None, Duration::ZERO, Vec::new());
    let (mut passes, mut steps_after) = (0, 0);
    for step in 0..max_steps {
        if step == 4 {
            long_seq = Some(
                pool.reserve(progress.id, long.len() + 1)
                    .map_err(|e| err(&e))?,
            );
            arrived = Some(Instant::now());
        }
        let t0 = Instant::now();
        {
            let mut seqs: Vec<&mut KvSeq<Ready>> = running.iter_mut().collect();
            let logits = model
                .decode(&mut scratch, &mut seqs, &last)
                .map_err(|e| err(&e))?;
            for (i, row) in logits.rows().enumerate() {
                last[i] = argmax(row);
                tokens[i].push(last[i]);
            }
        }
        if let Some(seq) = long_seq.as_mut().filter(|_| progress.remaining() > 0) {
            let len = if chunked {
                plan_chunks(budget, a.decodes, &[progress])
                    .first()
                    .map_or(0, |c| c.len)
            } else {
                progress.remaining()
            };
            let chunk = &long[progress.done..progress.done + len];
            let row = model
                .prefill(&mut scratch, &mut [seq], &[chunk])
                .map_err(|e| err(&e))?
                .row(0)
                .to_vec();
            progress.done += len;
            passes += 1;
            if progress.remaining() == 0 {
                long_logits = row.iter().map(|x| x.to_bits()).collect();
                long_ttft = arrived.map_or(Duration::ZERO, |t| t.elapsed());
            }
        }
        // Every running decode waited this whole step for its token.
        let dt = t0.elapsed();
        itl.extend(std::iter::repeat_n(dt, a.decodes));
        if progress.remaining() == 0 && long_seq.is_some() {
            steps_after += 1;
            if steps_after > after {
                break;
            }
        }
    }
    drop((running, long_seq));
    Ok(Mixed {
        itl,
        long_ttft,
        long_logits,
        tokens,
        passes,
        pool_full: pool.stats().all_free(),
    })
}

fn run(a: &Args) -> Result<bool, String> {
    let cfg = ModelConfig {
        max_seq_len: (a.long_prompt + 64).max(a.system_tokens + 512),
        ..ModelConfig::tiny_gqa()
    };
    let model = Model::cpu(random_weights(&cfg, 20)).map_err(|e| e.to_string())?;
    say(format!(
        "model: tiny_gqa random weights (dim {}, {} layers), page size {PAGE}, {} threads",
        cfg.dim,
        cfg.n_layers,
        rayon::current_num_threads()
    ));

    // Workload 1.
    let off = chat(&model, a, false)?;
    let on = chat(&model, a, true)?;
    let mean = |xs: &[Duration]| xs.iter().sum::<Duration>() / xs.len().max(1) as u32;
    let (mut t_off, mut t_on) = (off.ttft.clone(), on.ttft.clone());
    say(format!(
        "chat: {} conversations x 2 turns, {} tenants, {}-token system prompt",
        a.conversations, a.tenants, a.system_tokens
    ));
    say(format!(
        "  ttft mean  without cache {:8.2} ms   with cache {:8.2} ms",
        ms(mean(&off.ttft)),
        ms(mean(&on.ttft))
    ));
    say(format!(
        "  ttft p50   without cache {:8.2} ms   with cache {:8.2} ms",
        ms(percentile(&mut t_off, 0.5)),
        ms(percentile(&mut t_on, 0.5))
    ));
    say(format!(
        "  ttft p99   without cache {:8.2} ms   with cache {:8.2} ms",
        ms(percentile(&mut t_off, 0.99)),
        ms(percentile(&mut t_on, 0.99))
    ));
    let mut tenants: Vec<_> = on.hits.iter().collect();
    tenants.sort_by_key(|(t, _)| **t);
    let (mut hit, mut looked) = (0, 0);
    for (t, &(h, l)) in tenants {
        say(format!(
            "  {t}: hit rate {:.3} ({h} of {l} reusable pages)",
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
    let whole = mixed(&model, a, false)?;
    let parts = mixed(&model, a, true)?;
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
        "  long prompt ttft unchunked {:8.2} ms ({} pass)   chunked {:8.2} ms ({} passes)",
        ms(whole.long_ttft),
        whole.passes,
        ms(parts.long_ttft),
        parts.passes
    ));
    let n = whole.tokens[0].len().min(parts.tokens[0].len());
    let mixed_same = whole.long_logits == parts.long_logits
        && whole
            .tokens
            .iter()
            .zip(&parts.tokens)
            .all(|(x, y)| x[..n] == y[..n]);
    say(format!(
        "  same long-prompt logits (bits) and decode tokens: {mixed_same}; pools full: {} {}",
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
