//! End-to-end decode on the CUDA backend (prints figures; no timing
//! assertions). Without a GPU, or built without `--features cuda`, it prints
//! a SKIP line and exits 0.
//!
//! The model is the Llama-3.2-1B shape with random bf16 weights (random
//! values rounded to bf16, so they stay bf16 on the device) and all 16
//! layers (`HANDOFF_BENCH_LAYERS` for fewer), bf16 KV, page 16. Two ways to
//! run it, side by side in one run:
//!
//! - `device`: KV pages in device memory (`CudaBackend::device_kv`), each
//!   step ending in device sampling (`Model::decode_sampled`): only token
//!   ids come back, after one sync;
//! - `mirror`: the earlier path, a host pool mirrored to the device (every
//!   appended K/V row copied back) and logits copied to the host for argmax.
//!
//! Figures: decode tokens/s at batch 1, 8, 64 and 256 (B sequences
//! prefilled with an 8-token prompt, then 32 timed greedy steps); the
//! weight-bandwidth limit of batch 1 (weight bytes / device-to-device copy
//! bandwidth measured in this run) and the share of it reached
//! (`e2e_b1_weight_bw_share`); the host's CPU time per decode step at batch
//! 1 and 256 (the thread's run time from `/proc/thread-self/schedstat`,
//! with the context set to block, not spin, in a sync); time to first
//! token for 512- and 4,096-token prompts; decode at batch 1, 4 and 16
//! with the RMSNorms and the SwiGLU carried in the matmuls' launches (the
//! default; the norms up to 4 rows) and launched apart
//! (`carried_stages_speedup_b1`, `_b4`, `_b16`); decode at batch 1 after
//! 8k- and 32k-token prompts on the 8-warp decode kernel against the 4-warp
//! one (`wide_decode_speedup_b1_ctx8k`, `_ctx32k`); decode at batch 1, 8
//! and 64 with each step's pass replayed as one CUDA graph against queued
//! launch by launch (`cuda_graphs_speedup_b1`, `_b8`, `_b64`, and
//! `e2e_b1_weight_bw_share_graphs`); a 4,096-token prompt's KV written
//! into and read back from device pages in one staged pass per layer
//! through page-locked memory against a copy and a wait per page run, as
//! a transfer over TCP lands and sends it (`kv_staged_write_speedup`,
//! `kv_staged_read_speedup`); last, the same shape with f32 weights
//! (`e2e_b1_weight_bw_share_f32`) and as quantized GGUF files kept in their
//! ggml blocks, llama.cpp's Q4_K_M mix and Q8_0
//! (`e2e_b1_weight_bw_share_gguf_q4_k_m`, `_q8_0`), each against the
//! copy bandwidth over its own bytes.
//! `scripts/torch_decode_peer.py`
//! times the same shape in torch on the same GPU for the peer ratio.
#![cfg_attr(not(feature = "cuda"), allow(unused))]

#[cfg(not(feature = "cuda"))]
fn main() {
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "SKIP cuda_decode: built without --features cuda"
    );
}

#[cfg(feature = "cuda")]
fn main() {
    if let Err(e) = gpu::run() {
        eprintln!("cuda_decode: {e}");
        std::process::exit(1);
    }
}

#[cfg(feature = "cuda")]
mod gpu {
    use std::time::{Duration, Instant};

    use handoff::backend::Backend;
    use handoff::backend::cuda::{
        CudaBackend, CudaDevice, CudaPages, DecodeKernel, device_for_test,
    };
    use handoff::kv::{KvSeq, Ready};
    use handoff::model::gguf::{GgmlType, random_gguf};
    use handoff::model::{Model, ModelConfig, RopeScaling, RopeStyle, random_weights};
    use handoff::sampling::{Draw, argmax};
    use handoff::{KvDtype, KvGeometry, KvPool, PoolConfig, RequestId};

    type R<T> = Result<T, String>;

