//! Decode and prefill figures, printed side by side in one run:
//!
//! - single-stream decode tokens/s;
//! - aggregate decode tokens/s at batch 8, 32 and 128 (one batched pass per
//!   step: each weight matrix is read once for all sequences);
//! - the same through the colocated `Engine` (scheduling, sampling and
//!   streaming included);
//! - time to first token for 128- and 512-token prompts.
//!
//! On stories260K (skipped when absent) and on a random model of
//! Llama-3.2-1B shape with fewer layers (`HANDOFF_BENCH_LAYERS`, default 4;
//! `HANDOFF_BENCH_BIG=0` skips it). `HANDOFF_BENCH_CASE=B` / `HANDOFF_BENCH_ENGINE=B`
//! run one decode / engine case (for perf); `HANDOFF_BENCH_SAMPLING=only` the
//! sampler's figures alone.
//!
//! ```sh
//! cargo bench --bench decode
//! ```

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use handoff::backend::CpuBackend;
use handoff::kv::{KvSeq, Ready};
use handoff::model::{Model, ModelConfig, ModelWeights, load_llama2c, random_weights};
use handoff::sampling::{Sampler, argmax};
use handoff::{
    BatchLimits, Engine, EngineConfig, EngineOptions, KvDtype, KvPool, PoolConfig, Request,
    RequestId, SamplingParams, TenantId,
};

const STORIES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../shared/models/stories260K.bin"
);

fn say(s: String) {
    let _ = writeln!(std::io::stdout(), "{s}");
}

struct Plan {
    name: &'static str,
    /// Decode steps per sequence, the same for every batch size so every
    /// batch attends over the same contexts.
    steps: usize,
    /// Repetitions per batch size (small batches repeat to time enough
    /// tokens).
    reps: fn(usize) -> usize,
    prompt_len: usize,
    batches: &'static [usize],
    ttft: &'static [usize],
    engine_batches: &'static [usize],
    engine_new: usize,
}

fn prompt(len: usize, salt: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|j| ((salt * 131 + j * 17 + 1) % vocab) as u32)
        .collect()
}

/// CPU time used by each live thread of this process (Linux schedstat), so
/// figures can be read on a machine shared with other jobs.
fn cpu_times() -> std::collections::HashMap<String, u64> {
    let mut out = std::collections::HashMap::new();
    if let Ok(dir) = std::fs::read_dir("/proc/self/task") {
        for t in dir.flatten() {
            if let Ok(s) = std::fs::read_to_string(t.path().join("schedstat")) {
                let ns = s
                    .split_whitespace()
                    .next()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                out.insert(t.file_name().to_string_lossy().into_owned(), ns);
            }
        }
    }
    out
}

/// CPU time all threads used since `before` was taken.
fn cpu_since(before: &std::collections::HashMap<String, u64>) -> Duration {
    let ns: u64 = cpu_times()
        .iter()
        .map(|(tid, &now)| now.saturating_sub(before.get(tid).copied().unwrap_or(0)))
        .sum();
    Duration::from_nanos(ns)
}

/// Tokens per second of wall time and per second of CPU time.
#[derive(Clone, Copy)]
struct Rate {
    wall: f64,
    cpu: f64,
}

/// `reps` times: prefills `batch` sequences, runs one untimed warm-up
/// step, then times `steps` batched decode steps. One pool serves every
/// repetition, after an untimed one: the first touch of a fresh arena's
/// memory (page faults, a few percent of a step) is a cost of creating a
/// pool, not of decoding, and a serving engine reuses its pool's pages.
fn decode_rate(m: &Model, batch: usize, prompt_len: usize, steps: usize, reps: usize) -> Rate {
    let total = prompt_len + steps + 1;
    let pool = KvPool::new(PoolConfig::new(
        m.kv_geometry(KvDtype::F32),
        16,
        batch * total.div_ceil(16),
    ))
    .unwrap();
    let _ = decode_once(m, &pool, batch, prompt_len, steps);
    let (mut wall, mut cpu, mut n) = (Duration::ZERO, Duration::ZERO, 0usize);
    for _ in 0..reps {
        let (w, c) = decode_once(m, &pool, batch, prompt_len, steps);
        wall += w;
        cpu += c;
        n += batch * steps;
    }
    Rate {
        wall: n as f64 / wall.as_secs_f64(),
        cpu: n as f64 / cpu.as_secs_f64(),
    }
}

