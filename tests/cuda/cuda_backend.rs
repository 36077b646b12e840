//! The whole forward pass on the GPU, against the CPU backend.
//!
//! 1. stories260K (a real trained llama2.c model, GQA 8:4, head_dim 8)
//!    decodes greedily to the same tokens on the CUDA backend as on the CPU
//!    backend, alone and batched with another sequence, at page sizes 1 and
//!    16.
//! 2. In poison mode, a workload with cancelled requests, refused requests
//!    and abandoned half-written KV reuses their pages for new requests; no
//!    logit of any request is ever NaN (a stale read on the device would
//!    read the poison the freed pages were filled with), the uninterrupted
//!    request generates exactly what it generates alone, and the pool is
//!    full again at the end.
//! 3. A random model of real checkpoints' shapes (GQA 4:1, head_dim 64 and
//!    128, bf16 KV, Llama 3 RoPE scaling) gives the CPU's logits within
//!    bf16 tolerance at every prefill and decode step, and the 8-warp decode
//!    kernel, chosen for the model, the 4-warp kernel's.
//!
//! 4. With CUDA graphs on, decode steps on device-resident pages replay as
//!    one graph each once seen twice, with the logits of graphs off bit for
//!    bit, at two batch sizes; a step still waits for the device once.
//!
//! Skips (printing SKIP) without a GPU or without the shared model file.
#![cfg(feature = "cuda")]

use std::io::Write;
use std::path::PathBuf;

use handoff::backend::cuda::{CudaBackend, CudaPages, DecodeKernel, device_for_test};
use handoff::kv::{Filling, KvSeq, Ready};
use handoff::model::{ForwardError, Model, ModelWeights, load_llama2c};
use handoff::sampling::argmax;
use handoff::{KvDtype, KvPool, PoolConfig, RequestId, ScrubPolicy};

const MODEL: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../shared/models/stories260K.bin"
);

/// The model's weights, or None after printing why the test skips. The GPU
/// bundle sets HANDOFF_STORIES260K to the copy it carries.
fn weights(test: &str) -> Option<ModelWeights> {
    let path = std::env::var_os("HANDOFF_STORIES260K")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(MODEL));
    if !path.exists() {
        // A GPU run that skipped every test would pass without checking anything.
        if std::env::var("HANDOFF_REQUIRE_GPU").is_ok_and(|v| v == "1") {
            panic!(
                "{test}: HANDOFF_REQUIRE_GPU=1 but {} is absent (the shared stories260K model)",
                path.display()
            );
        }
        let _ = writeln!(
            std::io::stderr(),
            "SKIP {test}: {} is absent (the shared stories260K model)",
            path.display()
        );
        return None;
    }
    Some(load_llama2c(&path).expect("stories260K loads"))
}

fn models(test: &str) -> Option<(Model, Model<CudaBackend>)> {
    let dev = device_for_test(test)?;
    let w = weights(test)?;
    let cpu = Model::cpu(w.clone()).expect("places on CPU");
    let gpu = Model::new(CudaBackend::new(dev), w).expect("places on the GPU");
    Some((cpu, gpu))
}

fn pool<B: handoff::backend::Backend>(
    m: &Model<B>,
    page_size: usize,
    pages: usize,
    scrub: ScrubPolicy,
) -> KvPool {
    KvPool::new(PoolConfig::new(m.kv_geometry(KvDtype::F32), page_size, pages).scrub(scrub))
        .unwrap()
}

/// Greedy generation of `steps` tokens for each prompt, all batched
/// together (prefill in one pass, then one decode pass per step). Every
/// logit seen is checked finite.
fn greedy<B: handoff::backend::Backend>(
    m: &Model<B>,
    pool: &KvPool,
    first_id: u64,
    prompts: &[&[u32]],
    steps: usize,
) -> Vec<Vec<u32>> {
    let mut scratch = m.scratch();
    let mut seqs: Vec<KvSeq<Filling>> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            pool.reserve(RequestId(first_id + i as u64), p.len() + steps)
                .unwrap()
        })
        .collect();
    let mut refs: Vec<&mut KvSeq<Filling>> = seqs.iter_mut().collect();
    let logits = m.prefill(&mut scratch, &mut refs, prompts).unwrap();
    let mut out: Vec<Vec<u32>> = logits
        .rows()
        .map(|r| {
            assert!(r.iter().all(|x| x.is_finite()), "NaN in prefill logits");
            vec![argmax(r).unwrap()]
        })
        .collect();
    let mut ready: Vec<KvSeq<Ready>> = seqs
        .into_iter()
        .zip(prompts)
        .map(|(s, p)| s.seal(p.len()).map_err(|e| e.error).unwrap())
        .collect();
    for _ in 1..steps {
        let last: Vec<u32> = out.iter().map(|o| *o.last().unwrap()).collect();
        let mut refs: Vec<&mut KvSeq<Ready>> = ready.iter_mut().collect();
        let logits = m.decode(&mut scratch, &mut refs, &last).unwrap();
        for (o, r) in out.iter_mut().zip(logits.rows()) {
            assert!(r.iter().all(|x| x.is_finite()), "NaN in decode logits");
            o.push(argmax(r).unwrap());
        }
    }
    out
}

/// Greedy tokens on the GPU equal the CPU's at page sizes 1 and 16, alone
/// and batched with a longer prompt (ragged prefill and decode), the
/// second run on pages the first released; `gpu_pool(page_size)` builds
/// the GPU's pool.
fn greedy_equals_cpu(cpu: &Model, gpu: &Model<CudaBackend>, gpu_pool: impl Fn(usize) -> KvPool) {
    let a: &[u32] = &[1];
    let b: &[u32] = &[
        1, 403, 407, 261, 378, 426, 271, 385, 280, 264, 280, 261, 300,
    ];
    for ps in [1, 16] {
        let (pc, pg) = (pool(cpu, ps, 4096 / ps, ScrubPolicy::Zero), gpu_pool(ps));
        let want = greedy(cpu, &pc, 1, &[a], 120);
        let got = greedy(gpu, &pg, 1, &[a], 120);
        let _ = writeln!(std::io::stderr(), "page {ps}: cpu {:?}", want[0]);
        assert_eq!(got, want, "page size {ps}: alone");
        let want = greedy(cpu, &pc, 10, &[a, b], 80);
        let got = greedy(gpu, &pg, 10, &[a, b], 80);
        assert_eq!(got, want, "page size {ps}: batched");
        assert!(pc.stats().is_full() && pg.stats().is_full());
    }
}

