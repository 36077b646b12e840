//! End-to-end decode on the CUDA backend (prints figures; no timing
//! assertions). Without a GPU, or built without `--features cuda`, it prints
//! a SKIP line and exits 0.
//!
//! The model is the Llama-3.2-1B shape with random weights and
//! `HANDOFF_BENCH_LAYERS` layers (default 4, as the CPU bench in
//! `benches/decode.rs`, so the two read side by side), bf16 KV, page 16.
//! Decode: B sequences prefilled with an 8-token prompt, then 32 timed
//! batched decode steps (greedy, argmax on the host), tokens per second of
//! wall time. Time to first token: prefill of a 128- and a 512-token prompt.
//! Host time counts: the backend keeps the host pool as the source of truth
//! and copies every appended K/V row back to it, which these figures include.
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
    use std::time::{Duration, Instant};

    use handoff::backend::cuda::{CudaBackend, device_for_test};
    use handoff::kv::{KvSeq, Ready};
    use handoff::model::{Model, ModelConfig, random_weights};
    use handoff::sampling::argmax;
    use handoff::{KvDtype, KvPool, PoolConfig, RequestId};

    let Some(dev) = device_for_test("cuda_decode") else {
        return;
    };
    let layers = std::env::var("HANDOFF_BENCH_LAYERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    let t = Instant::now();
    let w = random_weights(&ModelConfig::llama_3_2_1b_shape(layers), 1);
    let made = t.elapsed();
    let t = Instant::now();
    let m = match Model::new(CudaBackend::new(dev), w) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("cuda_decode: placing the model failed: {e}");
            std::process::exit(1);
        }
    };
    println!(
        "## CUDA end to end: Llama-3.2-1B shape, {layers} layers, random weights (made in {made:.2?}, \
         placed in {:.2?}), bf16 KV, page 16",
        t.elapsed()
    );
    let vocab = m.config().vocab_size;
    let prompt = |len: usize, salt: usize| -> Vec<u32> {
        (0..len)
            .map(|j| ((salt * 131 + j * 17 + 1) % vocab) as u32)
            .collect()
    };
    let steps: usize = 32;
    let prompt_len: usize = 8;
    let mut s = m.scratch();
    let mut single = None;
    for batch in [1usize, 8, 32, 128] {
        let total = prompt_len + steps + 2;
        let pool = KvPool::new(PoolConfig::new(
            m.kv_geometry(KvDtype::BF16),
            16,
            batch * total.div_ceil(16),
        ))
        .unwrap();
        let prompts: Vec<Vec<u32>> = (0..batch).map(|b| prompt(prompt_len, b)).collect();
        let mut filling: Vec<_> = (0..batch)
            .map(|b| pool.reserve(RequestId(b as u64), total).unwrap())
            .collect();
        let mut next: Vec<u32> = {
            let mut refs: Vec<_> = filling.iter_mut().collect();
            let ps: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
            let l = m.prefill(&mut s, &mut refs, &ps).unwrap();
            l.rows().map(|r| argmax(r).unwrap()).collect()
        };
        let mut seqs: Vec<KvSeq<Ready>> = filling
            .into_iter()
            .map(|f| f.seal(prompt_len).unwrap())
            .collect();
        let mut step = |seqs: &mut Vec<KvSeq<Ready>>, next: &mut Vec<u32>| {
            let mut refs: Vec<&mut KvSeq<Ready>> = seqs.iter_mut().collect();
            let l = m.decode(&mut s, &mut refs, next).unwrap();
            for (i, t) in next.iter_mut().enumerate() {
                *t = argmax(l.row(i)).unwrap();
            }
        };
        step(&mut seqs, &mut next); // warm-up: buffers grow once
        let t = Instant::now();
        for _ in 0..steps {
            step(&mut seqs, &mut next);
        }
        let rate = (batch * steps) as f64 / t.elapsed().as_secs_f64();
        let vs = match single {
            None => {
                single = Some(rate);
                String::new()
            }
            Some(one) => format!(" ({:.1}x single-stream)", rate / one),
        };
        println!("decode batch {batch:>3}: {rate:>10.1} tokens/s wall{vs}");
    }
    for n in [128usize, 512] {
        let pool = KvPool::new(PoolConfig::new(
            m.kv_geometry(KvDtype::BF16),
            16,
            n.div_ceil(16) + 1,
        ))
        .unwrap();
        let p = prompt(n, 7);
        let mut best = Duration::MAX;
        for _ in 0..3 {
            let mut seq = pool.reserve(RequestId(1), n + 1).unwrap();
            let t = Instant::now();
            let l = m.prefill(&mut s, &mut [&mut seq], &[&p]).unwrap();
            let _ = argmax(l.row(0)).unwrap();
            best = best.min(t.elapsed());
        }
        println!("time to first token, {n}-token prompt: {best:.2?}");
    }
}
