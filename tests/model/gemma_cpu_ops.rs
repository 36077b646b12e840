//! The CPU backend's Gemma ops agree with the definitions: sliding-window
//! attention (prefill and decode, across tiles and pages, in f32 and f16
//! pages) with a dense f64 reference that masks positions older than the
//! window, GELU (tanh) gating, soft-capping and scaling; and a window that
//! covers the whole context gives full attention's bits.

use handoff::backend::{AttnShape, Backend, BackendError, CpuBackend, Isa, SeqSpan};
use handoff::kv::{Filling, KvSeq};
use handoff::{KvDtype, KvGeometry, KvPool, PoolConfig, RequestId};

fn data(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        })
        .collect()
}

fn backends() -> Vec<CpuBackend> {
    Isa::available()
        .into_iter()
        .flat_map(|isa| [1, 2].map(|t| CpuBackend::with_isa(t, isa).unwrap()))
        .collect()
}

/// Dense f64 attention of one query row at `pos` over positions
/// `pos + 1 - window ..= pos`.
fn windowed(
    q: &[f32],
    ks: &[Vec<f32>],
    vs: &[Vec<f32>],
    pos: usize,
    window: usize,
    s: AttnShape,
) -> Vec<f64> {
    let hd = s.head_dim;
    let g = s.n_heads / s.n_kv_heads;
    let lo = (pos + 1).saturating_sub(window);
    let mut out = vec![0f64; s.q_dim()];
    for h in 0..s.n_heads {
        let kh = h / g;
        let sc: Vec<f64> = (lo..=pos)
            .map(|t| {
                (0..hd)
                    .map(|i| f64::from(q[h * hd + i]) * f64::from(ks[t][kh * hd + i]))
                    .sum::<f64>()
                    / (hd as f64).sqrt()
            })
            .collect();
        let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
        let sum: f64 = e.iter().sum();
        for i in 0..hd {
            out[h * hd + i] = (lo..=pos)
                .zip(&e)
                .map(|(t, w)| w / sum * f64::from(vs[t][kh * hd + i]))
                .sum();
        }
    }
    out
}