#[test]
fn stories260k_greedy_tokens_on_cuda_equal_the_cpu_backends() {
    let test = "stories260k_greedy_tokens_on_cuda_equal_the_cpu_backends";
    let Some((cpu, gpu)) = models(test) else {
        return;
    };
    greedy_equals_cpu(&cpu, &gpu, |ps| {
        pool(&gpu, ps, 4096 / ps, ScrubPolicy::Poison)
    });
}

/// The same with the GPU's pool device-resident (`CudaPages`): the append
/// kernel writes the pool's own pages, attention reads them there,
/// released pages are poisoned on the device, and no row is copied to the
/// host.
#[test]
fn stories260k_greedy_tokens_on_device_resident_pages_equal_the_cpu_backends() {
    let test = "stories260k_greedy_tokens_on_device_resident_pages_equal_the_cpu_backends";
    let Some((cpu, gpu)) = models(test) else {
        return;
    };
    greedy_equals_cpu(&cpu, &gpu, |ps| {
        let cfg = PoolConfig::new(gpu.kv_geometry(KvDtype::F32), ps, 4096 / ps)
            .scrub(ScrubPolicy::Poison);
        let pages = CudaPages::for_pool(gpu.backend().device(), &cfg).unwrap();
        KvPool::with_device_pages(cfg, Box::new(pages)).unwrap()
    });
}

#[test]
fn poison_mode_no_nan_reaches_logits_after_cancels_and_failures() {
    let test = "poison_mode_no_nan_reaches_logits_after_cancels_and_failures";
    let Some((cpu, gpu)) = models(test) else {
        return;
    };
    let gpu_pool = pool(&gpu, 16, 24, ScrubPolicy::Poison);
    no_nan_after_cancels_and_failures(&cpu, &gpu, gpu_pool);
}

/// The same with the pool's pages in device memory (`CudaPages`): the
/// poison is written on the device when a page is released, and the
/// kernels read the pool's own pages.
#[test]
fn poison_mode_on_device_resident_pages_no_nan_reaches_logits() {
    let test = "poison_mode_on_device_resident_pages_no_nan_reaches_logits";
    let Some((cpu, gpu)) = models(test) else {
        return;
    };
    let cfg = PoolConfig::new(gpu.kv_geometry(KvDtype::F32), 16, 24).scrub(ScrubPolicy::Poison);
    let pages = CudaPages::for_pool(gpu.backend().device(), &cfg).unwrap();
    let gpu_pool = KvPool::with_device_pages(cfg, Box::new(pages)).unwrap();
    no_nan_after_cancels_and_failures(&cpu, &gpu, gpu_pool);
}

/// A workload with cancelled requests, refused requests and abandoned
/// half-written KV on `pool`, a small poisoned GPU pool whose freed pages
/// are handed out again: no logit is ever NaN, the uninterrupted request
/// generates what it generates alone on the CPU, and the pool is full at
/// the end.
fn no_nan_after_cancels_and_failures(cpu: &Model, gpu: &Model<CudaBackend>, pool: KvPool) {
    // What request A generates alone, undisturbed, on the CPU.
    let prompt_a: &[u32] = &[1, 403, 407, 261];
    let cpu_pool = self::pool(cpu, 16, 64, ScrubPolicy::Zero);
    let want_a = greedy(cpu, &cpu_pool, 1, &[prompt_a], 60).remove(0);

    let mut scratch = gpu.scratch();
    let finite = |rows: &mut dyn Iterator<Item = &[f32]>, when: &str| {
        for r in rows {
            assert!(
                r.iter().all(|x| x.is_finite()),
                "{when}: NaN reached the logits: a stale (poisoned) slot was read"
            );
        }
    };

    let mut a = pool.reserve(RequestId(1), 64).unwrap();
    let mut b = pool.reserve(RequestId(2), 100).unwrap();
    let prompt_b: &[u32] = &[
        1, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311, 312, 313, 314, 315, 316, 317,
    ];
    let logits = gpu
        .prefill(&mut scratch, &mut [&mut a, &mut b], &[prompt_a, prompt_b])
        .unwrap();
    finite(&mut logits.rows(), "prefill A+B");
    let mut toks_a = vec![argmax(logits.row(0)).unwrap()];
    let mut tok_b = argmax(logits.row(1)).unwrap();
    let mut a: KvSeq<Ready> = a.seal(prompt_a.len()).map_err(|e| e.error).unwrap();
    let mut b: KvSeq<Ready> = b.seal(prompt_b.len()).map_err(|e| e.error).unwrap();
    for _ in 0..10 {
        let logits = gpu
            .decode(
                &mut scratch,
                &mut [&mut a, &mut b],
                &[*toks_a.last().unwrap(), tok_b],
            )
            .unwrap();
        finite(&mut logits.rows(), "decode A+B");
        toks_a.push(argmax(logits.row(0)).unwrap());
        tok_b = argmax(logits.row(1)).unwrap();
    }

    // B is cancelled mid-generation: its pages are poisoned and freed.
    b.release();

    // C is refused (a token outside the vocabulary): nothing is written.
    let mut c = pool.reserve(RequestId(3), 20).unwrap();
    let refused = gpu.prefill(&mut scratch, &mut [&mut c], &[&[1, 9999]]);
    assert!(matches!(refused, Err(ForwardError::TokenOutOfRange { .. })));
    assert_eq!(
        c.written_per_layer(),
        vec![0; gpu.config().n_layers],
        "C wrote KV"
    );
    drop(c);

    // D is abandoned half-written: the first 9 tokens of its 18-token
    // prompt are prefilled, then the caller gives up on it.
    let prompt_d: &[u32] = &[
        1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,
    ];
    let mut d = pool.reserve(RequestId(4), 40).unwrap();
    let logits = gpu
        .prefill(&mut scratch, &mut [&mut d], &[&prompt_d[..9]])
        .unwrap();
    finite(&mut logits.rows(), "prefill half of D");
    assert_eq!(d.written(0), 9);
    drop(d);

    // E and F take the poisoned pages (short prompts leave most slots of
    // their pages unwritten) and generate alongside A.
    // Room for the ~50 tokens each decodes alongside A (to A's 60).
    let mut e = pool.reserve(RequestId(5), 64).unwrap();
    let mut f = pool.reserve(RequestId(6), 64).unwrap();
    let logits = gpu
        .prefill(&mut scratch, &mut [&mut e, &mut f], &[&[1, 42], &[1]])
        .unwrap();
    finite(&mut logits.rows(), "prefill E+F");
    let mut tok_e = argmax(logits.row(0)).unwrap();
    let mut tok_f = argmax(logits.row(1)).unwrap();
    let mut e: KvSeq<Ready> = e.seal(2).map_err(|e| e.error).unwrap();
    let mut f: KvSeq<Ready> = f.seal(1).map_err(|e| e.error).unwrap();
    while toks_a.len() < 60 {
        let logits = gpu
            .decode(
                &mut scratch,
                &mut [&mut a, &mut e, &mut f],
                &[*toks_a.last().unwrap(), tok_e, tok_f],
            )
            .unwrap();
        finite(&mut logits.rows(), "decode A+E+F");
        toks_a.push(argmax(logits.row(0)).unwrap());
        tok_e = argmax(logits.row(1)).unwrap();
        tok_f = argmax(logits.row(2)).unwrap();
    }
    assert_eq!(
        toks_a, want_a,
        "A was harmed by the others' cancels and failures"
    );
    drop((a, e, f));
    let stats = pool.stats();
    assert!(stats.is_full(), "pages leaked: {stats:?}");
    assert_eq!(stats.isolation_violations, 0);
}

