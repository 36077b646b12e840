//! SmolLM2-135M-Instruct Q4_1 (GGUF, quantized matrices kept quantized) on
//! the CPU, 2 threads, figures printed side by side with llama.cpp on the
//! same file in the same run:
//!
//! - single-stream decode tokens/s (llama.cpp: `llama-bench` tg128), with
//!   llama.cpp also in `HANDOFF_BENCH_PAIRS` (default 5) alternated pairs,
//!   whose medians the table shows;
//! - aggregate decode tokens/s at batch 8 (llama.cpp: `llama-batched-bench`
//!   with 8 parallel sequences);
//! - time to first token for a 512-token prompt (llama.cpp: pp512);
//! - resident memory after loading, against the file size;
//! - with AVX-512, the AVX2 kernels' decode figures beside it.
//!
//! The model comes from `scripts/fetch-models.sh` (skipped when absent).
//! llama.cpp's binaries are found through `LLAMA_CPP_BIN` (the folder
//! holding `llama-bench` and `llama-batched-bench`, built outside the repo);
//! without it only handoff's figures are printed. `HANDOFF_BENCH_THREADS`
//! (default 2) sets both sides' threads.
//!
//! ```sh
//! scripts/fetch-models.sh
//! LLAMA_CPP_BIN=/path/to/llama.cpp/build/bin cargo bench --bench gguf_decode
//! ```

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use handoff::backend::{CpuBackend, Isa};
use handoff::kv::{KvSeq, Ready};
use handoff::model::Model;
use handoff::sampling::argmax;
use handoff::{KvDtype, KvPool, PoolConfig, RequestId};

#[path = "support/llama_cpp.rs"]
mod llama_cpp;
use llama_cpp::{median, ratio};

const MODEL: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/models/SmolLM2-135M-Instruct.Q4_1.gguf"
);

fn say(s: String) {
    let _ = writeln!(std::io::stdout(), "{s}");
}

/// A field of /proc/self/status (`VmRSS`, `VmHWM`), in bytes.
fn proc_status(field: &str) -> Option<usize> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with(field))?;
    let kb: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn prompt(len: usize, salt: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|j| ((salt * 131 + j * 17 + 1) % vocab) as u32)
        .collect()
}

/// Decode tokens/s of `batch` sequences stepping together for `steps`
/// steps after a 16-token prompt each.
fn decode_rate(m: &Model, batch: usize, steps: usize) -> f64 {
    let pool = KvPool::new(PoolConfig::new(m.kv_geometry(KvDtype::F32), 16, batch * 16)).unwrap();
    let mut scratch = m.scratch();
    let vocab = m.config().vocab_size;
    let prompts: Vec<Vec<u32>> = (0..batch).map(|i| prompt(16, i, vocab)).collect();
    let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let mut seqs: Vec<_> = (0..batch)
        .map(|i| pool.reserve(RequestId(i as u64), 16 + steps + 1).unwrap())
        .collect();
    let logits = {
        let mut r: Vec<_> = seqs.iter_mut().collect();
        m.prefill(&mut scratch, &mut r, &refs).unwrap()
    };
    let mut next: Vec<u32> = (0..batch).map(|i| argmax(logits.row(i)).unwrap()).collect();
    let mut seqs: Vec<KvSeq<Ready>> = seqs.into_iter().map(|s| s.seal(16).unwrap()).collect();
    let started = Instant::now();
    for _ in 0..steps {
        let mut r: Vec<_> = seqs.iter_mut().collect();
        let logits = m.decode(&mut scratch, &mut r, &next).unwrap();
        next = (0..batch).map(|i| argmax(logits.row(i)).unwrap()).collect();
    }
    (batch * steps) as f64 / started.elapsed().as_secs_f64()
}