/// One prefill, one warm-up step, then `steps` timed steps: (wall, CPU).
fn decode_once(
    m: &Model,
    pool: &KvPool,
    batch: usize,
    prompt_len: usize,
    steps: usize,
) -> (Duration, Duration) {
    let total = prompt_len + steps + 1;
    let mut s = m.scratch();
    let vocab = m.config().vocab_size;
    // One batched prefill for all sequences.
    let prompts: Vec<Vec<u32>> = (0..batch).map(|b| prompt(prompt_len, b, vocab)).collect();
    let mut filling: Vec<_> = (0..batch)
        .map(|b| pool.reserve(RequestId(b as u64), total).unwrap())
        .collect();
    let mut next = {
        let mut refs: Vec<_> = filling.iter_mut().collect();
        let ps: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
        let l = m.prefill(&mut s, &mut refs, &ps).unwrap();
        l.rows().map(|r| argmax(r).unwrap()).collect::<Vec<u32>>()
    };
    let mut seqs: Vec<KvSeq<Ready>> = filling
        .into_iter()
        .map(|f| f.seal(prompt_len).unwrap())
        .collect();
    // Warm-up step (buffers grow once), then the timed steps.
    let mut step = |seqs: &mut Vec<KvSeq<Ready>>, next: &mut Vec<u32>| {
        let mut refs: Vec<&mut KvSeq<Ready>> = seqs.iter_mut().collect();
        let l = m.decode(&mut s, &mut refs, next).unwrap();
        for (i, t) in next.iter_mut().enumerate() {
            *t = argmax(l.row(i)).unwrap();
        }
    };
    step(&mut seqs, &mut next);
    let (t, c) = (Instant::now(), cpu_times());
    for _ in 0..steps {
        step(&mut seqs, &mut next);
    }
    (t.elapsed(), cpu_since(&c))
}

/// One layer of decode attention alone (one thread): `batch` sequences of
/// `ctx` positions, the model's head layout; nanoseconds per (position,
/// query head).
fn attention_ns(c: &ModelConfig, batch: usize, ctx: usize, dtype: KvDtype) -> f64 {
    use handoff::backend::{AttnShape, Backend};
    let shape = AttnShape {
        n_heads: c.n_heads,
        n_kv_heads: c.n_kv_heads,
        head_dim: c.head_dim,
    };
    let geometry = handoff::KvGeometry {
        n_layers: 1,
        n_kv_heads: c.n_kv_heads,
        head_dim: c.head_dim,
        dtype,
    };
    let pool = KvPool::new(PoolConfig::new(geometry, 16, batch * ctx.div_ceil(16))).unwrap();
    let kvd = shape.kv_dim();
    let val = |i: usize| ((i * 2654435761) % 1000) as f32 / 1000.0 - 0.5;
    let seqs: Vec<_> = (0..batch)
        .map(|b| {
            let mut s = pool.reserve(RequestId(b as u64), ctx).unwrap();
            let k: Vec<f32> = (0..ctx * kvd).map(|i| val(i + b)).collect();
            let v: Vec<f32> = (0..ctx * kvd).map(|i| val(i * 3 + b)).collect();
            s.append(0, &k, &v).unwrap();
            s
        })
        .collect();
    let q: Vec<f32> = (0..batch * shape.q_dim()).map(|i| val(i * 7)).collect();
    let mut out = Vec::new();
    let backend = CpuBackend::with_threads(1);
    let reader = pool.reader();
    let views: Vec<_> = seqs
        .iter()
        .map(|s| reader.seq(s).unwrap().layer(0).unwrap())
        .collect();
    backend
        .attention_decode(&q, &views, shape, &mut out)
        .unwrap();
    let reps = 200;
    let t = Instant::now();
    for _ in 0..reps {
        backend
            .attention_decode(&q, &views, shape, &mut out)
            .unwrap();
    }
    t.elapsed().as_nanos() as f64 / (reps * batch * ctx * c.n_heads) as f64
}