#[test]
fn windowed_attention_matches_a_dense_masked_reference_in_prefill_and_decode() {
    let shape = AttnShape {
        n_heads: 4,
        n_kv_heads: 1,
        head_dim: 32,
    };
    let (qd, kvd) = (shape.q_dim(), shape.kv_dim());
    // 150 positions: three 64-position tiles, windows that start inside a
    // tile, span tiles, equal one position, and cover everything.
    let lens = [150usize, 37];
    let total: usize = lens.iter().sum();
    let (k, v, q) = (
        data(total * kvd, 1),
        data(total * kvd, 2),
        data(total * qd, 3),
    );
    for (dtype, page) in [(KvDtype::F32, 4), (KvDtype::F32, 16), (KvDtype::F16, 16)] {
        let geometry = KvGeometry {
            n_layers: 1,
            n_kv_heads: 1,
            head_dim: 32,
            dtype,
        };
        let pool = KvPool::new(PoolConfig::new(geometry, page, 64)).unwrap();
        let mut seqs: Vec<KvSeq<Filling>> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| pool.reserve(RequestId(i as u64), n).unwrap())
            .collect();
        let spans = [
            SeqSpan {
                first_row: 0,
                rows: lens[0],
                first_pos: 0,
            },
            SeqSpan {
                first_row: lens[0],
                rows: lens[1],
                first_pos: 0,
            },
        ];
        let round = |x: f32| match dtype {
            KvDtype::F16 => half::f16::from_f32(x).to_f32(),
            _ => x,
        };
        for b in backends() {
            for (seq, sp) in seqs.iter_mut().zip(&spans) {
                if seq.written_per_layer()[0] == 0 {
                    b.kv_append(seq, 0, &k, &v, sp.row_range()).unwrap();
                }
            }
            let reader = pool.reader();
            let views: Vec<_> = seqs
                .iter()
                .map(|s| reader.seq(s).unwrap().layer(0).unwrap())
                .collect();
            let mut full = Vec::new();
            b.attention_prefill(&q, &views, &spans, shape, &mut full)
                .unwrap();
            for window in [1usize, 5, 64, 70, 150, 1000] {
                let mut out = Vec::new();
                b.attention_prefill_window(&q, &views, &spans, shape, window, &mut out)
                    .unwrap();
                for sp in &spans {
                    let rows = |buf: &[f32]| -> Vec<Vec<f32>> {
                        sp.row_range()
                            .map(|r| {
                                buf[r * kvd..(r + 1) * kvd]
                                    .iter()
                                    .map(|&x| round(x))
                                    .collect()
                            })
                            .collect()
                    };
                    let (ks, vs) = (rows(&k), rows(&v));
                    for r in sp.row_range() {
                        let pos = r - sp.first_row;
                        let want = windowed(&q[r * qd..(r + 1) * qd], &ks, &vs, pos, window, shape);
                        for (i, (&a, &w)) in out[r * qd..(r + 1) * qd].iter().zip(&want).enumerate()
                        {
                            assert!(
                                (f64::from(a) - w).abs() <= 1e-5 * (1.0 + w.abs()),
                                "window {window}, row {r}, element {i}: {a} vs {w}"
                            );
                        }
                    }
                }
                // Decode: each sequence's newest query, the bits of its
                // prefill row.
                let last: Vec<f32> = spans
                    .iter()
                    .flat_map(|sp| {
                        let r = sp.first_row + sp.rows - 1;
                        q[r * qd..(r + 1) * qd].to_vec()
                    })
                    .collect();
                let mut dec = Vec::new();
                b.attention_decode_window(&last, &views, shape, window, &mut dec)
                    .unwrap();
                for (i, sp) in spans.iter().enumerate() {
                    let r = sp.first_row + sp.rows - 1;
                    assert_eq!(
                        dec[i * qd..(i + 1) * qd],
                        out[r * qd..(r + 1) * qd],
                        "window {window}"
                    );
                }
                // A window over the whole context is full attention, bit
                // for bit.
                if window >= lens[0] {
                    assert_eq!(out, full, "window {window}");
                }
            }
            let mut out = Vec::new();
            assert!(matches!(
                b.attention_prefill_window(&q, &views, &spans, shape, 0, &mut out),
                Err(BackendError::Shape { .. })
            ));
        }
    }
}

#[test]
fn gelu_gating_soft_capping_and_scaling_match_their_definitions() {
    let b = CpuBackend::with_threads(1);
    let g0: Vec<f32> = data(64, 7).iter().map(|x| x * 6.0).collect();
    let up = data(64, 8);
    let mut g = g0.clone();
    b.gelu_glu(&mut g, &up).unwrap();
    for ((&got, &x), &u) in g.iter().zip(&g0).zip(&up) {
        let x = f64::from(x);
        let c = (2.0 / std::f64::consts::PI).sqrt();
        let want = 0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh()) * f64::from(u);
        assert!(
            (f64::from(got) - want).abs() <= 1e-5 * (1.0 + want.abs()),
            "{got} vs {want}"
        );
    }
    assert!(b.gelu_glu(&mut g, &up[..3].to_vec()).is_err());
    let mut x = g0.clone();
    b.softcap(&mut x, 2.5).unwrap();
    for (&got, &x0) in x.iter().zip(&g0) {
        let want = 2.5 * (f64::from(x0) / 2.5).tanh();
        assert!((f64::from(got) - want).abs() <= 1e-6, "{got} vs {want}");
        assert!(got.abs() <= 2.5);
    }
    let mut x = g0.clone();
    b.scale(&mut x, 0.5).unwrap();
    assert!(x.iter().zip(&g0).all(|(a, b)| *a == b * 0.5));
}

/// A backend that has not said it runs Gemma: the CPU backend's required
/// ops, none of Gemma's.
struct PlainBackend(CpuBackend);

