//! How the cost grows with the context: SmolLM2-135M-Instruct Q4_1 (GGUF)
//! on the CPU, `HANDOFF_BENCH_THREADS` threads (default 2), per KV dtype:
//!
//! - decode tokens/s of one stream after 0, 1k, 2k, 4k and 8k tokens of
//!   context (`HANDOFF_BENCH_STEPS` greedy steps, default 64, timed after
//!   the context is prefilled);
//! - prefill tokens/s of prompts of 512, 2k, 4k and 8k tokens, fed in
//!   chunks of `HANDOFF_BENCH_CHUNK` tokens (default: the scheduler's
//!   `BatchLimits::max_prefill_tokens`, the chunk the engine takes of a
//!   lone long prompt).
//!
//! With `LLAMA_CPP_BIN` (the folder holding `llama-bench`, built outside
//! the repo), llama.cpp's figures for the same points on the same file
//! (`llama-bench -p N -n 0` and `-p 0 -n STEPS -d N`, with the same KV
//! dtype through `-ctk`/`-ctv`; f16 is its default), taken in
//! `HANDOFF_BENCH_PAIRS` (default 1) alternated pairs whose medians are
//! shown, and the line
//! `long_context: decode_ratio_8k=R1 prefill_ratio_8k=R2`: handoff with
//! its default KV dtype (`HANDOFF_BENCH_DEFAULT_KV`, default f16, what
//! `generate` uses) over llama.cpp with its default (f16).
//!
//! Subsets, so that a run fits in minutes: `HANDOFF_BENCH_KV` (dtypes,
//! default `f32,f16,bf16`; `fp8` too), `HANDOFF_BENCH_DEPTHS` (default
//! `0,1024,2048,4096,8192`), `HANDOFF_BENCH_PROMPTS` (default
//! `512,2048,4096,8192`); an empty list skips that curve.
//!
//! ```sh
//! HANDOFF_BENCH_KV=f16 HANDOFF_BENCH_DEPTHS=0,8192 HANDOFF_BENCH_PROMPTS=8192 \
//!   LLAMA_CPP_BIN=/path/to/llama.cpp/build/bin cargo bench --bench long_context
//! ```

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use handoff::backend::{CpuBackend, Isa};
use handoff::model::Model;
use handoff::sampling::argmax;
use handoff::{BatchLimits, KvDtype, KvPool, PoolConfig, RequestId};

#[path = "support/llama_cpp.rs"]
mod llama_cpp;
use llama_cpp::{llama_bench, median, ratio};

const MODEL: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/models/SmolLM2-135M-Instruct.Q4_1.gguf"
);

/// The context of the line's ratios.
const RATIO_AT: usize = 8192;

fn say(s: String) {
    let _ = writeln!(std::io::stdout(), "{s}");
}