/// Prefill of an `n`-token prompt to its first sampled token.
fn ttft(m: &Model, n: usize) -> Duration {
    let pool = KvPool::new(PoolConfig::new(
        m.kv_geometry(KvDtype::F32),
        16,
        n.div_ceil(16) + 1,
    ))
    .unwrap();
    let p = prompt(n, 7, m.config().vocab_size);
    let mut s = m.scratch();
    let mut best = Duration::MAX;
    for _ in 0..2 {
        let mut seq = pool.reserve(RequestId(1), n + 1).unwrap();
        let t = Instant::now();
        let l = m.prefill(&mut s, &mut [&mut seq], &[&p]).unwrap();
        let _ = argmax(l.row(0)).unwrap();
        best = best.min(t.elapsed());
    }
    best
}

/// End to end through the engine: `batch` requests submitted together.
fn engine_rate(w: &ModelWeights, batch: usize, prompt_len: usize, new: usize) -> (f64, Duration) {
    let model = Model::new(backend(), w.clone()).unwrap();
    let max_context = (prompt_len + new).next_multiple_of(16);
    let cfg = EngineConfig::colocated(model.kv_geometry(KvDtype::F32))
        .max_context(max_context)
        .page_size(16)
        .pool_tokens(max_context * batch.max(2))
        .build()
        .unwrap();
    let opts = EngineOptions {
        limits: BatchLimits {
            max_running: batch,
            max_prefill_tokens: 1 << 20,
        },
        ..EngineOptions::default()
    };
    let mut e = Engine::with_options(model, cfg, opts).unwrap();
    let vocab = w.config.vocab_size;
    let t = Instant::now();
    let handles: Vec<_> = (0..batch)
        .map(|b| {
            e.submit(Request::new(
                RequestId(b as u64),
                TenantId(0),
                prompt(prompt_len, b, vocab),
                new,
            ))
            .unwrap()
        })
        .collect();
    let mut first = None;
    while !e.is_idle() {
        e.step();
        if first.is_none() && !handles[0].events().is_empty() {
            first = Some(t.elapsed());
        }
    }
    let elapsed = t.elapsed();
    let tokens: usize = handles.iter().map(|h| h.try_collect().0.len()).sum();
    (
        tokens as f64 / elapsed.as_secs_f64(),
        first.unwrap_or_default(),
    )
}

/// All cores, or `HANDOFF_BENCH_THREADS`.
fn backend() -> CpuBackend {
    match std::env::var("HANDOFF_BENCH_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        Some(n) => CpuBackend::with_threads(n),
        None => CpuBackend::new(),
    }
}