impl Backend for PlainBackend {
    type Buf = Vec<f32>;
    type Mat = handoff::backend::cpu::CpuMat;
    fn name(&self) -> &'static str {
        "plain"
    }
    fn upload(&self, d: Vec<f32>, r: usize, c: usize) -> Result<Self::Mat, BackendError> {
        self.0.upload(d, r, c)
    }
    fn shape(&self, m: &Self::Mat) -> (usize, usize) {
        self.0.shape(m)
    }
    fn len(&self, b: &Vec<f32>) -> usize {
        b.len()
    }
    fn to_host(&self, b: &Vec<f32>, out: &mut Vec<f32>) -> Result<(), BackendError> {
        self.0.to_host(b, out)
    }
    fn embed(&self, t: &Self::Mat, tok: &[u32], out: &mut Vec<f32>) -> Result<(), BackendError> {
        self.0.embed(t, tok, out)
    }
    fn rms_norm(
        &self,
        x: &Vec<f32>,
        w: &Self::Mat,
        eps: f32,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        self.0.rms_norm(x, w, eps, out)
    }
    fn matmul(&self, x: &Vec<f32>, w: &Self::Mat, out: &mut Vec<f32>) -> Result<(), BackendError> {
        self.0.matmul(x, w, out)
    }
    fn add_bias(&self, x: &mut Vec<f32>, b: &Self::Mat) -> Result<(), BackendError> {
        self.0.add_bias(x, b)
    }
    fn add_assign(&self, x: &mut Vec<f32>, y: &Vec<f32>) -> Result<(), BackendError> {
        self.0.add_assign(x, y)
    }
    fn rope(
        &self,
        x: &mut Vec<f32>,
        p: &[usize],
        r: handoff::backend::Rope,
    ) -> Result<(), BackendError> {
        self.0.rope(x, p, r)
    }
    fn swiglu(&self, g: &mut Vec<f32>, u: &Vec<f32>) -> Result<(), BackendError> {
        self.0.swiglu(g, u)
    }
    fn gather_rows(
        &self,
        x: &Vec<f32>,
        cols: usize,
        rows: &[usize],
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        self.0.gather_rows(x, cols, rows, out)
    }
    fn kv_append<S: handoff::kv::Writable>(
        &self,
        seq: &mut KvSeq<S>,
        layer: usize,
        k: &Vec<f32>,
        v: &Vec<f32>,
        rows: std::ops::Range<usize>,
    ) -> Result<(), BackendError> {
        self.0.kv_append(seq, layer, k, v, rows)
    }
    fn attention_prefill(
        &self,
        q: &Vec<f32>,
        kv: &[handoff::kv::LayerView<'_>],
        spans: &[SeqSpan],
        shape: AttnShape,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        self.0.attention_prefill(q, kv, spans, shape, out)
    }
    fn attention_decode(
        &self,
        q: &Vec<f32>,
        kv: &[handoff::kv::LayerView<'_>],
        shape: AttnShape,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        self.0.attention_decode(q, kv, shape, out)
    }
}

#[test]
fn a_backend_that_has_not_said_it_runs_gemma_refuses_it_at_load() {
    // As the CUDA backend does: Gemma's ops default to a refusal, and the
    // model is refused when placed, before any request is admitted.
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tiny_gemma3");
    let gemma = std::path::Path::new(dir).join("model.gguf");
    match handoff::model::Model::load(PlainBackend(CpuBackend::with_threads(1)), &gemma) {
        Err(handoff::model::ModelError::Unsupported { backend, source }) => {
            assert_eq!(backend, "plain");
            assert!(source.to_string().contains("Gemma 3"), "{source}");
        }
        other => panic!("expected a refusal, got {:?}", other.map(|_| ())),
    }
    // The same backend serves a Qwen3 file: only Gemma is refused.
    let qwen = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/tiny_qwen3/model.gguf"
    );
    handoff::model::Model::load(
        PlainBackend(CpuBackend::with_threads(1)),
        std::path::Path::new(qwen),
    )
    .unwrap();
    let mut x = vec![1.0f32];
    assert!(matches!(
        PlainBackend(CpuBackend::with_threads(1)).scale(&mut x, 2.0),
        Err(BackendError::Unsupported { .. })
    ));
}
