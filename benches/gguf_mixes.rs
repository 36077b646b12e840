//! GGUF storage mixes on the CPU backend, side by side in one run: the
//! Llama-3.2-1B shape (`HANDOFF_BENCH_LAYERS` layers, default 4; llama's
//! interleaved RoPE, which costs the same) written by `random_gguf` as
//! llama.cpp's Q4_K_M and Q5_K_M mixes (Q6_K for the embedding, which is the
//! tied output head, and the down projections), and all Q6_K, Q8_0, Q4_1,
//! Q4_0 and Q5_0, each loaded with `Model::load` so its matrices stay in
//! their blocks.
//!
//! Per mix: the bytes of its weights; single-stream and batch-8 decode
//! tokens/s (medians over `HANDOFF_BENCH_ROUNDS` rounds, default 3, the
//! mixes taking turns within each round so that the machine's drift falls
//! on all of them); the weight bytes streamed per second at batch 1; and
//! that rate over Q4_1's (`gguf_b1_bytes_rate_vs_q4_1_<mix>=X`: Q4_1 and
//! Q8_0 have the longest-tuned decode kernels, so 1.0 means a row of that
//! mix costs what a Q4_1 row of the same bytes costs).
//!
//! ```sh
//! cargo bench --bench gguf_mixes
//! ```

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use handoff::backend::CpuBackend;
use handoff::kv::{KvSeq, Ready};
use handoff::model::gguf::{GgmlType, random_gguf};
use handoff::model::{Model, ModelConfig, RopeScaling, RopeStyle};
use handoff::sampling::argmax;
use handoff::{KvDtype, KvPool, PoolConfig, RequestId};

fn say(s: String) {
    let _ = writeln!(std::io::stdout(), "{s}");
}

fn knob(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

type Mix = fn(&str) -> GgmlType;

/// The mixes, by the base names `random_gguf` passes.
const MIXES: [(&str, Mix); 7] = [
    ("q4_1", |_| GgmlType::Q4_1),
    ("q8_0", |_| GgmlType::Q8_0),
    ("q4_k_m", |name| match name {
        "token_embd" | "output" | "ffn_down" => GgmlType::Q6K,
        _ => GgmlType::Q4K,
    }),
    ("q5_k_m", |name| match name {
        "token_embd" | "output" | "ffn_down" => GgmlType::Q6K,
        _ => GgmlType::Q5K,
    }),
    ("q6_k", |_| GgmlType::Q6K),
    ("q4_0", |_| GgmlType::Q4_0),
    ("q5_0", |_| GgmlType::Q5_0),
];

const PROMPT: usize = 16;

/// Decode tokens/s of `batch` sequences stepping together for `steps`
/// greedy steps after a 16-token prompt each.
fn decode_rate(m: &Model, batch: usize, steps: usize) -> f64 {
    let pool = KvPool::new(PoolConfig::new(
        m.kv_geometry(KvDtype::F32),
        16,
        batch * (PROMPT + steps + 1).div_ceil(16),
    ))
    .expect("a pool for the bench's sequences");
    let mut scratch = m.scratch();
    let vocab = m.config().vocab_size;
    let prompts: Vec<Vec<u32>> = (0..batch)
        .map(|b| {
            (0..PROMPT)
                .map(|j| ((b * 131 + j * 17 + 1) % vocab) as u32)
                .collect()
        })
        .collect();
    let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let mut seqs: Vec<_> = (0..batch)
        .map(|b| {
            pool.reserve(RequestId(b as u64), PROMPT + steps + 1)
                .expect("room for every sequence")
        })
        .collect();
    let logits = {
        let mut r: Vec<_> = seqs.iter_mut().collect();
        m.prefill(&mut scratch, &mut r, &refs).expect("prefill")
    };
    let mut next: Vec<u32> = (0..batch)
        .map(|b| argmax(logits.row(b)).expect("finite logits"))
        .collect();
    let mut seqs: Vec<KvSeq<Ready>> = seqs
        .into_iter()
        .map(|s| s.seal(PROMPT).expect("sealed after its prompt"))
        .collect();
    let started = Instant::now();
    for _ in 0..steps {
        let mut r: Vec<_> = seqs.iter_mut().collect();
        let logits = m.decode(&mut scratch, &mut r, &next).expect("decode");
        next = (0..batch)
            .map(|b| argmax(logits.row(b)).expect("finite logits"))
            .collect();
    }
    (batch * steps) as f64 / started.elapsed().as_secs_f64()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let layers = knob("HANDOFF_BENCH_LAYERS", 4);
    let rounds = knob("HANDOFF_BENCH_ROUNDS", 3).max(1);
    let threads = knob(
        "HANDOFF_BENCH_THREADS",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
    );
    let cfg = ModelConfig {
        rope_style: RopeStyle::Interleaved,
        rope_scaling: RopeScaling::None,
        ..ModelConfig::llama_3_2_1b_shape(layers)
    };
    let dir = std::env::temp_dir().join(format!("handoff-gguf-mixes-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary folder");
    say(format!(
        "## GGUF mixes on the CPU ({threads} threads, {:?}): Llama-3.2-1B shape, {layers} layers, \
         random blocks\n",
        CpuBackend::with_threads(1).isa()
    ));
    let models: Vec<(&str, Model)> = MIXES
        .iter()
        .map(|&(name, mix)| {
            let path: PathBuf = dir.join(format!("{name}.gguf"));
            let bytes = random_gguf(&cfg, 1, mix).expect("the 1B shape as a GGUF");
            std::fs::write(&path, bytes).expect("writing the GGUF");
            // Each model its own backend (a backend owns its threads).
            let backend = CpuBackend::with_threads(threads);
            let m = Model::load(backend, &path).expect("loading the GGUF");
            let _ = std::fs::remove_file(&path);
            (name, m)
        })
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    let (mut b1, mut b8) = (vec![vec![]; MIXES.len()], vec![vec![]; MIXES.len()]);
    for round in 0..rounds {
        // Each round in the other order, so no mix always follows another.
        let order: Vec<usize> = if round % 2 == 0 {
            (0..models.len()).collect()
        } else {
            (0..models.len()).rev().collect()
        };
        for i in order {
            b1[i].push(decode_rate(&models[i].1, 1, 32));
            b8[i].push(decode_rate(&models[i].1, 8, 8));
        }
    }
    say("| mix | weights MB | decode tok/s, 1 stream | GB/s streamed | batch 8 tok/s |".into());
    say("|---|---:|---:|---:|---:|".into());
    let mut rates = Vec::new();
    for (i, (name, m)) in models.iter().enumerate() {
        let bytes = m.weight_bytes() as f64;
        let (t1, t8) = (median(&mut b1[i]), median(&mut b8[i]));
        rates.push(t1 * bytes);
        say(format!(
            "| {name} | {:.0} | {t1:.1} | {:.1} | {t8:.1} |",
            bytes / 1e6,
            t1 * bytes / 1e9
        ));
    }
    say(String::new());
    for ((name, _), r) in models.iter().zip(&rates).skip(1) {
        say(format!(
            "gguf_b1_bytes_rate_vs_q4_1_{name}={:.2}",
            r / rates[0]
        ));
    }
}