fn bench(w: ModelWeights, plan: &Plan) {
    // HANDOFF_BENCH_CASE=B runs only the decode case at batch B (for
    // profiling with perf).
    if std::env::var("HANDOFF_BENCH_ATTN").is_ok() {
        let m = Model::new(backend(), w).unwrap();
        // HANDOFF_BENCH_ATTN_SEQS=N: N sequences instead of 32 (fewer fit
        // in L2, which separates cache misses from arithmetic);
        // HANDOFF_BENCH_ATTN_CTX=N: N positions instead of 128 (separates
        // the per-call cost from the per-position one).
        let knob = |name: &str, default: usize| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(default)
        };
        let (seqs, ctx) = (
            knob("HANDOFF_BENCH_ATTN_SEQS", 32),
            knob("HANDOFF_BENCH_ATTN_CTX", 128),
        );
        // HANDOFF_BENCH_ATTN_DTYPE=f16|bf16|fp8: the KV dtype (default f32).
        let dtype = std::env::var("HANDOFF_BENCH_ATTN_DTYPE")
            .ok()
            .and_then(|v| KvDtype::parse(&v))
            .unwrap_or(KvDtype::F32);
        for _ in 0..20 {
            say(format!(
                "{:.2} ns per (position, head), {dtype:?} KV",
                attention_ns(m.config(), seqs, ctx, dtype)
            ));
        }
        return;
    }
    if let Some(b) = std::env::var("HANDOFF_BENCH_CASE")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        let m = Model::new(backend(), w).unwrap();
        let r = decode_rate(&m, b, plan.prompt_len, plan.steps, (plan.reps)(b));
        say(format!(
            "{}: decode batch {b}: {:.1} tokens/s wall, {:.1} per CPU-second",
            plan.name, r.wall, r.cpu
        ));
        return;
    }
    // HANDOFF_BENCH_ENGINE=B runs only the engine case at batch B.
    if let Some(b) = std::env::var("HANDOFF_BENCH_ENGINE")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        let new = plan.engine_new.max(1);
        for _ in 0..5 {
            let (r, first) = engine_rate(&w, b, plan.prompt_len, new);
            say(format!(
                "{}: engine batch {b}: {r:.1} tokens/s end to end, first token after {first:.2?}",
                plan.name
            ));
        }
        return;
    }
    let c = w.config.clone();
    say(format!(
        "\n## {}: dim {}, hidden {}, {} layers, {}/{} heads of {}, vocab {}",
        plan.name,
        c.dim,
        c.hidden_dim,
        c.n_layers,
        c.n_heads,
        c.n_kv_heads,
        c.head_dim,
        c.vocab_size
    ));
    for &b in plan.engine_batches {
        let (r, first) = engine_rate(&w, b, plan.prompt_len, plan.engine_new);
        say(format!(
            "engine batch {b:>3}: {r:>10.1} tokens/s end to end ({} new tokens each, first token after {first:.2?})",
            plan.engine_new
        ));
    }
    let m = Model::new(backend(), w).unwrap();
    say(format!(
        "threads: {}, kernels: {:?}",
        m.backend().threads(),
        m.backend().isa()
    ));
    say(format!(
        "decode: {} steps per sequence after an {}-token prompt (contexts {}..{}), every batch size",
        plan.steps,
        plan.prompt_len,
        plan.prompt_len + 2,
        plan.prompt_len + plan.steps + 1
    ));
    let single = decode_rate(&m, 1, plan.prompt_len, plan.steps, (plan.reps)(1));
    say(format!(
        "decode batch   1: {:>10.1} tokens/s wall | {:>10.1} tokens per CPU-second",
        single.wall, single.cpu
    ));
    for &b in plan.batches {
        let r = decode_rate(&m, b, plan.prompt_len, plan.steps, (plan.reps)(b));
        say(format!(
            "decode batch {b:>3}: {:>10.1} tokens/s wall ({:.1}x single-stream) | {:>10.1} per CPU-second ({:.1}x)",
            r.wall,
            r.wall / single.wall,
            r.cpu,
            r.cpu / single.cpu
        ));
    }
    say(format!(
        "decode attention alone, 1 thread, 32 sequences x 128 positions: {:.2} ns per (position, head)",
        attention_ns(m.config(), 32, 128, KvDtype::F32)
    ));
    for &n in plan.ttft {
        say(format!(
            "time to first token, {n}-token prompt: {:.2?}",
            ttft(&m, n)
        ));
    }
}