/// The largest difference of `got` from `want` (infinite where `got` is
/// not finite), and the root mean square of `want`.
fn worst_and_rms(want: &[f32], got: &[f32]) -> (f32, f32) {
    let rms = (want.iter().map(|x| x * x).sum::<f32>() / want.len() as f32).sqrt();
    let worst = want
        .iter()
        .zip(got)
        .map(|(a, b)| {
            if b.is_finite() {
                (a - b).abs()
            } else {
                f32::INFINITY
            }
        })
        .fold(0.0, f32::max);
    (worst, rms)
}

/// Logits of every step when each sequence is fed `forced[i]` after its
/// prompt (teacher forcing, so both backends see the same tokens): row
/// `[step][sequence]`, step 0 being the prefill's last position.
fn forced_logits<B: handoff::backend::Backend>(
    m: &Model<B>,
    pool: &KvPool,
    prompts: &[&[u32]],
    forced: &[Vec<u32>],
) -> Vec<Vec<Vec<f32>>> {
    let mut scratch = m.scratch();
    let steps = forced[0].len();
    let mut seqs: Vec<KvSeq<Filling>> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            pool.reserve(RequestId(i as u64 + 1), p.len() + steps)
                .unwrap()
        })
        .collect();
    let mut refs: Vec<&mut KvSeq<Filling>> = seqs.iter_mut().collect();
    let logits = m.prefill(&mut scratch, &mut refs, prompts).unwrap();
    let mut out = vec![logits.rows().map(<[f32]>::to_vec).collect::<Vec<_>>()];
    let mut ready: Vec<KvSeq<Ready>> = seqs
        .into_iter()
        .zip(prompts)
        .map(|(s, p)| s.seal(p.len()).map_err(|e| e.error).unwrap())
        .collect();
    for step in 0..steps - 1 {
        let toks: Vec<u32> = forced.iter().map(|f| f[step]).collect();
        let mut refs: Vec<&mut KvSeq<Ready>> = ready.iter_mut().collect();
        let logits = m.decode(&mut scratch, &mut refs, &toks).unwrap();
        out.push(logits.rows().map(<[f32]>::to_vec).collect());
    }
    out
}

/// A GQA model of real checkpoints' shapes (head_dim 64 or 128, four query
/// heads per KV head) with Llama 3's scaled RoPE.
fn gqa_llama3(head_dim: usize) -> handoff::model::ModelConfig {
    handoff::model::ModelConfig {
        dim: 512,
        hidden_dim: 1024,
        n_layers: 2,
        n_heads: 8,
        n_kv_heads: 2,
        head_dim,
        vocab_size: 1000,
        max_seq_len: 4096,
        rope_theta: 500_000.0,
        rope_style: handoff::model::RopeStyle::Half,
        rope_scaling: handoff::model::RopeScaling::Llama3 {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 64,
        },
        norm_eps: 1e-5,
        tied_embeddings: false,
        attention_bias: false,
        qk_norm: false,
        gemma: None,
    }
}

#[test]
fn a_bf16_gqa_model_with_llama3_rope_runs_on_cuda_as_on_the_cpu() {
    // The shapes real checkpoints have (head_dim 64 and 128, four query
    // heads per KV head, bf16 KV, so the tensor-core prefill and the narrow
    // KV paths run) and Llama 3's scaled RoPE, on random weights.
    let test = "a_bf16_gqa_model_with_llama3_rope_runs_on_cuda_as_on_the_cpu";
    let Some(dev) = device_for_test(test) else {
        return;
    };
    for head_dim in [64, 128] {
        let cfg = gqa_llama3(head_dim);
        let w = handoff::model::random_weights(&cfg, 11);
        let cpu = Model::cpu(w.clone()).unwrap();
        let gpu = Model::new(CudaBackend::new(dev.clone()), w).unwrap();
        let geometry = cpu.kv_geometry(KvDtype::BF16);
        let pool = |scrub| KvPool::new(PoolConfig::new(geometry, 16, 256).scrub(scrub)).unwrap();
        let (pc, pg) = (pool(ScrubPolicy::Zero), pool(ScrubPolicy::Poison));
        let long: Vec<u32> = (0..300).map(|i| (i * 37 % 1000) as u32).collect();
        let prompts: [&[u32]; 3] = [&[1], &[5, 9, 200, 7, 7, 31], &long];
        let forced: Vec<Vec<u32>> = (0..3)
            .map(|s| {
                (0..12)
                    .map(|i| ((s * 101 + i * 13) % 1000) as u32)
                    .collect()
            })
            .collect();
        let want = forced_logits(&cpu, &pc, &prompts, &forced);
        let got = forced_logits(&gpu, &pg, &prompts, &forced);
        for (step, (w, g)) in want.iter().zip(&got).enumerate() {
            for (s, (w, g)) in w.iter().zip(g).enumerate() {
                let (worst, rms) = worst_and_rms(w, g);
                // bf16 KV on both; the tensor-core prefill also rounds Q to
                // bf16 (~2^-9 relative on each score).
                assert!(
                    worst <= 0.03 * rms,
                    "head_dim {head_dim}, step {step}, sequence {s}: logits differ by {worst} \
                     (rms {rms})"
                );
            }
        }
        wide_decode_agrees(&gpu, &pg, &prompts, &forced, &got);
        assert!(pc.stats().is_full() && pg.stats().is_full());
    }
}

