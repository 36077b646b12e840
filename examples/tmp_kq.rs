use handoff::backend::CpuBackend;
use handoff::kv::{KvSeq, Ready};
use handoff::model::gguf::{GgmlType, random_gguf};
use handoff::model::{Model, ModelConfig, RopeScaling, RopeStyle};
use handoff::sampling::argmax;
use handoff::{KvDtype, KvPool, PoolConfig, RequestId};
use std::time::Instant;

fn rate(m: &Model, batch: usize, steps: usize) -> f64 {
    let pool = KvPool::new(PoolConfig::new(m.kv_geometry(KvDtype::F32), 16, batch * 16)).unwrap();
    let mut scratch = m.scratch();
    let prompts: Vec<Vec<u32>> = (0..batch)
        .map(|i| (0..16).map(|j| (i * 131 + j * 17 + 1) as u32).collect())
        .collect();
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
    let t = Instant::now();
    for _ in 0..steps {
        let mut r: Vec<_> = seqs.iter_mut().collect();
        let logits = m.decode(&mut scratch, &mut r, &next).unwrap();
        next = (0..batch).map(|i| argmax(logits.row(i)).unwrap()).collect();
    }
    (batch * steps) as f64 / t.elapsed().as_secs_f64()
}

fn main() {
    let layers: usize = std::env::var("L")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    let cfg = ModelConfig {
        rope_style: RopeStyle::Interleaved,
        rope_scaling: RopeScaling::None,
        vocab_size: 32768,
        ..ModelConfig::llama_3_2_1b_shape(layers)
    };
    let which: Vec<String> = std::env::args().skip(1).collect();
    for name in which {
        let ty = match name.as_str() {
            "q4_1" => GgmlType::Q4_1,
            "q8_0" => GgmlType::Q8_0,
            "q4_k" => GgmlType::Q4K,
            "q6_k" => GgmlType::Q6K,
            "q5_k" => GgmlType::Q5K,
            "q4_0" => GgmlType::Q4_0,
            "q5_0" => GgmlType::Q5_0,
            "bf16" => GgmlType::Bf16,
            _ => panic!(),
        };
        let p = format!("/tmp/kq/{name}_{layers}.gguf");
        if !std::path::Path::new(&p).exists() {
            std::fs::write(&p, random_gguf(&cfg, 1, |_| ty).unwrap()).unwrap();
        }
        let m = Model::load(CpuBackend::with_threads(2), std::path::Path::new(&p)).unwrap();
        let gb = m.weight_bytes() as f64 / 1e9;
        let r1 = rate(&m, 1, 24);
        let r8 = rate(&m, 8, 12);
        println!(
            "{name}: {gb:.3} GB, b1 {r1:.1} tok/s ({:.1} GB/s), b8 {r8:.1} tok/s",
            r1 * gb
        );
    }
}
