use handoff::backend::{Backend, CpuBackend, Isa};
use handoff::model::gguf::{GgmlType, GgufFile, QuantMatrix};
use handoff::model::{ModelConfig, RopeScaling, RopeStyle};
use std::time::Instant;
fn main() {
    let threads: usize = std::env::var("T")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let m: usize = std::env::var("M")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let (n, k) = (8192usize, 2048usize);
    let cfg = ModelConfig {
        dim: k,
        hidden_dim: n,
        n_layers: 1,
        n_heads: 16,
        n_kv_heads: 8,
        head_dim: 128,
        vocab_size: 256,
        max_seq_len: 64,
        rope_style: RopeStyle::Interleaved,
        rope_scaling: RopeScaling::None,
        ..ModelConfig::tiny_gqa()
    };
    for name in std::env::args().skip(1) {
        let ty = match name.as_str() {
            "q4_1" => GgmlType::Q4_1,
            "q8_0" => GgmlType::Q8_0,
            "q4_k" => GgmlType::Q4K,
            "q6_k" => GgmlType::Q6K,
            "q5_k" => GgmlType::Q5K,
            _ => panic!(),
        };
        let bytes = handoff::model::gguf::random_gguf(&cfg, 1, |_| ty).unwrap();
        let f = GgufFile::from_bytes(bytes).unwrap();
        let t = f.tensor("blk.0.ffn_gate.weight").unwrap().clone();
        let q = QuantMatrix::new("w", ty, n, k, f.tensor_bytes(&t).to_vec()).unwrap();
        let b = CpuBackend::with_isa(threads, Isa::detect()).unwrap();
        let w = b.upload_quant(q).unwrap();
        let mb = b.mat_bytes(&w) as f64 / 1e6;
        let x: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 * 0.1).collect();
        let mut out = Vec::new();
        for _ in 0..5 {
            b.matmul(&x, &w, &mut out).unwrap();
        }
        let reps = 60;
        let t0 = Instant::now();
        for _ in 0..reps {
            b.matmul(&x, &w, &mut out).unwrap();
        }
        let s = t0.elapsed().as_secs_f64() / reps as f64;
        println!(
            "{name} m={m} t={threads}: {:.0} us, {:.1} GB/s ({mb:.1} MB)",
            s * 1e6,
            mb / 1e3 / s
        );
    }
}