/// With CUDA graphs on (`CudaDevice::set_graphs`), every decode step's pass
/// is recorded; once a step's launches have been seen before, they are
/// replayed as one graph. The replay is the same kernels with the same
/// parameter bytes (positions, page tables and slots are refilled in place
/// so their addresses do not move), so the logits are those of graphs off
/// bit for bit, at every step, across page boundaries (page 16, 40 steps)
/// and for a second batch size (its own graph). The pool is full after.
#[test]
fn decode_steps_replayed_as_cuda_graphs_give_the_eager_logits_bit_for_bit() {
    use handoff::backend::Backend;
    let test = "decode_steps_replayed_as_cuda_graphs_give_the_eager_logits_bit_for_bit";
    let Some(dev) = device_for_test(test) else {
        return;
    };
    let cfg = gqa_llama3(128);
    let mut w = handoff::model::random_weights(&cfg, 5);
    w.round_matrices_to_bf16(); // tensor-core matmuls, as a bf16 checkpoint
    let gpu = Model::new(CudaBackend::new(dev.clone()).device_kv(true), w).unwrap();
    let pool = gpu
        .backend()
        .new_pool(PoolConfig::new(gpu.kv_geometry(KvDtype::BF16), 16, 64))
        .unwrap();
    let long: Vec<u32> = (0..37).map(|i| (i * 11 % 1000) as u32).collect();
    let prompts: [&[u32]; 3] = [&[3, 1, 4], &long, &[9]];
    const STEPS: usize = 40;
    let forced: Vec<Vec<u32>> = (0..3)
        .map(|s| {
            (0..STEPS)
                .map(|i| ((s * 7 + i * 31) % 1000) as u32)
                .collect()
        })
        .collect();
    for batch in [3, 1] {
        dev.set_graphs(false);
        let eager = forced_logits(&gpu, &pool, &prompts[..batch], &forced[..batch]);
        dev.set_graphs(true);
        let (replays, captures) = dev.graph_counts();
        let graphed = forced_logits(&gpu, &pool, &prompts[..batch], &forced[..batch]);
        let (replays, captures) = (
            dev.graph_counts().0 - replays,
            dev.graph_counts().1 - captures,
        );
        assert!(dev.graphs(), "batch {batch}: the driver refused a graph");
        dev.set_graphs(false);
        for (step, (e, g)) in eager.iter().zip(&graphed).enumerate() {
            for (s, (e, g)) in e.iter().zip(g).enumerate() {
                let differ = e.iter().zip(g).filter(|(a, b)| a.to_bits() != b.to_bits());
                assert_eq!(
                    differ.count(),
                    0,
                    "batch {batch}, step {step}, sequence {s}: graph logits differ from eager"
                );
            }
        }
        // 39 decode steps, each a pass of two flushes (its embedding, then
        // the layers and logits): all but the first few replay.
        assert!(
            replays >= STEPS as u64 - 6,
            "batch {batch}: only {replays} graph launches in {} decode steps ({captures} captures)",
            STEPS - 1
        );
        assert!(captures <= 8, "batch {batch}: {captures} captures");
        assert!(pool.stats().is_full());
    }
}

/// The 8-warp decode kernel chosen for the whole model
/// (`CudaBackend::set_decode_kernel`): the prefill's logits keep their bits
/// (it runs no decode), every decode step's are the 4-warp kernel's
/// (`got`) within f32 summation order, each sequence's the same bits alone
/// as batched; on f32 KV, which it has no kernel for, a decode step fails
/// with a typed error instead of running another kernel.
fn wide_decode_agrees(
    gpu: &Model<CudaBackend>,
    pool: &KvPool,
    prompts: &[&[u32]],
    forced: &[Vec<u32>],
    got: &[Vec<Vec<f32>>],
) {
    let backend = gpu.backend();
    if backend.device().max_shared_memory_per_block() < 8 * 3 * 2 * 16 * 128 * 2 {
        let _ = writeln!(
            std::io::stderr(),
            "SKIP the wide decode: not enough shared memory"
        );
        return;
    }
    backend.set_decode_kernel(DecodeKernel::TensorCoreWide);
    assert_eq!(backend.decode_kernel(), DecodeKernel::TensorCoreWide);
    let wide = forced_logits(gpu, pool, prompts, forced);
    let bits = |r: &[f32]| r.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (step, (w, g)) in wide.iter().zip(got).enumerate() {
        for (s, (w, g)) in w.iter().zip(g).enumerate() {
            if step == 0 {
                assert_eq!(
                    bits(w),
                    bits(g),
                    "sequence {s}: the prefill's logits changed"
                );
                continue;
            }
            let (worst, rms) = worst_and_rms(g, w);
            assert!(
                worst <= 1e-3 * rms,
                "wide decode, step {step}, sequence {s}: {worst} from the 4-warp kernel (rms {rms})"
            );
        }
    }
    let last = prompts.len() - 1;
    let alone = forced_logits(gpu, pool, &prompts[last..], &forced[last..]);
    for (step, rows) in alone.iter().enumerate() {
        assert_eq!(
            bits(&rows[0]),
            bits(&wide[step][last]),
            "wide decode, step {step}: alone differs from batched"
        );
    }
    // f32 KV has no tensor-core kernel: refused, typed.
    let f32_pool = KvPool::new(PoolConfig::new(gpu.kv_geometry(KvDtype::F32), 16, 16)).unwrap();
    let mut scratch = gpu.scratch();
    let mut seq = f32_pool.reserve(RequestId(99), 8).unwrap();
    gpu.prefill(&mut scratch, &mut [&mut seq], &[&[1, 2, 3]])
        .unwrap();
    let mut ready = seq.seal(3).map_err(|e| e.error).unwrap();
    let err = gpu
        .decode(&mut scratch, &mut [&mut ready], &[4])
        .map(drop)
        .unwrap_err();
    assert!(
        err.to_string().contains("tensor-core decode"),
        "expected a refusal of the wide kernel on f32 KV, got {err}"
    );
    drop(ready);
    assert!(f32_pool.stats().is_full());
    backend.set_decode_kernel(DecodeKernel::Auto);
}