fn knob(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A comma-separated list of token counts (`default` when unset).
fn counts(name: &str, default: &[usize]) -> Vec<usize> {
    match std::env::var(name) {
        Ok(v) => v.split(',').filter_map(|x| x.trim().parse().ok()).collect(),
        Err(_) => default.to_vec(),
    }
}

fn prompt(len: usize, vocab: usize) -> Vec<u32> {
    (0..len).map(|j| ((j * 17 + 3) % vocab) as u32).collect()
}

/// One point of handoff's curves: a prompt of `len` tokens (at least one)
/// prefilled in chunks of `chunk` (prefill tokens/s), then, when `steps`
/// is given, that many greedy decode steps (decode tokens/s).
fn handoff_point(
    m: &Model,
    dtype: KvDtype,
    len: usize,
    chunk: usize,
    steps: Option<usize>,
) -> (f64, Option<f64>) {
    const PAGE: usize = 16;
    let len = len.max(1);
    let total = len + steps.unwrap_or(0) + 1;
    let pool = KvPool::new(PoolConfig::new(
        m.kv_geometry(dtype),
        PAGE,
        total.div_ceil(PAGE),
    ))
    .expect("a pool for the bench's sequence");
    let mut scratch = m.scratch();
    let p = prompt(len, m.config().vocab_size);
    let mut seq = pool
        .reserve(RequestId(1), total)
        .expect("pages for the bench's sequence");
    let started = Instant::now();
    let mut next = 0;
    for c in p.chunks(chunk.max(1)) {
        let logits = m
            .prefill(&mut scratch, &mut [&mut seq], &[c])
            .expect("prefill");
        next = argmax(logits.row(0)).expect("a token");
    }
    let prefill = len as f64 / started.elapsed().as_secs_f64();
    let decode = steps.map(|steps| {
        let mut seq = seq.seal(len).expect("a complete prompt");
        let started = Instant::now();
        for _ in 0..steps {
            let logits = m
                .decode(&mut scratch, &mut [&mut seq], &[next])
                .expect("decode");
            next = argmax(logits.row(0)).expect("a token");
        }
        steps as f64 / started.elapsed().as_secs_f64()
    });
    (prefill, decode)
}

/// `-ctk`/`-ctv` for llama-bench, or `None` where it has no such cache
/// type (fp8 e4m3).
fn llama_kv(dtype: KvDtype) -> Option<[&'static str; 4]> {
    match dtype {
        KvDtype::F32 => Some(["-ctk", "f32", "-ctv", "f32"]),
        KvDtype::F16 => Some(["-ctk", "f16", "-ctv", "f16"]),
        KvDtype::BF16 => Some(["-ctk", "bf16", "-ctv", "bf16"]),
        _ => None,
    }
}

/// llama.cpp's prefill tokens/s of a `len`-token prompt.
fn llama_prefill(bin: &Path, threads: usize, kv: [&str; 4], len: usize) -> Option<f64> {
    let p = len.to_string();
    let mut args = vec!["-p", &p, "-n", "0", "-r", "1"];
    args.extend(kv);
    llama_bench(bin, MODEL, threads, &args)
        .iter()
        .find(|r| r.n_prompt == len && r.n_gen == 0)
        .map(|r| r.avg_ts)
}

/// llama.cpp's decode tokens/s of `steps` tokens after `depth` tokens.
fn llama_decode(
    bin: &Path,
    threads: usize,
    kv: [&str; 4],
    depth: usize,
    steps: usize,
) -> Option<f64> {
    let (d, n) = (depth.to_string(), steps.to_string());
    let mut args = vec!["-p", "0", "-n", &n, "-d", &d, "-r", "1"];
    args.extend(kv);
    llama_bench(bin, MODEL, threads, &args)
        .iter()
        .find(|r| r.n_prompt == 0 && r.n_gen == steps)
        .map(|r| r.avg_ts)
}

/// Medians of one point: handoff's and llama.cpp's (when measured).
#[derive(Clone, Copy, Default)]
struct Figures {
    prefill: Option<(f64, Option<f64>)>,
    decode: Option<(f64, Option<f64>)>,
}

fn mid(v: &mut [f64]) -> Option<f64> {
    (!v.is_empty()).then(|| median(v))
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let path = PathBuf::from(MODEL);
    if !path.exists() {
        say(format!(
            "SKIP: {MODEL} is absent; run scripts/fetch-models.sh"
        ));
        return;
    }
    let threads = knob("HANDOFF_BENCH_THREADS", 2);
    let steps = knob("HANDOFF_BENCH_STEPS", 64).max(1);
    let chunk = knob(
        "HANDOFF_BENCH_CHUNK",
        BatchLimits::default().max_prefill_tokens,
    );
    let pairs = knob("HANDOFF_BENCH_PAIRS", 1).max(1);
    let depths = counts("HANDOFF_BENCH_DEPTHS", &[0, 1024, 2048, 4096, 8192]);
    let prompts = counts("HANDOFF_BENCH_PROMPTS", &[512, 2048, 4096, 8192]);
    let kv_list = std::env::var("HANDOFF_BENCH_KV").unwrap_or_else(|_| "f32,f16,bf16".into());
    let dtypes: Vec<KvDtype> = kv_list
        .split(',')
        .filter_map(|s| KvDtype::parse(s.trim()))
        .collect();
    let default_kv = std::env::var("HANDOFF_BENCH_DEFAULT_KV")
        .ok()
        .and_then(|s| KvDtype::parse(&s))
        .unwrap_or(KvDtype::F16);
    let bin = std::env::var_os("LLAMA_CPP_BIN").map(PathBuf::from);

    let m = match Model::load(CpuBackend::with_threads(threads), &path) {
        Ok(m) => m,
        Err(e) => {
            say(format!("SKIP: {MODEL} did not load: {e}"));
            return;
        }
    };
    say(format!(
        "long_context: SmolLM2-135M-Instruct Q4_1, {threads} threads, {:?}, decode {steps} steps, \
         prefill chunks of {chunk}, {pairs} pair(s) per point{}",
        Isa::detect(),
        if bin.is_some() {
            ", llama.cpp beside"
        } else {
            " (LLAMA_CPP_BIN unset: handoff only)"
        }
    ));
    // Warm up: page the weights in, grow the buffers.
    let _ = handoff_point(&m, KvDtype::F32, 64, chunk, Some(4));

    let mut points: Vec<usize> = depths.iter().chain(&prompts).copied().collect();
    points.sort_unstable();
    points.dedup();
    let mut all: BTreeMap<(String, usize), Figures> = BTreeMap::new();
    for &dtype in &dtypes {
        let kv = bin.as_ref().and_then(|_| llama_kv(dtype));
        say(format!(
            "{:<6} {:<16} {:>10} {:>10} {:>8}",
            "kv", "point", "handoff", "llama.cpp", "ratio"
        ));
        for (pi, &ctx) in points.iter().enumerate() {
            let (want_pp, want_tg) = (prompts.contains(&ctx), depths.contains(&ctx));
            let (mut hp, mut hd, mut lp, mut ld) = (vec![], vec![], vec![], vec![]);
            for pair in 0..pairs {
                let mut ours = || {
                    let (p, d) = handoff_point(&m, dtype, ctx, chunk, want_tg.then_some(steps));
                    if want_pp {
                        hp.push(p);
                    }
                    if let Some(d) = d {
                        hd.push(d);
                    }
                };
                let mut theirs = || {
                    if let (Some(b), Some(kv)) = (&bin, kv) {
                        if want_pp {
                            lp.extend(llama_prefill(b, threads, kv, ctx));
                        }
                        if want_tg {
                            ld.extend(llama_decode(b, threads, kv, ctx, steps));
                        }
                    }
                };
                // Each side goes first in every other pair.
                if (pi + pair) % 2 == 0 {
                    ours();
                    theirs();
                } else {
                    theirs();
                    ours();
                }
            }
            let f = Figures {
                prefill: mid(&mut hp).map(|h| (h, mid(&mut lp))),
                decode: mid(&mut hd).map(|h| (h, mid(&mut ld))),
            };
            let show = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.1}"));
            if let Some((h, l)) = f.decode {
                say(format!(
                    "{:<6} {:<16} {:>10.1} {:>10} {:>8}",
                    dtype.name(),
                    format!("decode @{ctx}"),
                    h,
                    show(l),
                    ratio(h, l)
                ));
            }
            if let Some((h, l)) = f.prefill {
                say(format!(
                    "{:<6} {:<16} {:>10.1} {:>10} {:>8}",
                    dtype.name(),
                    format!("prefill {ctx}"),
                    h,
                    show(l),
                    ratio(h, l)
                ));
            }
            all.insert((dtype.name().to_string(), ctx), f);
        }
    }

    // The line: handoff's default KV over llama.cpp's default (f16),
    // measured alone for llama.cpp when f16 was not in the list.
    let ours = all
        .get(&(default_kv.name().to_string(), RATIO_AT))
        .copied()
        .unwrap_or_default();
    let f16 = all
        .get(&(KvDtype::F16.name().to_string(), RATIO_AT))
        .copied()
        .unwrap_or_default();
    let theirs = |ours: Option<(f64, Option<f64>)>,
                  f16: Option<(f64, Option<f64>)>,
                  alone: &dyn Fn(&Path) -> Option<f64>| {
        f16.and_then(|(_, l)| l)
            .or_else(|| ours.and(bin.as_deref().and_then(alone)))
    };
    let kv16 = llama_kv(KvDtype::F16).unwrap_or_default();
    let tg = theirs(ours.decode, f16.decode, &|b| {
        llama_decode(b, threads, kv16, RATIO_AT, steps)
    });
    let pp = theirs(ours.prefill, f16.prefill, &|b| {
        llama_prefill(b, threads, kv16, RATIO_AT)
    });
    let r = |h: Option<(f64, Option<f64>)>, l: Option<f64>| match (h, l) {
        (Some((h, _)), Some(l)) => format!("{:.2}", h / l),
        _ => "-".to_string(),
    };
    say(format!(
        "long_context: decode_ratio_8k={} prefill_ratio_8k={} (handoff {} KV over llama.cpp f16 KV)",
        r(ours.decode, tg),
        r(ours.prefill, pp),
        default_kv.name()
    ));
}