    const STEPS: usize = 32;
    const PROMPT: usize = 8;
    /// Tokens a prefill call takes of a long prompt.
    const PREFILL_CHUNK: usize = 4096;
    const BATCHES: [usize; 4] = [1, 8, 64, 256];

    /// The calling thread's CPU time so far (run time, ns, as the
    /// scheduler counts it).
    fn thread_cpu() -> Option<Duration> {
        let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
        s.split_whitespace()
            .next()?
            .parse()
            .ok()
            .map(Duration::from_nanos)
    }

    /// Device-to-device copy, (read + write) bytes / time, GB/s.
    fn copy_gbps(dev: &CudaDevice) -> R<f64> {
        let n = 1usize << 30;
        let src = dev.zeros::<u8>(n).map_err(|e| e.to_string())?;
        let mut dst = dev.zeros::<u8>(n).map_err(|e| e.to_string())?;
        let mut best = f64::MAX;
        for _ in 0..10 {
            dev.synchronize().map_err(|e| e.to_string())?;
            let t = Instant::now();
            dev.stream()
                .memcpy_dtod(&src, &mut dst)
                .map_err(|e| e.to_string())?;
            dev.synchronize().map_err(|e| e.to_string())?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        Ok(2.0 * n as f64 / best / 1e9)
    }

    /// One way of running the model.
    struct Way {
        model: Model<CudaBackend>,
        /// Device pools and device sampling, or the mirrored path.
        device: bool,
    }

    /// What one batch size measured.
    struct Decode {
        tokens_per_s: f64,
        host_us_per_step: Option<f64>,
        /// The tokens of the last step, one per sequence.
        last: Vec<u32>,
    }

    fn pool(w: &Way, tokens_each: usize, seqs: usize) -> R<KvPool> {
        let cfg = PoolConfig::new(
            w.model.kv_geometry(KvDtype::BF16),
            16,
            seqs * tokens_each.div_ceil(16),
        );
        if w.device {
            w.model.backend().new_pool(cfg)
        } else {
            KvPool::new(cfg)
        }
        .map_err(|e| e.to_string())
    }

    fn prompt(vocab: usize, len: usize, salt: usize) -> Vec<u32> {
        (0..len)
            .map(|j| ((salt * 131 + j * 17 + 1) % vocab) as u32)
            .collect()
    }

    fn decode(w: &Way, batch: usize) -> R<Decode> {
        decode_after(w, batch, PROMPT)
    }

    /// [`decode`] after prompts of `prompt_len` tokens (prefilled in chunks
    /// of `PREFILL_CHUNK`).
    fn decode_after(w: &Way, batch: usize, prompt_len: usize) -> R<Decode> {
        let m = &w.model;
        let vocab = m.config().vocab_size;
        let total = prompt_len + STEPS + 2;
        let pool = pool(w, total, batch)?;
        let mut s = m.scratch();
        let prompts: Vec<Vec<u32>> = (0..batch).map(|b| prompt(vocab, prompt_len, b)).collect();
        let mut filling = (0..batch)
            .map(|b| pool.reserve(RequestId(b as u64), total))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        let greedy = vec![Draw::greedy(); batch];
        let mut next = Vec::new();
        for at in (0..prompt_len).step_by(PREFILL_CHUNK) {
            let end = (at + PREFILL_CHUNK).min(prompt_len);
            let mut refs: Vec<_> = filling.iter_mut().collect();
            let ps: Vec<&[u32]> = prompts.iter().map(|p| &p[at..end]).collect();
            next = m
                .prefill_sampled(&mut s, &mut refs, &ps, &greedy)
                .map_err(|e| e.to_string())?
                .iter()
                .map(|t| t.clone().map_err(|e| e.to_string()))
                .collect::<R<_>>()?;
        }
        let mut seqs: Vec<KvSeq<Ready>> = filling
            .into_iter()
            .map(|f| f.seal(prompt_len).map_err(|e| e.error.to_string()))
            .collect::<R<_>>()?;
        let mut step = |seqs: &mut Vec<KvSeq<Ready>>, next: &mut Vec<u32>| -> R<()> {
            let mut refs: Vec<&mut KvSeq<Ready>> = seqs.iter_mut().collect();
            if w.device {
                let t = m
                    .decode_sampled(&mut s, &mut refs, next, &greedy)
                    .map_err(|e| e.to_string())?;
                for (n, t) in next.iter_mut().zip(t) {
                    *n = t.clone().map_err(|e| e.to_string())?;
                }
            } else {
                let l = m
                    .decode(&mut s, &mut refs, next)
                    .map_err(|e| e.to_string())?;
                for (i, n) in next.iter_mut().enumerate() {
                    *n = argmax(l.row(i)).map_err(|e| e.to_string())?;
                }
            }
            Ok(())
        };
        step(&mut seqs, &mut next)?; // warm-up: buffers grow once
        let (t, cpu) = (Instant::now(), thread_cpu());
        for _ in 0..STEPS {
            step(&mut seqs, &mut next)?;
        }
        let wall = t.elapsed();
        let host = cpu
            .zip(thread_cpu())
            .map(|(a, b)| (b - a).as_secs_f64() * 1e6 / STEPS as f64);
        Ok(Decode {
            tokens_per_s: (batch * STEPS) as f64 / wall.as_secs_f64(),
            host_us_per_step: host,
            last: next,
        })
    }

    fn ttft(w: &Way, n: usize) -> R<Duration> {
        let m = &w.model;
        let pool = pool(w, n + 1, 1)?;
        let p = prompt(m.config().vocab_size, n, 7);
        let mut s = m.scratch();
        let mut best = Duration::MAX;
        for _ in 0..3 {
            let mut seq = pool
                .reserve(RequestId(1), n + 1)
                .map_err(|e| e.to_string())?;
            let t = Instant::now();
            if w.device {
                let tok = m
                    .prefill_sampled(&mut s, &mut [&mut seq], &[&p], &[Draw::greedy()])
                    .map_err(|e| e.to_string())?;
                tok[0].clone().map_err(|e| e.to_string())?;
            } else {
                let l = m
                    .prefill(&mut s, &mut [&mut seq], &[&p])
                    .map_err(|e| e.to_string())?;
                argmax(l.row(0)).map_err(|e| e.to_string())?;
            }
            best = best.min(t.elapsed());
        }
        Ok(best)
    }

    pub fn run() -> R<()> {
        let Some(dev) = device_for_test("cuda_decode") else {
            return Ok(());
        };
        // Block in a sync instead of spinning, so that the thread's CPU time
        // is the host's own work.
        dev.stream()
            .context()
            .set_blocking_synchronize()
            .map_err(|e| e.to_string())?;
        let layers = std::env::var("HANDOFF_BENCH_LAYERS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(16);
        let t = Instant::now();
        // Random weights rounded to bf16 values, as a bf16 checkpoint's:
        // they stay bf16 on the device and run on tensor cores.
        let mut w = random_weights(&ModelConfig::llama_3_2_1b_shape(layers), 1);
        w.round_matrices_to_bf16();
        let made = t.elapsed();
        let t = Instant::now();
        let place = |device: bool| -> R<Model<CudaBackend>> {
            Model::new(CudaBackend::new(dev.clone()).device_kv(device), w.clone())
                .map_err(|e| format!("placing the model: {e}"))
        };
        let ways = [
            Way {
                model: place(true)?,
                device: true,
            },
            Way {
                model: place(false)?,
                device: false,
            },
        ];
        let weight_bytes = ways[0].model.weight_bytes();
        let ways_geometry = ways[0].model.kv_geometry(KvDtype::BF16);
        println!(
            "## CUDA end to end on {}: Llama-3.2-1B shape, {layers} layers, random bf16 weights (made in \
             {made:.2?}, placed twice in {:.2?}), bf16 KV, page 16\n",
            dev.name(),
            t.elapsed()
        );
        let copy = copy_gbps(&dev)?;
        let limit = copy * 1e9 / weight_bytes as f64;
        println!(
            "device-to-device copy: {copy:.0} GB/s (read + write); weights as placed (bf16 \
             matrices, f32 norms): {:.2} GB; batch-1 weight-bandwidth limit: {limit:.0} tokens/s\n",
            weight_bytes as f64 / 1e9,
        );
        // A path no GPU has run yet must not cost the run its figures: the
        // norms and SwiGLU carried in the matmuls' launches, if they fail
        // or change a token, are turned off for the rest of the run.
        let backend = ways[0].model.backend();
        let probe = |on: bool| {
            backend.set_carried_stages(on);
            decode(&ways[0], 4)
        };
        match (probe(false)?, probe(true)) {
            (apart, Ok(carried)) if apart.last == carried.last => {
                println!("carried stages: on (batch 4: the tokens of the stages launched apart)\n")
            }
            (_, Ok(_)) => {
                println!("carried_stages=WRONG (other tokens than launched apart): turned off\n");
                backend.set_carried_stages(false);
            }
            (_, Err(e)) => {
                println!("carried_stages=FAILED ({e}): turned off\n");
                backend.set_carried_stages(false);
            }
        }
        let carrying = backend.carries_stages();
        println!(
            "| batch | device tokens/s | mirror tokens/s | device / mirror | device host µs/step |"
        );
        println!("|---:|---:|---:|---:|---:|");
        let mut b1 = None;
        let mut host = Vec::new();
        for batch in BATCHES {
            let d = decode(&ways[0], batch)?;
            let m = decode(&ways[1], batch)?;
            println!(
                "| {batch} | {:.1} | {:.1} | {:.2} | {} |",
                d.tokens_per_s,
                m.tokens_per_s,
                d.tokens_per_s / m.tokens_per_s,
                d.host_us_per_step
                    .map_or("n/a".into(), |h| format!("{h:.0}"))
            );
            if batch == 1 {
                b1 = Some(d.tokens_per_s);
            }
            if batch == 64 {
                println!("e2e_b64_tokens_per_s={:.1}", d.tokens_per_s);
            }
            if let Some(h) = d.host_us_per_step {
                host.push((batch, h, 1e6 * batch as f64 / d.tokens_per_s));
            }
        }
        println!();
        for (batch, h, step_us) in host {
            if batch == 1 || batch == 256 {
                println!(
                    "host_us_per_step_b{batch}={h:.0} (step {step_us:.0} µs wall: host share {:.2})",
                    h / step_us
                );
            }
        }
        if let Some(b1) = b1 {
            println!(
                "e2e_b1_weight_bw_share={:.3} ({b1:.1} tokens/s of a {limit:.0} tokens/s limit)",
                b1 / limit
            );
        }
        println!();
        // Each step's pass replayed as one CUDA graph against queued launch
        // by launch, on the device way. Written before any GPU ran it: a
        // failure, a refusal or other tokens cost these lines only, and
        // graphs stay off for the rest of the run.
        dev.set_graphs(false);
        let eager = decode(&ways[0], 4)?;
        dev.set_graphs(true);
        let graphed = decode(&ways[0], 4);
        let refused = !dev.graphs();
        dev.set_graphs(false);
        let graphs_ok = match graphed {
            Ok(g) if !refused && g.last == eager.last => {
                let (replays, captures) = dev.graph_counts();
                println!(
                    "cuda graphs: batch 4 gives the tokens of launch by launch ({replays} graph launches, {captures} captures)\n"
                );
                true
            }
            Ok(_) if refused => {
                println!("cuda_graphs=REFUSED (the driver refused a capture or a launch)\n");
                false
            }
            Ok(_) => {
                println!("cuda_graphs=WRONG (other tokens than launch by launch)\n");
                false
            }
            Err(e) => {
                println!("cuda_graphs=FAILED ({e})\n");
                false
            }
        };
        for batch in if graphs_ok { &[1usize, 8, 64][..] } else { &[] } {
            let eager = decode(&ways[0], *batch)?;
            dev.set_graphs(true);
            let before = dev.graph_counts().0;
            let graphed = decode(&ways[0], *batch);
            let replays = dev.graph_counts().0 - before;
            dev.set_graphs(false);
            let graphed = graphed?;
            let host = |d: &Decode| {
                d.host_us_per_step
                    .map_or("n/a".into(), |h| format!("{h:.0}"))
            };
            println!(
                "cuda_graphs_speedup_b{batch}={:.3} ({:.1} tokens/s as graphs, {:.1} launch by launch; host µs/step {} vs {}; {replays} graph launches in {} steps)",
                graphed.tokens_per_s / eager.tokens_per_s,
                graphed.tokens_per_s,
                eager.tokens_per_s,
                host(&graphed),
                host(&eager),
                STEPS + 1
            );
            if *batch == 1 {
                println!(
                    "e2e_b1_weight_bw_share_graphs={:.3} ({:.1} tokens/s of a {limit:.0} tokens/s \
                     limit)",
                    graphed.tokens_per_s / limit,
                    graphed.tokens_per_s
                );
            }
        }
        println!();
        // The norms and the SwiGLU carried in the matmuls' launches (the
        // default: at batch 1, 6 launches a decode layer) against launched
        // apart (9), one after the other on the device way.
        let batches: &[usize] = if carrying { &[1, 4, 16] } else { &[] };
        for &batch in batches {
            backend.set_carried_stages(false);
            let apart = decode(&ways[0], batch);
            backend.set_carried_stages(true);
            let (apart, carried) = (apart?, decode(&ways[0], batch)?);
            let host = |d: &Decode| {
                d.host_us_per_step
                    .map_or("n/a".into(), |h| format!("{h:.0}"))
            };
            println!(
                "carried_stages_speedup_b{batch}={:.3} ({:.1} tokens/s carried, {:.1} apart; host \
                 µs/step {} vs {})",
                carried.tokens_per_s / apart.tokens_per_s,
                carried.tokens_per_s,
                apart.tokens_per_s,
                host(&carried),
                host(&apart)
            );
        }
        println!();
        // The 8-warp decode kernel for the whole model against the 4-warp one
        // (what Auto runs), at batch 1 after long prompts, where a block per
        // SM or fewer walks a long chunk. A failure costs this line only.
        for ctx in [8192usize, 32768] {
            let timed = |k: DecodeKernel| {
                backend.set_decode_kernel(k);
                decode_after(&ways[0], 1, ctx)
            };
            let (narrow, wide) = (
                timed(DecodeKernel::Auto),
                timed(DecodeKernel::TensorCoreWide),
            );
            backend.set_decode_kernel(DecodeKernel::Auto);
            match (narrow, wide) {
                (Ok(n), Ok(w)) => println!(
                    "wide_decode_speedup_b1_ctx{}k={:.3} ({:.1} tokens/s with 8 warps, {:.1} with 4)",
                    ctx / 1024,
                    w.tokens_per_s / n.tokens_per_s,
                    w.tokens_per_s,
                    n.tokens_per_s
                ),
                (n, w) => println!(
                    "wide_decode_b1_ctx{}k=FAILED (4 warps: {}; 8 warps: {})",
                    ctx / 1024,
                    n.err().map_or("ok".into(), |e| e.to_string()),
                    w.err().map_or("ok".into(), |e| e.to_string())
                ),
            }
        }
        println!();
        for n in [512usize, 4096] {
            println!(
                "time to first token, {n}-token prompt: device {:.2?}, mirror {:.2?}",
                ttft(&ways[0], n)?,
                ttft(&ways[1], n)?
            );
        }
        println!();
        drop(ways);
        if let Err(e) = staging(&dev, ways_geometry) {
            println!("kv_staged=FAILED ({e})");
        }
        // Last: a run cut short by its timeout loses this figure only.
        println!();
        if let Err(e) = f32_weights(&dev, layers, copy) {
            println!("e2e_f32=FAILED ({e})");
        }
        println!();
        for (name, ty) in GGUF_MIXES {
            if let Err(e) = gguf_weights(&dev, layers, copy, name, ty) {
                println!("e2e_gguf_{name}=FAILED ({e})");
            }
        }
        Ok(())
    }

    /// GGUF storage mixes, by the base names `random_gguf` passes: llama.cpp's
    /// Q4_K_M (Q6_K for the embedding, which is the tied output head, and the
    /// down projections; Q4_K elsewhere) and Q8_0 throughout.
    type Mix = fn(&str) -> GgmlType;
    const GGUF_MIXES: [(&str, Mix); 2] = [
        ("q4_k_m", |name| match name {
            "token_embd" | "output" | "ffn_down" => GgmlType::Q6K,
            _ => GgmlType::Q4K,
        }),
        ("q8_0", |_| GgmlType::Q8_0),
    ];

    /// The same shape as a quantized GGUF file (random blocks,
    /// `random_gguf`; llama's interleaved RoPE without Llama 3 scaling,
    /// which costs the same) loaded with `Model::load`: its matrices stay in
    /// ggml blocks on the device (cuda/linear_f32.cuh's `QRows`), so the
    /// batch-1 limit is the copy bandwidth over the blocks' bytes. Prints
    /// `e2e_b1_weight_bw_share_gguf_<mix>=X`.
    fn gguf_weights(dev: &CudaDevice, layers: usize, copy: f64, name: &str, mix: Mix) -> R<()> {
        let cfg = ModelConfig {
            rope_style: RopeStyle::Interleaved,
            rope_scaling: RopeScaling::None,
            ..ModelConfig::llama_3_2_1b_shape(layers)
        };
        let t = Instant::now();
        let bytes = random_gguf(&cfg, 1, mix).map_err(|e| e.to_string())?;
        let dir = std::env::temp_dir().join(format!("handoff-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let path = dir.join(format!("{name}.gguf"));
        let written = std::fs::write(&path, &bytes);
        let file_bytes = bytes.len();
        drop(bytes);
        let loaded = written.map_err(|e| e.to_string()).and_then(|()| {
            Model::load(CudaBackend::new(dev.clone()).device_kv(true), &path)
                .map_err(|e| format!("loading the {name} file: {e}"))
        });
        let _ = std::fs::remove_dir_all(&dir);
        let way = Way {
            model: loaded?,
            device: true,
        };
        let bytes = way.model.weight_bytes();
        let limit = copy * 1e9 / bytes as f64;
        println!(
            "GGUF {name} ({:.2} GB file, {:.2} GB as placed, made and loaded in {:.2?}; batch-1 \
             limit {limit:.0} tokens/s):",
            file_bytes as f64 / 1e9,
            bytes as f64 / 1e9,
            t.elapsed()
        );
        for batch in [1usize, 8] {
            let d = decode(&way, batch)?;
            println!("| {batch} | {:.1} tokens/s |", d.tokens_per_s);
            if batch == 1 {
                println!(
                    "e2e_b1_weight_bw_share_gguf_{name}={:.3} ({:.1} tokens/s of a {limit:.0} \
                     tokens/s limit)",
                    d.tokens_per_s / limit,
                    d.tokens_per_s
                );
            }
        }
        Ok(())
    }

    /// The same model with f32 weights (an f32 checkpoint, or a quantized
    /// GGUF widened exactly to f32): the SIMT matmul (cuda/linear_f32.cuh)
    /// streams twice bf16's bytes, so its limit is half as many tokens/s.
    /// Prints `e2e_b1_weight_bw_share_f32=X` against that limit.
    fn f32_weights(dev: &CudaDevice, layers: usize, copy: f64) -> R<()> {
        let w = random_weights(&ModelConfig::llama_3_2_1b_shape(layers), 1);
        let way = Way {
            model: Model::new(CudaBackend::new(dev.clone()).device_kv(true), w)
                .map_err(|e| format!("placing the f32 model: {e}"))?,
            device: true,
        };
        let bytes = way.model.weight_bytes();
        let limit = copy * 1e9 / bytes as f64;
        println!(
            "f32 weights ({:.2} GB as placed; batch-1 limit {limit:.0} tokens/s):",
            bytes as f64 / 1e9
        );
        for batch in [1usize, 8] {
            let d = decode(&way, batch)?;
            println!("| {batch} | {:.1} tokens/s |", d.tokens_per_s);
            if batch == 1 {
                println!(
                    "e2e_b1_weight_bw_share_f32={:.3} ({:.1} tokens/s of a {limit:.0} tokens/s limit)",
                    d.tokens_per_s / limit,
                    d.tokens_per_s
                );
            }
        }
        Ok(())
    }

    /// A 4,096-token prompt's KV (this model's geometry, bf16, page 16)
    /// written into device pages as a transfer over TCP lands it, and read
    /// back as the prefill end sends it: one staged pass per layer through
    /// page-locked memory (`DevicePages::write_runs`, `read_runs`) against
    /// a copy and a wait per page run (`write`, `read`), best of 3 each.
    fn staging(dev: &CudaDevice, g: KvGeometry) -> R<()> {
        use handoff::kv::DevicePages;
        let (ps, pages_n) = (16usize, 256usize);
        let cfg = PoolConfig::new(g, ps, pages_n);
        let pages = CudaPages::for_pool(dev, &cfg).map_err(|e| e.to_string())?;
        let run = ps * g.kv_dim() * g.dtype.size_bytes();
        // Per layer: K and V of every page, as a batch of a whole prompt
        // touches them.
        let layer_runs = |l: usize| -> Vec<(usize, usize)> {
            (0..pages_n)
                .flat_map(|p| (0..2).map(move |kv| (((p * g.n_layers + l) * 2 + kv) * run, run)))
                .collect()
        };
        let src: Vec<u8> = (0..run).map(|i| (i * 7 + 1) as u8).collect();
        let mut dst = vec![0u8; run];
        let total = (g.n_layers * pages_n * 2 * run) as f64;
        let best = |f: &mut dyn FnMut() -> R<()>| -> R<f64> {
            let mut t = f64::MAX;
            for _ in 0..3 {
                let start = Instant::now();
                f()?;
                t = t.min(start.elapsed().as_secs_f64());
            }
            Ok(total / t / 1e9)
        };
        let e = |e: handoff::kv::DeviceError| e.to_string();
        let write_runwise = best(&mut || {
            for l in 0..g.n_layers {
                for (at, _) in layer_runs(l) {
                    pages.write(at, &src).map_err(e)?;
                }
            }
            Ok(())
        })?;
        let write_staged = best(&mut || {
            for l in 0..g.n_layers {
                pages
                    .write_runs(&layer_runs(l), &mut |_, d| d.copy_from_slice(&src))
                    .map_err(e)?;
            }
            Ok(())
        })?;
        let read_runwise = best(&mut || {
            for l in 0..g.n_layers {
                for (at, _) in layer_runs(l) {
                    pages.read(at, &mut dst).map_err(e)?;
                }
            }
            Ok(())
        })?;
        let read_staged = best(&mut || {
            let mut sum = 0u64;
            for l in 0..g.n_layers {
                pages
                    .read_runs(&layer_runs(l), &mut |_, b| sum += u64::from(b[0]))
                    .map_err(e)?;
            }
            std::hint::black_box(sum);
            Ok(())
        })?;
        let mib = total / f64::from(1u32 << 20);
        println!(
            "kv_staged_write_speedup={:.2} ({write_staged:.1} GB/s in one pass per layer, \
             {write_runwise:.1} GB/s a run at a time; {mib:.0} MiB in runs of {} KiB)",
            write_staged / write_runwise,
            run / 1024
        );
        println!(
            "kv_staged_read_speedup={:.2} ({read_staged:.1} GB/s in one pass per layer, \
             {read_runwise:.1} GB/s a run at a time)",
            read_staged / read_runwise
        );
        Ok(())
    }
}