/// FP8 KV on device-resident pages (poison scrub): the device appends E4M3
/// bytes with its own conversion and prefills and decodes on tensor cores
/// (tiles widened to f16); the logits are the CPU's on FP8
/// KV within a bound wider than bf16's (0.05 of their RMS against 0.03),
/// because one K or V value computed a few f32 ulps apart on each side can
/// round to neighbouring E4M3 codes (1/8 apart relative). On the CPU,
/// weights perturbed by 2e-3 relative moved FP8 KV's logits by at most 0.01
/// of their RMS (bf16 KV's by 0.006).
#[test]
fn an_fp8_kv_model_on_device_pages_runs_on_cuda_as_on_the_cpu() {
    use handoff::backend::Backend;
    let test = "an_fp8_kv_model_on_device_pages_runs_on_cuda_as_on_the_cpu";
    let Some(dev) = device_for_test(test) else {
        return;
    };
    let w = handoff::model::random_weights(&gqa_llama3(128), 17);
    let cpu = Model::cpu(w.clone()).unwrap();
    let gpu = Model::new(CudaBackend::new(dev.clone()).device_kv(true), w).unwrap();
    let cfg = PoolConfig::new(cpu.kv_geometry(KvDtype::F8E4M3), 16, 256);
    let pc = KvPool::new(cfg).unwrap();
    let pg = gpu
        .backend()
        .new_pool(cfg.scrub(ScrubPolicy::Poison))
        .unwrap();
    assert_eq!(pg.residence(), handoff::kv::Residence::Device);
    let long: Vec<u32> = (0..300).map(|i| (i * 41 % 1000) as u32).collect();
    let prompts: [&[u32]; 3] = [&[3], &[8, 1, 99, 7, 250, 31], &long];
    let forced: Vec<Vec<u32>> = (0..3)
        .map(|s| (0..10).map(|i| ((s * 71 + i * 19) % 1000) as u32).collect())
        .collect();
    let want = forced_logits(&cpu, &pc, &prompts, &forced);
    let got = forced_logits(&gpu, &pg, &prompts, &forced);
    for (step, (w, g)) in want.iter().zip(&got).enumerate() {
        for (s, (w, g)) in w.iter().zip(g).enumerate() {
            assert!(g.iter().all(|x| x.is_finite()), "step {step}, sequence {s}");
            let (worst, rms) = worst_and_rms(w, g);
            assert!(
                worst <= 0.05 * rms,
                "FP8 KV, step {step}, sequence {s}: logits differ by {worst} (rms {rms})"
            );
        }
    }
    // Alone, the long sequence gives the bits it gave in the batch.
    let alone = forced_logits(&gpu, &pg, &prompts[2..], &forced[2..]);
    for (step, rows) in alone.iter().enumerate() {
        let bits = |r: &[f32]| r.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&rows[0]), bits(&got[step][2]), "FP8 KV, step {step}");
    }
    assert!(pc.stats().is_full() && pg.stats().is_full());
}

#[test]
fn a_model_without_compiled_kernels_is_refused_when_placed_not_at_its_first_request() {
    let test = "a_model_without_compiled_kernels_is_refused_when_placed_not_at_its_first_request";
    let Some(dev) = device_for_test(test) else {
        return;
    };
    let base = handoff::model::ModelConfig::tiny_gqa();
    for (what, cfg) in [
        (
            "head_dim",
            handoff::model::ModelConfig {
                head_dim: 96,
                ..base.clone()
            },
        ),
        (
            "query heads per KV head",
            handoff::model::ModelConfig {
                n_heads: 64,
                n_kv_heads: 1,
                ..base.clone()
            },
        ),
    ] {
        let w = handoff::model::random_weights(&cfg, 3);
        assert!(Model::cpu(w.clone()).is_ok(), "the CPU runs every shape");
        match Model::new(CudaBackend::new(dev.clone()), w) {
            Err(handoff::model::ModelError::Unsupported { backend, source }) => {
                assert_eq!(backend, "cuda");
                assert!(source.to_string().starts_with(what), "{source}");
            }
            other => panic!("{what}: {other:?}"),
        }
    }
}

/// Greedy tokens of `batch` through an engine, 24 each, all submitted at
/// once.
fn engine_tokens<B: handoff::backend::Backend>(
    e: &mut handoff::Engine<B>,
    batch: &[Vec<u32>],
) -> Vec<Vec<u32>> {
    engine_tokens_with(e, batch, |_| handoff::SamplingParams::greedy())
}

/// Tokens of `batch` through an engine, 24 each, request `i` sampled with
/// `sampling(i)`, all submitted at once.
fn engine_tokens_with<B: handoff::backend::Backend>(
    e: &mut handoff::Engine<B>,
    batch: &[Vec<u32>],
    sampling: impl Fn(usize) -> handoff::SamplingParams,
) -> Vec<Vec<u32>> {
    use handoff::{FinishReason, Outcome, Request, TenantId};
    let hs: Vec<_> = batch
        .iter()
        .enumerate()
        .map(|(i, p)| {
            e.submit(
                Request::new(RequestId(i as u64), TenantId(0), p.clone(), 24)
                    .with_sampling(sampling(i)),
            )
            .unwrap()
        })
        .collect();
    e.run_until_idle();
    hs.iter()
        .map(|h| {
            let (t, o) = h.try_collect();
            assert_eq!(o, Some(Outcome::Finished(FinishReason::Length)));
            t
        })
        .collect()
}