/// Seconds from a 512-token prompt to its first token (best of `reps`).
fn ttft(m: &Model, len: usize, reps: usize) -> f64 {
    let pool = KvPool::new(PoolConfig::new(
        m.kv_geometry(KvDtype::F32),
        16,
        len / 16 + 2,
    ))
    .unwrap();
    let mut scratch = m.scratch();
    let p = prompt(len, 3, m.config().vocab_size);
    (0..reps)
        .map(|_| {
            let mut seq = pool.reserve(RequestId(1), len).unwrap();
            let started = Instant::now();
            let logits = m.prefill(&mut scratch, &mut [&mut seq], &[&p]).unwrap();
            let _ = argmax(logits.row(0)).unwrap();
            started.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// llama.cpp's figures: (tg128 tok/s, pp512 tok/s) from llama-bench, and
/// batch-8 aggregate decode tok/s from llama-batched-bench.
struct Llama {
    tg: Option<f64>,
    pp: Option<f64>,
    batch8: Option<f64>,
}

/// llama-bench's (tg tok/s, pp tok/s) on this model (see
/// `llama_cpp::tg_pp`).
fn llama_bench(
    bin: &Path,
    threads: usize,
    p: usize,
    n: usize,
    r: usize,
) -> (Option<f64>, Option<f64>) {
    llama_cpp::tg_pp(bin, MODEL, threads, p, n, r)
}

fn llama_cpp(bin: &Path, threads: usize) -> Llama {
    let t = threads.to_string();
    let (tg, pp) = llama_bench(bin, threads, 512, 128, 3);
    // llama-batched-bench prints a table row per (pp, tg, b):
    // | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    let batched = Command::new(bin.join("llama-batched-bench"))
        .args([
            "-m", MODEL, "-t", &t, "-c", "4096", "-npp", "16", "-ntg", "64", "-npl", "8",
        ])
        .output();
    let batch8 = batched.ok().and_then(|out| {
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.lines().find_map(|l| {
            let f: Vec<&str> = l
                .split('|')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .collect();
            (f.len() >= 8 && f[2] == "8")
                .then(|| f[7].parse::<f64>().ok())
                .flatten()
        })
    });
    Llama { tg, pp, batch8 }
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
    let threads: usize = std::env::var("HANDOFF_BENCH_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let file = std::fs::metadata(&path)
        .map(|m| m.len() as usize)
        .unwrap_or(0);
    let rss_before = proc_status("VmRSS").unwrap_or(0);
    let loaded = Instant::now();
    let m = Model::load(CpuBackend::with_threads(threads), &path).unwrap();
    let load_s = loaded.elapsed().as_secs_f64();
    let rss = proc_status("VmRSS").unwrap_or(0).saturating_sub(rss_before);
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    say(format!(
        "SmolLM2-135M-Instruct Q4_1, {threads} threads, {:?}; loaded in {load_s:.2} s; file {:.1} MiB, \
         weights held {:.1} MiB, resident after load +{:.1} MiB (peak {:.1} MiB)",
        Isa::detect(),
        mib(file),
        mib(m.weight_bytes()),
        mib(rss),
        mib(proc_status("VmHWM").unwrap_or(0)),
    ));

    // Warm up (page in, grow buffers), then measure. `HANDOFF_BENCH_ONLY=decode`
    // (or `batch8`, `prefill`) runs one figure alone, for a profiler.
    let only = std::env::var("HANDOFF_BENCH_ONLY").unwrap_or_default();
    let run = |name: &str| only.is_empty() || only == name;
    // With AVX-512, the AVX2 kernels' decode figures too, measured in turn
    // with the AVX-512 ones (same bits, so the same tokens).
    let avx2 = (Isa::detect() == Isa::Avx512)
        .then(|| CpuBackend::with_isa(threads, Isa::Avx2Fma).ok())
        .flatten()
        .and_then(|b| Model::load(b, &path).ok());
    let _ = decode_rate(&m, 1, 8);
    let (mut single, mut batch8) = (f64::NAN, f64::NAN);
    let (mut single2, mut batch82) = (f64::NAN, f64::NAN);
    if run("decode") {
        single = decode_rate(&m, 1, 128);
        if let Some(a) = &avx2 {
            single2 = decode_rate(a, 1, 128);
        }
    }
    if run("batch8") {
        batch8 = decode_rate(&m, 8, 64);
        if let Some(a) = &avx2 {
            batch82 = decode_rate(a, 8, 64);
        }
    }
    let t512 = if run("prefill") {
        ttft(&m, 512, 3)
    } else {
        f64::NAN
    };

    let bin = std::env::var_os("LLAMA_CPP_BIN").map(PathBuf::from);
    let llama = bin.as_deref().map(|b| llama_cpp(b, threads));
    let mut l = llama.unwrap_or(Llama {
        tg: None,
        pp: None,
        batch8: None,
    });
    // Single-stream decode is memory-bound on both sides and this machine's
    // bandwidth drifts between two figures taken a minute apart, so it is
    // also measured in alternated pairs (handoff and llama-bench tg128 once
    // each, taking turns at going first), and the table shows the pairs' medians.
    let pairs: usize = std::env::var("HANDOFF_BENCH_PAIRS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let mut table_single = single;
    if let (Some(b), true) = (&bin, run("decode") && pairs > 0) {
        let (mut ours, mut theirs, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..pairs {
            // Each side goes first in every other pair.
            let (h, t) = if i % 2 == 0 {
                let h = decode_rate(&m, 1, 128);
                (h, llama_bench(b, threads, 0, 128, 1).0)
            } else {
                let t = llama_bench(b, threads, 0, 128, 1).0;
                (decode_rate(&m, 1, 128), t)
            };
            if let Some(t) = t {
                ours.push(h);
                theirs.push(t);
                ratios.push(h / t);
            }
        }
        if !ratios.is_empty() {
            let list: Vec<String> = ratios.iter().map(|r| format!("{r:.2}")).collect();
            say(format!(
                "decode 1 stream, {} alternated pairs: handoff / llama.cpp ratios [{}], median {:.2}x",
                ratios.len(),
                list.join(", "),
                median(&mut ratios.clone())
            ));
            table_single = median(&mut ours);
            l.tg = Some(median(&mut theirs));
        }
    }
    let show = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.1}"));
    say(format!(
        "{:<34} {:>10} {:>10} {:>8}",
        "figure", "handoff", "llama.cpp", "ratio"
    ));
    say(format!(
        "{:<34} {:>10.1} {:>10} {:>8}",
        "decode tok/s, 1 stream",
        table_single,
        show(l.tg),
        ratio(table_single, l.tg)
    ));
    say(format!(
        "{:<34} {:>10.1} {:>10} {:>8}",
        "decode tok/s, batch 8 aggregate",
        batch8,
        show(l.batch8),
        ratio(batch8, l.batch8)
    ));
    let pp = 512.0 / t512;
    say(format!(
        "{:<34} {:>10.1} {:>10} {:>8}",
        "prefill tok/s, 512-token prompt",
        pp,
        show(l.pp),
        ratio(pp, l.pp)
    ));
    say(format!(
        "{:<34} {:>10.0} {:>10} {:>8}",
        "time to first token, 512 (ms)",
        t512 * 1e3,
        l.pp.map_or_else(|| "-".to_string(), |p| format!("{:.0}", 512.0 / p * 1e3)),
        ""
    ));
    if avx2.is_some() {
        say(format!(
            "AVX-512 / AVX2 kernels, same run: decode 1 stream {single:.1} / {single2:.1} \
             ({:.2}x), batch 8 {batch8:.1} / {batch82:.1} ({:.2}x)",
            single / single2,
            batch8 / batch82
        ));
    }
}