fn main() {
    // `cargo bench` passes --bench; nothing to parse.
    // HANDOFF_BENCH_SAMPLING=only: the sampler's figures alone.
    if std::env::var("HANDOFF_BENCH_SAMPLING").as_deref() == Ok("only") {
        sampling_side_by_side();
        return;
    }
    if Path::new(STORIES).exists() {
        let w = load_llama2c(Path::new(STORIES)).unwrap();
        bench(
            w,
            &Plan {
                name: "stories260K",
                steps: 128,
                reps: |b| (64 / b).max(1),
                prompt_len: 8,
                batches: &[8, 32, 128],
                ttft: &[128, 512],
                engine_batches: &[1, 32],
                engine_new: 128,
            },
        );
    } else {
        say(format!("stories260K skipped: {STORIES} is absent"));
    }
    sampling_side_by_side();
    if std::env::var("HANDOFF_BENCH_BIG").as_deref() == Ok("0") {
        return;
    }
    let layers = std::env::var("HANDOFF_BENCH_LAYERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    let t = Instant::now();
    let w = random_weights(&ModelConfig::llama_3_2_1b_shape(layers), 1);
    say(format!(
        "\n(random Llama-3.2-1B-shaped weights, {layers} layers, made in {:.2?})",
        t.elapsed()
    ));
    storage_side_by_side(&w, layers);
    bench(
        w,
        &Plan {
            name: "Llama-3.2-1B shape (random weights)",
            steps: 3,
            reps: |b| if b <= 8 { 2 } else { 1 },
            prompt_len: 8,
            batches: &[8, 32, 128],
            ttft: &[128, 512],
            engine_batches: &[],
            engine_new: 0,
        },
    );
}

/// The same bf16 checkpoint (the random weights rounded to bf16) decoded
/// with its matrices kept as bf16 (the default) and widened to f32, in
/// alternating rounds: bf16 storage halves the bytes each step streams.
fn storage_side_by_side(w: &ModelWeights, layers: usize) {
    let mut w = w.clone();
    w.round_matrices_to_bf16();
    let compact = Model::new(backend().compact_weights(true), w.clone()).unwrap();
    let wide = Model::new(backend().compact_weights(false), w).unwrap();
    say(format!(
        "\n## Llama-3.2-1B shape as a bf16 checkpoint ({layers} layers): weights kept as bf16 ({:.2} GB) vs f32 ({:.2} GB), alternating",
        compact.weight_bytes() as f64 / 1e9,
        wide.weight_bytes() as f64 / 1e9
    ));
    for round in 0..2 {
        for b in [1, 8] {
            let c = decode_rate(&compact, b, 8, 3, 2);
            let f = decode_rate(&wide, b, 8, 3, 2);
            say(format!(
                "round {round}, decode batch {b}: bf16 {:.2} tokens/s wall ({:.2} per CPU-second) | f32 {:.2} ({:.2}) | bf16/f32 {:.2}x",
                c.wall,
                c.cpu,
                f.wall,
                f.cpu,
                c.wall / f.wall
            ));
        }
    }
}

/// Top-p sampling over a Llama 3 vocabulary (128,256 logits): the engine's
/// sampler against a full sort of the candidates (what it did before),
/// alternating, for a peaked distribution (a few likely tokens over a wide
/// tail, as a model's usually is) and a flat one.
fn sampling_side_by_side() {
    const VOCAB: usize = 128_256;
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut uniform = move || {
        seed = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut gauss = move || {
        let (a, b) = (uniform().max(1e-300), uniform());
        ((-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()) as f32
    };
    let peaked: Vec<f32> = (0..VOCAB)
        .map(|i| 2.0 * gauss() + if i % 20_011 == 7 { 14.0 } else { 0.0 })
        .collect();
    let flat: Vec<f32> = (0..VOCAB).map(|_| gauss()).collect();
    let params = SamplingParams {
        temperature: 0.7,
        top_k: None,
        top_p: Some(0.9),
        seed: 1,
        stop_ids: Vec::new(),
        logprobs: None,
    };
    say(format!(
        "\n## top-p sampling, vocabulary {VOCAB}, temperature 0.7, top_p 0.9 (alternating, 50 draws each)"
    ));
    for (name, logits) in [("peaked", &peaked), ("flat", &flat)] {
        for round in 0..2 {
            let mut sampler = Sampler::new(&params).unwrap();
            let t = Instant::now();
            for _ in 0..50 {
                std::hint::black_box(sampler.sample(logits).unwrap());
            }
            let ours = t.elapsed() / 50;
            let t = Instant::now();
            for _ in 0..50 {
                std::hint::black_box(full_sort_top_p(logits, 0.7, 0.9));
            }
            let sort = t.elapsed() / 50;
            say(format!(
                "{name}, round {round}: sampler {ours:.2?} per token, full sort {sort:.2?} ({:.1}x)",
                sort.as_secs_f64() / ours.as_secs_f64()
            ));
        }
    }
    batch_sampling(&peaked, &params);
}

/// A batch of 32 peaked rows (top-p 0.9, temperature 0.7, each its own
/// seed) through `Backend::sample`: one thread against all of them.
fn batch_sampling(peaked: &[f32], params: &SamplingParams) {
    use handoff::backend::Backend;
    use handoff::sampling::Draw;
    const ROWS: usize = 32;
    let vocab = peaked.len();
    let logits: Vec<f32> = (0..ROWS)
        .flat_map(|r| peaked.iter().map(move |&x| x + (r % 7) as f32 * 0.01))
        .collect();
    let draws: Vec<Draw> = (0..ROWS)
        .map(|r| Draw::new(params, 0x9e37_79b9_7f4a_7c15u64.wrapping_mul(r as u64 + 1)).unwrap())
        .collect();
    let (one, all) = (CpuBackend::with_threads(1), backend());
    let mut out = Vec::new();
    for round in 0..2 {
        let mut time = |b: &CpuBackend| {
            let t = Instant::now();
            for _ in 0..10 {
                b.sample(&logits, vocab, &draws, &mut out, &mut Vec::new())
                    .unwrap();
            }
            t.elapsed() / 10
        };
        let (t1, tn) = (time(&one), time(&all));
        say(format!(
            "batch {ROWS}, round {round}: {t1:.2?} per step on 1 thread, {tn:.2?} on {} ({:.1}x)",
            all.threads(),
            t1.as_secs_f64() / tn.as_secs_f64()
        ));
    }
    // The same step with every row asking for its log-probabilities and 5
    // alternatives, alternated with the plain step on all threads.
    let asking = SamplingParams {
        logprobs: Some(5),
        ..params.clone()
    };
    let lp_draws: Vec<Draw> = (0..ROWS)
        .map(|r| Draw::new(&asking, 0x9e37_79b9_7f4a_7c15u64.wrapping_mul(r as u64 + 1)).unwrap())
        .collect();
    let mut lps = Vec::new();
    for round in 0..2 {
        let mut time = |d: &[Draw]| {
            let t = Instant::now();
            for _ in 0..10 {
                all.sample(&logits, vocab, d, &mut out, &mut lps).unwrap();
            }
            t.elapsed() / 10
        };
        let (plain, with) = (time(&draws), time(&lp_draws));
        say(format!(
            "batch {ROWS} on {} threads, round {round}: {plain:.2?} per step, {with:.2?} with \
             logprobs (5 alternatives) ({:.2}x)",
            all.threads(),
            with.as_secs_f64() / plain.as_secs_f64()
        ));
    }
}

/// The nucleus by sorting every candidate: its size.
fn full_sort_top_p(logits: &[f32], t: f32, p: f64) -> usize {
    let mut cand: Vec<(f32, u32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (l, i as u32))
        .collect();
    cand.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let max = cand[0].0;
    let w: Vec<f32> = cand.iter().map(|c| ((c.0 - max) / t).exp()).collect();
    let total: f64 = w.iter().map(|&x| x as f64).sum();
    let mut acc = 0f64;
    w.iter()
        .position(|&x| {
            acc += x as f64 / total;
            acc >= p
        })
        .map_or(cand.len(), |i| i + 1)
}