/// Two colocated engines on `w`: one on `dev` with device-resident KV, one
/// on the CPU, with the same configuration.
fn engines_on_device_kv_and_cpu(
    dev: handoff::backend::cuda::CudaDevice,
    w: ModelWeights,
) -> (handoff::Engine<CudaBackend>, handoff::Engine) {
    use handoff::{Engine, EngineConfig};
    let cpu = Model::cpu(w.clone()).expect("places on CPU");
    let gpu = Model::new(CudaBackend::new(dev).device_kv(true), w).expect("places on the GPU");
    let cfg = |g| {
        EngineConfig::colocated(g)
            .max_context(256)
            .page_size(16)
            .pool_tokens(8 * 256)
            .build()
            .unwrap()
    };
    let (gc, cc) = (
        cfg(gpu.kv_geometry(KvDtype::F32)),
        cfg(cpu.kv_geometry(KvDtype::F32)),
    );
    (Engine::new(gpu, gc).unwrap(), Engine::new(cpu, cc).unwrap())
}

/// A backend asked for device KV (`CudaBackend::device_kv`) gives the
/// colocated engine a device-resident pool, and the engine's greedy tokens
/// equal the CPU engine's, alone and in a batch; the pool is full after.
#[test]
fn an_engine_on_a_device_kv_backend_keeps_its_pages_on_the_device_and_matches_the_cpu() {
    use handoff::kv::Residence;
    let test = "an_engine_on_a_device_kv_backend_keeps_its_pages_on_the_device";
    let Some(dev) = device_for_test(test) else {
        return;
    };
    let Some(w) = weights(test) else {
        return;
    };
    let (mut g, mut c) = engines_on_device_kv_and_cpu(dev, w);
    assert_eq!(g.pool().residence(), Residence::Device);
    assert_eq!(c.pool().residence(), Residence::Host);
    let prompts: Vec<Vec<u32>> = (0..6u32)
        .map(|i| {
            (0..(1 + i * 13))
                .map(|j| (i * 131 + j * 17 + 3) % 512)
                .collect()
        })
        .collect();
    let want = engine_tokens(&mut c, &prompts);
    assert_eq!(engine_tokens(&mut g, &prompts), want, "batched");
    for (p, w) in prompts.iter().zip(&want) {
        assert_eq!(
            &engine_tokens(&mut g, std::slice::from_ref(p))[0],
            w,
            "alone"
        );
    }
    assert!(g.pool_stats().is_full());
}

/// Sampling runs on the device (only token ids come back): a request's seed
/// gives the same tokens as on the CPU backend, for temperature alone,
/// top-k and top-p, batched and alone; the pool is full after.
#[test]
fn an_engine_sampling_on_the_device_draws_the_cpus_tokens_for_each_seed() {
    use handoff::SamplingParams;
    let test = "an_engine_sampling_on_the_device_draws_the_cpus_tokens_for_each_seed";
    let Some(dev) = device_for_test(test) else {
        return;
    };
    let Some(w) = weights(test) else {
        return;
    };
    let (mut g, mut c) = engines_on_device_kv_and_cpu(dev, w);
    let prompts: Vec<Vec<u32>> = (0..6u32)
        .map(|i| {
            (0..(2 + i * 11))
                .map(|j| (i * 97 + j * 13 + 5) % 512)
                .collect()
        })
        .collect();
    let sampling = |i: usize| SamplingParams {
        temperature: [0.8, 1.0, 1.3][i % 3],
        top_k: i.is_multiple_of(2).then_some(40),
        top_p: (i % 3 != 1).then_some(0.9),
        seed: 1000 + i as u64,
        stop_ids: Vec::new(),
        logprobs: None,
    };
    let want = engine_tokens_with(&mut c, &prompts, sampling);
    assert_eq!(
        engine_tokens_with(&mut g, &prompts, sampling),
        want,
        "batched"
    );
    for (i, (p, w)) in prompts.iter().zip(&want).enumerate() {
        let alone = engine_tokens_with(&mut g, std::slice::from_ref(p), |_| sampling(i));
        assert_eq!(&alone[0], w, "request {i} alone");
    }
    // Sampling drew from the distribution, not the argmax.
    assert_ne!(
        want,
        engine_tokens(&mut c, &prompts),
        "sampled differs from greedy"
    );
    assert!(g.pool_stats().is_full());
}

/// A bf16 checkpoint's weights stay bf16 on the device (half the bytes of
/// f32) and run on tensor cores: logits within the split activations'
/// precision of the CPU backend's (which keeps the same bf16 weights), a
/// sequence's logits the same bits alone as in a batch and with the norms
/// and SwiGLU launched apart, and the same model widened to f32
/// (`bf16_weights(false)`) as a cross-check.
#[test]
fn bf16_weights_stay_bf16_on_the_device_and_match_the_cpu() {
    let test = "bf16_weights_stay_bf16_on_the_device_and_match_the_cpu";
    if let Some(dev) = device_for_test(test) {
        half_weights_match_the_cpu(dev, ModelWeights::round_matrices_to_bf16);
    }
}

/// An f16 checkpoint's weights stay f16 on the device (half the bytes of
/// f32; split into exact bf16 parts in the tensor-core matmul's registers):
/// the same story as bf16's, against the CPU backend on the same f16
/// values. A kernel that dropped the parts bf16 cannot hold would miss the
/// CPU by about 2^-9 of each product.
#[test]
fn f16_weights_stay_f16_on_the_device_and_match_the_cpu() {
    let test = "f16_weights_stay_f16_on_the_device_and_match_the_cpu";
    if let Some(dev) = device_for_test(test) {
        half_weights_match_the_cpu(dev, ModelWeights::round_matrices_to_f16);
    }
}

