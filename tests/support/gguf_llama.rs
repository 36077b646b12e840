//! A small valid Llama GGUF (Q8_0 and Q4_1 matrices, f32 norms, a Q8_0
//! embedding that is also the output head), written here: the malformed-file
//! stories damage one thing of it, and the GPU stories run it quantized.

use handoff::model::gguf::{GgmlType, GgufArray, GgufValue, GgufWriter};

pub const DIM: u64 = 64;
pub const HIDDEN: u64 = 128;
pub const VOCAB: u64 = 96;
pub const KV_DIM: u64 = 32;

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 1000) as f32 / 5000.0 - 0.1
        })
        .collect()
}

pub fn f16(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

fn q8_0(x: &[f32]) -> Vec<u8> {
    x.chunks(32)
        .flat_map(|b| {
            let d = b.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
            let mut out = f16(d).to_vec();
            out.extend(
                b.iter()
                    .map(|v| (if d > 0.0 { (v / d).round() } else { 0.0 }) as i8 as u8),
            );
            out
        })
        .collect()
}

fn q4_1(x: &[f32]) -> Vec<u8> {
    x.chunks(32)
        .flat_map(|b| {
            let lo = b.iter().copied().fold(f32::INFINITY, f32::min);
            let hi = b.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let d = (hi - lo) / 15.0;
            let q = |v: f32| {
                if d > 0.0 {
                    ((v - lo) / d).round().clamp(0.0, 15.0) as u8
                } else {
                    0
                }
            };
            let mut out = f16(d).to_vec();
            out.extend(f16(lo));
            out.extend((0..16).map(|j| q(b[j]) | (q(b[j + 16]) << 4)));
            out
        })
        .collect()
}

/// The valid file's metadata and tensors, for cases to edit.
pub struct Parts {
    pub kv: Vec<(String, GgufValue)>,
    pub tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
}

impl Parts {
    pub fn valid() -> Self {
        let s = |v: &str| GgufValue::String(v.into());
        let kv = vec![
            ("general.architecture".to_string(), s("llama")),
            ("llama.block_count".into(), GgufValue::U32(2)),
            ("llama.embedding_length".into(), GgufValue::U32(DIM as u32)),
            (
                "llama.feed_forward_length".into(),
                GgufValue::U32(HIDDEN as u32),
            ),
            ("llama.attention.head_count".into(), GgufValue::U32(4)),
            ("llama.attention.head_count_kv".into(), GgufValue::U32(2)),
            ("llama.context_length".into(), GgufValue::U32(256)),
            ("llama.rope.freq_base".into(), GgufValue::F32(10000.0)),
            (
                "llama.attention.layer_norm_rms_epsilon".into(),
                GgufValue::F32(1e-5),
            ),
            (
                "tokenizer.ggml.tokens".into(),
                GgufValue::Array(GgufArray::String(
                    (0..VOCAB).map(|i| format!("t{i}")).collect(),
                )),
            ),
        ];
        let mut tensors = Vec::new();
        let mut seed = 0;
        let mut add = |name: String, dims: Vec<u64>, ty: GgmlType| {
            seed += 1;
            let n = dims.iter().product::<u64>() as usize;
            let v = values(n, seed);
            let bytes = match ty {
                GgmlType::Q8_0 => q8_0(&v),
                GgmlType::Q4_1 => q4_1(&v),
                _ => v
                    .iter()
                    .map(|x| x + 1.0)
                    .flat_map(f32::to_le_bytes)
                    .collect(),
            };
            tensors.push((name, dims, ty.id(), bytes));
        };
        add("token_embd.weight".into(), vec![DIM, VOCAB], GgmlType::Q8_0);
        for l in 0..2 {
            let n = |t: &str| format!("blk.{l}.{t}.weight");
            add(n("attn_norm"), vec![DIM], GgmlType::F32);
            add(n("attn_q"), vec![DIM, DIM], GgmlType::Q4_1);
            add(n("attn_k"), vec![DIM, KV_DIM], GgmlType::Q4_1);
            add(n("attn_v"), vec![DIM, KV_DIM], GgmlType::Q8_0);
            add(n("attn_output"), vec![DIM, DIM], GgmlType::Q4_1);
            add(n("ffn_norm"), vec![DIM], GgmlType::F32);
            add(n("ffn_gate"), vec![DIM, HIDDEN], GgmlType::Q4_1);
            add(n("ffn_down"), vec![HIDDEN, DIM], GgmlType::Q8_0);
            add(n("ffn_up"), vec![DIM, HIDDEN], GgmlType::Q4_1);
        }
        add("output_norm.weight".into(), vec![DIM], GgmlType::F32);
        Parts { kv, tensors }
    }

    pub fn kv(mut self, key: &str, v: GgufValue) -> Self {
        match self.kv.iter_mut().find(|(k, _)| k == key) {
            Some(e) => e.1 = v,
            None => self.kv.push((key.into(), v)),
        }
        self
    }

    pub fn tensor(
        mut self,
        name: &str,
        edit: impl FnOnce(&mut Vec<u64>, &mut u32, &mut Vec<u8>),
    ) -> Self {
        let t = self.tensors.iter_mut().find(|t| t.0 == name).unwrap();
        edit(&mut t.1, &mut t.2, &mut t.3);
        self
    }

    pub fn bytes(self) -> Vec<u8> {
        let mut w = GgufWriter::new();
        for (k, v) in self.kv {
            w = w.kv(&k, v);
        }
        for (n, d, ty, b) in self.tensors {
            w = w.tensor_raw(&n, &d, ty, b);
        }
        w.finish()
    }
}
