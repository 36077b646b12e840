//! llama.cpp's side of the GGUF benches: `llama-bench` run on the same
//! file, its CSV read back, and the helpers that set its figures beside
//! handoff's. Shared by `gguf_decode` and `long_context` (each includes
//! this file as a module).

// Each bench uses its own part of these helpers.
#![allow(dead_code)]

use std::path::Path;
use std::process::Command;

/// One row of `llama-bench -o csv`: the test's prompt, generated and
/// depth tokens, and its mean tokens/s.
#[derive(Clone, Copy, Debug)]
pub struct BenchRow {
    pub n_prompt: usize,
    pub n_gen: usize,
    pub n_depth: usize,
    pub avg_ts: f64,
}

/// Runs `llama-bench` (in the folder `bin`) on `model` with `threads`
/// threads and the extra arguments `args` (`-p`, `-n`, `-d`, `-r`,
/// `-ctk`, ...), and returns its rows; empty when it cannot run or prints
/// nothing readable.
pub fn llama_bench(bin: &Path, model: &str, threads: usize, args: &[&str]) -> Vec<BenchRow> {
    let t = threads.to_string();
    let out = Command::new(bin.join("llama-bench"))
        .args(["-m", model, "-t", &t, "-o", "csv"])
        .args(args)
        .output();
    let Ok(out) = out else {
        return Vec::new();
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let mut lines = text.lines();
    let Some(header) = lines.next() else {
        return Vec::new();
    };
    let cols: Vec<&str> = header.split(',').map(|c| c.trim_matches('"')).collect();
    let at = |name: &str| cols.iter().position(|c| *c == name);
    lines
        .filter_map(|line| {
            let f: Vec<&str> = line.split(',').map(|c| c.trim_matches('"')).collect();
            let get = |name: &str| {
                at(name)
                    .and_then(|i| f.get(i))
                    .and_then(|v| v.parse::<f64>().ok())
            };
            Some(BenchRow {
                n_prompt: get("n_prompt")? as usize,
                n_gen: get("n_gen")? as usize,
                // Older builds have no depth column: depth 0.
                n_depth: get("n_depth").unwrap_or(0.0) as usize,
                avg_ts: get("avg_ts")?,
            })
        })
        .collect()
}

/// llama-bench's (tg tok/s, pp tok/s) for a `p`-token prompt and `n`
/// generated tokens, `r` repetitions averaged (0 skips that test).
pub fn tg_pp(
    bin: &Path,
    model: &str,
    threads: usize,
    p: usize,
    n: usize,
    r: usize,
) -> (Option<f64>, Option<f64>) {
    let (p, n, r) = (p.to_string(), n.to_string(), r.to_string());
    let rows = llama_bench(bin, model, threads, &["-p", &p, "-n", &n, "-r", &r]);
    let tg = rows
        .iter()
        .find(|x| x.n_prompt == 0 && x.n_gen > 0)
        .map(|x| x.avg_ts);
    let pp = rows
        .iter()
        .find(|x| x.n_prompt > 0 && x.n_gen == 0)
        .map(|x| x.avg_ts);
    (tg, pp)
}

pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// `a / b` as `1.23x`, or `-` without `b`.
pub fn ratio(a: f64, b: Option<f64>) -> String {
    b.map_or_else(|| "-".to_string(), |b| format!("{:.2}x", a / b))
}