fn half_weights_match_the_cpu(
    dev: handoff::backend::cuda::CudaDevice,
    round: fn(&mut ModelWeights),
) {
    let cfg = handoff::model::ModelConfig {
        dim: 256,
        hidden_dim: 688,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 64,
        vocab_size: 515,
        max_seq_len: 512,
        rope_theta: 10_000.0,
        rope_style: handoff::model::RopeStyle::Half,
        rope_scaling: handoff::model::RopeScaling::None,
        norm_eps: 1e-5,
        tied_embeddings: true,
        attention_bias: false,
        qk_norm: false,
        gemma: None,
    };
    let mut w = handoff::model::random_weights(&cfg, 21);
    round(&mut w);
    let cpu = Model::cpu(w.clone()).unwrap();
    let tc = Model::new(CudaBackend::new(dev.clone()), w.clone()).unwrap();
    let wide = Model::new(CudaBackend::new(dev).bf16_weights(false), w).unwrap();
    assert!(
        tc.weight_bytes() * 10 < wide.weight_bytes() * 6,
        "16-bit matrices take half the bytes: {} vs {}",
        tc.weight_bytes(),
        wide.weight_bytes()
    );
    let geometry = cpu.kv_geometry(KvDtype::F32);
    let pool = || KvPool::new(PoolConfig::new(geometry, 16, 128)).unwrap();
    let prompts: [&[u32]; 3] = [&[3], &[5, 9, 200, 7, 7, 31], &[11; 40]];
    let forced: Vec<Vec<u32>> = (0..3)
        .map(|s| (0..8).map(|i| ((s * 101 + i * 13) % 515) as u32).collect())
        .collect();
    let want = forced_logits(&cpu, &pool(), &prompts, &forced);
    for (name, m) in [("tensor cores", &tc), ("widened", &wide)] {
        let got = forced_logits(m, &pool(), &prompts, &forced);
        for (step, (w, g)) in want.iter().zip(&got).enumerate() {
            for (s, (w, g)) in w.iter().zip(g).enumerate() {
                let (worst, rms) = worst_and_rms(w, g);
                assert!(
                    worst <= 1e-3 * rms,
                    "{name}, step {step}, sequence {s}: logits differ by {worst} (rms {rms})"
                );
            }
        }
    }
    // Batch invariance on tensor cores: each sequence alone, the same bits.
    let batched = forced_logits(&tc, &pool(), &prompts, &forced);
    for (s, p) in prompts.iter().enumerate() {
        let alone = forced_logits(&tc, &pool(), &[p], std::slice::from_ref(&forced[s]));
        for (step, rows) in alone.iter().enumerate() {
            let (a, b): (Vec<u32>, Vec<u32>) = (
                rows[0].iter().map(|x| x.to_bits()).collect(),
                batched[step][s].iter().map(|x| x.to_bits()).collect(),
            );
            assert!(
                a == b,
                "sequence {s}, step {step}: alone differs from batched"
            );
        }
    }
    // The norms and the SwiGLU ride in the matmuls' launches (the default);
    // launched apart, every logit keeps its bits.
    let to_bits = |l: &Vec<Vec<Vec<f32>>>| -> Vec<Vec<Vec<u32>>> {
        l.iter()
            .map(|step| {
                step.iter()
                    .map(|r| r.iter().map(|x| x.to_bits()).collect())
                    .collect()
            })
            .collect()
    };
    let launches = |on: bool| {
        tc.backend().set_carried_stages(on);
        let before = tc.backend().device().launches();
        let logits = forced_logits(&tc, &pool(), &prompts, &forced);
        (logits, tc.backend().device().launches() - before)
    };
    let (apart, apart_launches) = launches(false);
    let (carried, carried_launches) = launches(true);
    // Carried, they do take fewer launches (two norms and a SwiGLU a layer
    // in every decode step of 3 rows; the SwiGLU in the 47-row prefill).
    assert!(
        carried_launches < apart_launches,
        "{carried_launches} launches carried, {apart_launches} apart"
    );
    assert!(
        to_bits(&carried) == to_bits(&batched),
        "carried stages change the logits between two runs"
    );
    assert!(
        to_bits(&apart) == to_bits(&batched),
        "norms and SwiGLU launched apart change the logits"
    );
}

/// A GGUF checkpoint's quantized matrices stay in their ggml blocks on the
/// device (the embedding, which is also the output head, included): well
/// under a third of the same model's bytes widened to f32, every logit the
/// bits of that widened model on the device (the block-reading kernels
/// widen each value as the CPU backend does, inside the f32 matmul's own
/// sums), and within f32 summation order of the CPU backend's. Two files:
/// the malformed-file stories' valid one (Q8_0 and Q4_1), and a random one
/// in llama.cpp's Q4_K_M mix with Q5_K and Q5_0/Q5_1/Q4_0 layers beside it.
#[test]
fn a_quantized_gguf_model_stays_in_its_blocks_on_the_device() {
    let test = "a_quantized_gguf_model_stays_in_its_blocks_on_the_device";
    let Some(dev) = device_for_test(test) else {
        return;
    };
    use handoff::model::gguf::{GgmlType, random_gguf};
    let cfg = handoff::model::ModelConfig {
        dim: 256,
        hidden_dim: 512,
        head_dim: 64,
        vocab_size: 320,
        ..handoff::model::ModelConfig::tiny_gqa()
    };
    let mix = random_gguf(&cfg, 5, |name| match name {
        "token_embd" | "ffn_down" => GgmlType::Q6K,
        "output" => GgmlType::Q5K,
        "attn_v" => GgmlType::Q5_0,
        "attn_k" => GgmlType::Q5_1,
        "attn_output" => GgmlType::Q4_0,
        _ => GgmlType::Q4K,
    })
    .unwrap();
    for (file, bytes) in [
        (
            "Q8_0/Q4_1",
            crate::support::gguf_llama::Parts::valid().bytes(),
        ),
        ("K-quant mix", mix),
    ] {
        stays_in_blocks(&dev, file, bytes);
    }
}

