//! Peak memory of loading a bf16 Hugging Face checkpoint: read whole
//! (`Model::new(backend, load_hf(dir)?)`, every tensor widened to f32 first)
//! against placed as read (`Model::load(backend, dir)`, one layer at a time),
//! each in a fresh child process, alternating, with the same synthetic
//! checkpoint (Llama-3.2-1B shape, `HANDOFF_BENCH_LAYERS` layers, default 4,
//! random bf16 weights, written to a temporary folder first).
//!
//! ```sh
//! cargo bench --bench load_memory
//! ```

use std::io::Write;
use std::path::Path;
use std::process::Command;

use handoff::backend::CpuBackend;
use handoff::model::{Model, ModelConfig, load_hf};
use safetensors::Dtype;
use safetensors::tensor::TensorView;

fn say(s: String) {
    let _ = writeln!(std::io::stdout(), "{s}");
}

/// Peak resident memory of this process so far (VmHWM), in bytes.
fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// In a child: loads `dir` the way `mode` says and reports its peak.
fn child(mode: &str, dir: &Path) {
    let backend = CpuBackend::with_threads(1);
    let model = match mode {
        "whole" => Model::new(backend, load_hf(dir).unwrap()).unwrap(),
        _ => Model::load(backend, dir).unwrap(),
    };
    say(format!(
        "{} {}",
        model.weight_bytes(),
        peak_rss().unwrap_or(0)
    ));
}

/// Writes a bf16 checkpoint of `c` with pseudo-random weights.
fn write_checkpoint(c: &ModelConfig, dir: &Path) {
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": c.dim,
        "intermediate_size": c.hidden_dim,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_seq_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": true,
        "torch_dtype": "bfloat16",
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let (d, h) = (c.dim, c.hidden_dim);
    let (qd, kvd) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
    let mut shapes: Vec<(String, Vec<usize>)> =
        vec![("model.embed_tokens.weight".into(), vec![c.vocab_size, d])];
    for l in 0..c.n_layers {
        let p = format!("model.layers.{l}");
        for (name, shape) in [
            ("input_layernorm.weight", vec![d]),
            ("self_attn.q_proj.weight", vec![qd, d]),
            ("self_attn.k_proj.weight", vec![kvd, d]),
            ("self_attn.v_proj.weight", vec![kvd, d]),
            ("self_attn.o_proj.weight", vec![d, qd]),
            ("post_attention_layernorm.weight", vec![d]),
            ("mlp.gate_proj.weight", vec![h, d]),
            ("mlp.down_proj.weight", vec![d, h]),
            ("mlp.up_proj.weight", vec![h, d]),
        ] {
            shapes.push((format!("{p}.{name}"), shape));
        }
    }
    shapes.push(("model.norm.weight".into(), vec![d]));
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let data: Vec<Vec<u8>> = shapes
        .iter()
        .map(|(_, s)| {
            let n: usize = s.iter().product();
            (0..n)
                .flat_map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    // bf16 of a value in about [-0.06, 0.06]: sign, an
                    // exponent near 2^-5, seven random mantissa bits.
                    let bits = ((state >> 48) as u16 & 0x807f) | 0x3d00;
                    bits.to_le_bytes()
                })
                .collect()
        })
        .collect();
    let views: Vec<(&str, TensorView<'_>)> = shapes
        .iter()
        .zip(&data)
        .map(|((n, s), b)| {
            (
                n.as_str(),
                TensorView::new(Dtype::BF16, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--child") {
        child(&args[i + 1], Path::new(&args[i + 2]));
        return;
    }
    let layers = std::env::var("HANDOFF_BENCH_LAYERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    let mut c = ModelConfig::llama_3_2_1b_shape(layers);
    c.vocab_size = 32_000;
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(&c, dir.path());
    let file = std::fs::metadata(dir.path().join("model.safetensors"))
        .unwrap()
        .len();
    say(format!(
        "## loading a bf16 checkpoint (Llama-3.2-1B shape, {layers} layers, vocab 32000): {:.2} GB on disk",
        file as f64 / 1e9
    ));
    let exe = std::env::current_exe().unwrap();
    for round in 0..2 {
        for mode in ["whole", "placed"] {
            let out = Command::new(&exe)
                .args(["--child", mode])
                .arg(dir.path())
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            let mut nums = text
                .split_whitespace()
                .map(|v| v.parse::<u64>().unwrap_or(0));
            let (weights, peak) = (nums.next().unwrap_or(0), nums.next().unwrap_or(0));
            // The mapped file's pages count in RSS once read: clean page
            // cache the kernel can drop, unlike the weights themselves.
            say(format!(
                "round {round}, {mode:>6}: peak RSS {:.2} GB ({:.2} GB without the mapped file), placed weights {:.2} GB",
                peak as f64 / 1e9,
                peak.saturating_sub(file) as f64 / 1e9,
                weights as f64 / 1e9
            ));
        }
    }
}