fn stays_in_blocks(dev: &handoff::backend::cuda::CudaDevice, file: &str, bytes: Vec<u8>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    std::fs::write(&path, &bytes).unwrap();
    let blocks = Model::load(CudaBackend::new(dev.clone()), &path).unwrap();
    let w = handoff::model::gguf::load_gguf_bytes(bytes).unwrap();
    let widened = Model::new(CudaBackend::new(dev.clone()).bf16_weights(false), w).unwrap();
    let cpu = Model::load(handoff::backend::CpuBackend::with_threads(1), &path).unwrap();
    assert!(
        blocks.weight_bytes() * 3 < widened.weight_bytes(),
        "{file}: {} bytes in blocks, {} widened",
        blocks.weight_bytes(),
        widened.weight_bytes()
    );
    let vocab = cpu.config().vocab_size;
    let geometry = cpu.kv_geometry(KvDtype::F32);
    let pool = || KvPool::new(PoolConfig::new(geometry, 16, 64)).unwrap();
    let prompts: [&[u32]; 3] = [&[3], &[5, 9, 40, 7, 7, 31], &[11; 20]];
    let forced: Vec<Vec<u32>> = (0..3)
        .map(|s| (0..8).map(|i| ((s * 37 + i * 13) % vocab) as u32).collect())
        .collect();
    let want = forced_logits(&cpu, &pool(), &prompts, &forced);
    let wide = forced_logits(&widened, &pool(), &prompts, &forced);
    let got = forced_logits(&blocks, &pool(), &prompts, &forced);
    for (step, ((w, g), x)) in want.iter().zip(&got).zip(&wide).enumerate() {
        for (s, ((w, g), x)) in w.iter().zip(g).zip(x).enumerate() {
            let (gb, xb): (Vec<u32>, Vec<u32>) = (
                g.iter().map(|v| v.to_bits()).collect(),
                x.iter().map(|v| v.to_bits()).collect(),
            );
            assert!(
                gb == xb,
                "{file}, step {step}, sequence {s}: blocks differ from widened"
            );
            let (worst, rms) = worst_and_rms(w, g);
            assert!(
                worst <= 1e-3 * rms,
                "{file}, step {step}, sequence {s}: logits differ from the CPU's by {worst} (rms {rms})"
            );
        }
    }
}

/// A decode step on device-resident KV waits for the device once: every
/// kernel of the pass is queued, the tokens are sampled on the device, and
/// only their ids (and the log-probabilities two of the rows ask for) come
/// back (`CudaDevice::host_syncs`).
#[test]
fn a_decode_step_on_device_kv_waits_for_the_device_once() {
    let test = "a_decode_step_on_device_kv_waits_for_the_device_once";
    let Some(dev) = device_for_test(test) else {
        return;
    };
    for graphs in [false, true] {
        dev.set_graphs(graphs);
        waits_once(&dev);
    }
    dev.set_graphs(false);
}

fn waits_once(dev: &handoff::backend::cuda::CudaDevice) {
    use handoff::backend::Backend;
    use handoff::sampling::Draw;
    let w = handoff::model::random_weights(&handoff::model::ModelConfig::tiny_gqa(), 3);
    let m = Model::new(CudaBackend::new(dev.clone()).device_kv(true), w).unwrap();
    let pool = m
        .backend()
        .new_pool(PoolConfig::new(m.kv_geometry(KvDtype::BF16), 16, 64))
        .unwrap();
    let mut s = m.scratch();
    let prompts: [&[u32]; 4] = [&[1, 2, 3], &[4], &[5, 6, 7, 8, 9], &[10, 11]];
    let mut seqs: Vec<KvSeq<Filling>> = (0..4)
        .map(|i| pool.reserve(RequestId(i + 1), 32).unwrap())
        .collect();
    let asking = handoff::SamplingParams {
        logprobs: Some(3),
        ..handoff::SamplingParams::greedy()
    };
    let draws = vec![
        Draw::greedy(),
        Draw::new(&asking, 0).unwrap(),
        Draw::greedy(),
        Draw::new(&asking, 0).unwrap(),
    ];
    let mut next: Vec<u32> = {
        let mut refs: Vec<&mut KvSeq<Filling>> = seqs.iter_mut().collect();
        let t = m
            .prefill_sampled(&mut s, &mut refs, &prompts, &draws)
            .unwrap();
        t.iter().map(|t| t.clone().unwrap()).collect()
    };
    let mut ready: Vec<KvSeq<Ready>> = seqs
        .into_iter()
        .zip(prompts)
        .map(|(q, p)| q.seal(p.len()).map_err(|e| e.error).unwrap())
        .collect();
    for step in 0..4 {
        let before = dev.host_syncs();
        let mut refs: Vec<&mut KvSeq<Ready>> = ready.iter_mut().collect();
        let t = m.decode_sampled(&mut s, &mut refs, &next, &draws).unwrap();
        next = t.iter().map(|t| t.clone().unwrap()).collect();
        for (i, &tok) in next.iter().enumerate() {
            match t.logprobs(i) {
                Some(lp) => assert!(i % 2 == 1 && lp.token == tok && lp.top[0].0 == tok),
                None => assert!(i % 2 == 0, "row {i} asked"),
            }
        }
        let waits = dev.host_syncs() - before;
        // The first step may grow buffers; every step waits exactly once.
        assert_eq!(
            waits,
            1,
            "step {step} waited for the device {waits} times (graphs {})",
            dev.graphs()
        );
    }
    drop(ready);
    assert!(pool.stats().is_full());
}

/// The pool is planned from the device's free memory after the weights
/// (`CudaBackend::kv_budget`): a budget that holds the window builds an
/// engine whose pool lives on the device within it; one past the device's
/// memory is a typed 503 at construction, not a panic; one too small for
/// the window does not build.
#[test]
fn the_kv_pool_is_planned_from_free_device_memory_and_fails_closed() {
    use handoff::kv::Residence;
    use handoff::{Engine, EngineConfig, HttpStatus};
    let test = "the_kv_pool_is_planned_from_free_device_memory_and_fails_closed";
    let Some(dev) = device_for_test(test) else {
        return;
    };
    let w = handoff::model::random_weights(&handoff::model::ModelConfig::tiny_gqa(), 4);
    let place = || Model::new(CudaBackend::new(dev.clone()).device_kv(true), w.clone()).unwrap();
    let m = place();
    let geometry = m.kv_geometry(KvDtype::BF16);
    let budget = m.backend().kv_budget(1 << 30).unwrap().min(1 << 30);
    let cfg = |bytes: u64| {
        EngineConfig::colocated(geometry)
            .max_context(256)
            .page_size(16)
            .pool_memory(bytes)
            .build()
    };
    let e = Engine::new(m, cfg(budget).unwrap()).unwrap();
    assert_eq!(e.pool().residence(), Residence::Device);
    let stats = e.pool_stats();
    assert!(stats.capacity > 0 && stats.is_full());
    drop(e);
    let (free, total) = dev.memory_info().unwrap();
    assert!(free > 0 && total >= free);
    match Engine::new(place(), cfg(2 * total as u64).unwrap()) {
        Ok(_) => panic!("a pool twice the device's memory was built"),
        Err(err) => assert_eq!(err.http_status(), 503, "{err}"),
    }
    assert!(
        cfg(1024).is_err(),
        "a budget below one window does not build"
    );
}
