//! Every CPU backend op agrees with a naive reference written from the
//! definition (f64 where it matters), and refuses inconsistent shapes with a
//! typed error instead of computing on them.

use handoff::backend::{AttnShape, Backend, BackendError, CpuBackend, Isa, Rope, SeqSpan};
use handoff::kv::{Filling, KvSeq};
use handoff::model::{RopeScaling, RopeStyle};
use handoff::{KvDtype, KvGeometry, KvPool, PoolConfig, RequestId};

fn data(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(747796405).wrapping_add(1);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(1664525).wrapping_add(1013904223);
            (s >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0
        })
        .collect()
}

fn close(a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= tol * (1.0 + y.abs()),
            "element {i}: {x} vs {y}"
        );
    }
}

/// Every instruction set this CPU has, single- and multi-threaded.
fn backends() -> Vec<CpuBackend> {
    Isa::available()
        .into_iter()
        .flat_map(|isa| [1, 2].map(|t| CpuBackend::with_isa(t, isa).unwrap()))
        .collect()
}

#[test]
fn matmul_matches_the_definition_serial_and_parallel() {
    for b in backends() {
        // Small (serial) and large enough to be split over threads.
        for (m, k, n) in [(1, 9, 5), (3, 64, 37), (1, 512, 700), (33, 96, 130)] {
            let x = data(m * k, 1);
            let w = data(n * k, 2);
            let wm = b.upload(w.clone(), n, k).unwrap();
            let mut out = Vec::new();
            b.matmul(&x, &wm, &mut out).unwrap();
            let mut want = vec![0f32; m * n];
            for i in 0..m {
                for j in 0..n {
                    want[i * n + j] = (0..k)
                        .map(|t| x[i * k + t] as f64 * w[j * k + t] as f64)
                        .sum::<f64>() as f32;
                }
            }
            close(&out, &want, 1e-5);
        }
    }
}

#[test]
fn matmul_rows_are_bit_identical_alone_or_batched() {
    for b in backends() {
        let (m, k, n) = (40, 128, 300);
        let x = data(m * k, 3);
        let w = b.upload(data(n * k, 4), n, k).unwrap();
        let mut all = Vec::new();
        b.matmul(&x, &w, &mut all).unwrap();
        for i in [0, 17, 39] {
            let mut one = Vec::new();
            b.matmul(&x[i * k..(i + 1) * k].to_vec(), &w, &mut one)
                .unwrap();
            assert_eq!(one, all[i * n..(i + 1) * n]);
        }
    }
}

#[test]
fn embed_gathers_rows_and_refuses_unknown_tokens() {
    let b = CpuBackend::with_threads(1);
    let table = data(10 * 4, 5);
    let t = b.upload(table.clone(), 10, 4).unwrap();
    let mut out = Vec::new();
    b.embed(&t, &[3, 0, 9], &mut out).unwrap();
    assert_eq!(out[..4], table[12..16]);
    assert_eq!(out[4..8], table[..4]);
    assert_eq!(out[8..], table[36..]);
    assert_eq!(
        b.embed(&t, &[10], &mut out),
        Err(BackendError::TokenOutOfRange {
            token: 10,
            vocab: 10
        })
    );
}

#[test]
fn rms_norm_matches_the_definition() {
    let b = CpuBackend::with_threads(1);
    let (rows, d) = (3, 20);
    let x = data(rows * d, 6);
    let w = data(d, 7);
    let wm = b.upload(w.clone(), 1, d).unwrap();
    let mut out = Vec::new();
    b.rms_norm(&x, &wm, 1e-5, &mut out).unwrap();
    for r in 0..rows {
        let row = &x[r * d..(r + 1) * d];
        let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / d as f64;
        let inv = 1.0 / (ms + 1e-5).sqrt();
        let want: Vec<f32> = (0..d)
            .map(|i| (row[i] as f64 * inv * w[i] as f64) as f32)
            .collect();
        close(&out[r * d..(r + 1) * d], &want, 1e-5);
    }
    assert!(matches!(
        b.rms_norm(&x[..7].to_vec(), &wm, 1e-5, &mut out),
        Err(BackendError::Shape { .. })
    ));
}

/// Rotates `x` (`[positions.len(), heads, hd]`) with `rope` and checks
/// every pair against the definition at frequency `freq(i)`.
fn check_rope(
    b: &CpuBackend,
    x: &[f32],
    positions: &[usize],
    rope: Rope,
    freq: &dyn Fn(usize) -> f64,
) {
    let (heads, hd) = (rope.n_heads, rope.head_dim);
    let mut y = x.to_vec();
    b.rope(&mut y, positions, rope).unwrap();
    for (r, &pos) in positions.iter().enumerate() {
        for h in 0..heads {
            let base = (r * heads + h) * hd;
            for i in 0..hd / 2 {
                let (a, c) = match rope.style {
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    RopeStyle::Half => (i, i + hd / 2),
                };
                let ang = pos as f64 * freq(i);
                let (x0, x1) = (x[base + a] as f64, x[base + c] as f64);
                let w0 = x0 * ang.cos() - x1 * ang.sin();
                let w1 = x0 * ang.sin() + x1 * ang.cos();
                close(&[y[base + a], y[base + c]], &[w0 as f32, w1 as f32], 1e-5);
            }
        }
    }
}

#[test]
fn rope_rotates_the_right_pairs_in_both_conventions() {
    let b = CpuBackend::with_threads(1);
    let (heads, hd) = (3, 8);
    let positions = [0usize, 5, 300];
    let x = data(positions.len() * heads * hd, 8);
    let rope = |style| Rope {
        n_heads: heads,
        head_dim: hd,
        theta: 10_000.0,
        style,
        scaling: RopeScaling::None,
    };
    for style in [RopeStyle::Interleaved, RopeStyle::Half] {
        check_rope(&b, &x, &positions, rope(style), &|i| {
            1.0 / 10_000f64.powf(2.0 * i as f64 / hd as f64)
        });
    }
    let mut y = x.clone();
    assert!(
        b.rope(&mut y, &positions[..2], rope(RopeStyle::Half))
            .is_err(),
        "one position per row"
    );
}

/// Llama 3.1's scaling, written out from its definition: each pair's
/// wavelength `2*pi/f` decides whether its frequency `f` is kept (shorter
/// than `old/high`), divided by `factor` (longer than `old/low`), or blended
/// linearly in `old/wavelength` between the two.
fn llama3_freq(theta: f64, i: usize, hd: usize, factor: f64, low: f64, high: f64, old: f64) -> f64 {
    let f = 1.0 / theta.powf((2 * i) as f64 / hd as f64);
    let wavelength = 2.0 * std::f64::consts::PI / f;
    let (short, long) = (old / high, old / low);
    if wavelength < short {
        f
    } else if wavelength > long {
        f / factor
    } else {
        let t = (old / wavelength - low) / (high - low);
        t * f + (1.0 - t) * (f / factor)
    }
}

#[test]
fn scaled_rope_rotates_by_the_scaled_frequencies() {
    let b = CpuBackend::with_threads(1);
    let (heads, hd, theta) = (2, 16, 1000.0);
    let positions = [0usize, 3, 31, 200, 70_000];
    let x = data(positions.len() * heads * hd, 12);
    let llama3 = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position: 32,
    };
    let cases: [(RopeScaling, &dyn Fn(usize) -> f64); 3] = [
        (RopeScaling::None, &|i| {
            1.0 / 1000f64.powf((2 * i) as f64 / hd as f64)
        }),
        (RopeScaling::Linear { factor: 4.0 }, &|i| {
            1.0 / 1000f64.powf((2 * i) as f64 / hd as f64) / 4.0
        }),
        (llama3, &|i| llama3_freq(1000.0, i, hd, 8.0, 1.0, 4.0, 32.0)),
    ];
    // The Llama 3 case takes each of its three branches at this shape.
    let branches: Vec<f64> = (0..hd / 2)
        .map(|i| llama3_freq(1000.0, i, hd, 8.0, 1.0, 4.0, 32.0) / cases[0].1(i))
        .collect();
    assert_eq!(branches[0], 1.0, "kept");
    assert!(branches[1] > 1.0 / 8.0 && branches[1] < 1.0, "blended");
    assert!(
        branches[2..].iter().all(|&r| (r - 0.125).abs() < 1e-12),
        "divided"
    );

    for style in [RopeStyle::Interleaved, RopeStyle::Half] {
        for (scaling, freq) in &cases {
            let rope = Rope {
                n_heads: heads,
                head_dim: hd,
                theta,
                style,
                scaling: *scaling,
            };
            check_rope(&b, &x, &positions, rope, *freq);
        }
    }
}

#[test]
fn swiglu_bias_residual_and_gather_match_the_definition() {
    let b = CpuBackend::with_threads(1);
    let g = data(12, 9);
    let u = data(12, 10);
    let mut out = g.clone();
    b.swiglu(&mut out, &u).unwrap();
    let want: Vec<f32> = g
        .iter()
        .zip(&u)
        .map(|(&g, &u)| (g as f64 / (1.0 + (-g as f64).exp()) * u as f64) as f32)
        .collect();
    close(&out, &want, 1e-6);

    let bias = data(4, 11);
    let bm = b.upload(bias.clone(), 1, 4).unwrap();
    let mut x = g.clone();
    b.add_bias(&mut x, &bm).unwrap();
    for i in 0..12 {
        assert_eq!(x[i], g[i] + bias[i % 4]);
    }
    let mut x = g.clone();
    b.add_assign(&mut x, &u).unwrap();
    for i in 0..12 {
        assert_eq!(x[i], g[i] + u[i]);
    }
    let mut rows = Vec::new();
    b.gather_rows(&g, 4, &[2, 0], &mut rows).unwrap();
    assert_eq!(rows[..4], g[8..12]);
    assert_eq!(rows[4..], g[..4]);
    assert!(b.gather_rows(&g, 4, &[3], &mut rows).is_err());
    assert!(b.add_assign(&mut x, &u[..5].to_vec()).is_err());
}

/// Dense reference attention for one query row at position `pos`.
fn naive_attention(
    q: &[f32],
    ks: &[Vec<f32>],
    vs: &[Vec<f32>],
    pos: usize,
    s: AttnShape,
) -> Vec<f32> {
    let hd = s.head_dim;
    let g = s.n_heads / s.n_kv_heads;
    let mut out = vec![0f32; s.q_dim()];
    for h in 0..s.n_heads {
        let kh = h / g;
        let scores: Vec<f64> = (0..=pos)
            .map(|t| {
                (0..hd)
                    .map(|i| q[h * hd + i] as f64 * ks[t][kh * hd + i] as f64)
                    .sum::<f64>()
                    / (hd as f64).sqrt()
            })
            .collect();
        let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
        let sum: f64 = e.iter().sum();
        for i in 0..hd {
            out[h * hd + i] = ((0..=pos)
                .map(|t| e[t] / sum * vs[t][kh * hd + i] as f64)
                .sum::<f64>()) as f32;
        }
    }
    out
}

fn geometry(shape: AttnShape, dtype: KvDtype) -> KvGeometry {
    KvGeometry {
        n_layers: 2,
        n_kv_heads: shape.n_kv_heads,
        head_dim: shape.head_dim,
        dtype,
    }
}

#[test]
fn kv_append_and_paged_attention_match_dense_attention() {
    // Head layouts that take every kernel path: fewer than eight heads,
    // blocks of eight, a remainder, MQA, and head dims that are not a
    // multiple of eight.
    // Real-model head dims (32, 64): several chunks per head, and value
    // blocks inside one head.
    for (h, kvh, hd) in [
        (4, 2, 8),
        (8, 4, 8),
        (12, 4, 16),
        (16, 1, 12),
        (8, 8, 4),
        (8, 2, 64),
        (16, 4, 32),
    ] {
        let shape = AttnShape {
            n_heads: h,
            n_kv_heads: kvh,
            head_dim: hd,
        };
        attention_matches_dense(shape);
    }
}

fn attention_matches_dense(shape: AttnShape) {
    // Page size 16 puts eight or more positions in a page (the blocked
    // score loop), 4 fewer.
    for (dtype, page_size) in [
        (KvDtype::F32, 4),
        (KvDtype::F16, 4),
        (KvDtype::F32, 16),
        (KvDtype::F8E4M3, 16),
    ] {
        for b in backends() {
            let pool = KvPool::new(PoolConfig::new(geometry(shape, dtype), page_size, 64)).unwrap();
            // Two sequences of different lengths, prefilled in one batch.
            let lens = [11usize, 6];
            let total: usize = lens.iter().sum();
            let k = data(total * shape.kv_dim(), 12);
            let v = data(total * shape.kv_dim(), 13);
            let q = data(total * shape.q_dim(), 14);
            let mut seqs: Vec<KvSeq<Filling>> = (0..2)
                .map(|i| pool.reserve(RequestId(i), 20).unwrap())
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
            for (seq, sp) in seqs.iter_mut().zip(&spans) {
                b.kv_append(seq, 1, &k, &v, sp.row_range()).unwrap();
            }
            // What was stored (after the dtype round trip) is the reference.
            let round = |x: f32| match dtype {
                KvDtype::F16 => half::f16::from_f32(x).to_f32(),
                KvDtype::F8E4M3 => handoff::kv::F8E4M3::from_f32(x).to_f32(),
                _ => x,
            };
            let rows = |buf: &[f32], sp: &SeqSpan| -> Vec<Vec<f32>> {
                sp.row_range()
                    .map(|r| {
                        buf[r * shape.kv_dim()..(r + 1) * shape.kv_dim()]
                            .iter()
                            .map(|&x| round(x))
                            .collect()
                    })
                    .collect()
            };
            let reader = pool.reader();
            let views: Vec<_> = seqs
                .iter()
                .map(|s| reader.seq(s).unwrap().layer(1).unwrap())
                .collect();
            let mut out = Vec::new();
            b.attention_prefill(&q, &views, &spans, shape, &mut out)
                .unwrap();
            for sp in &spans {
                let (ks, vs) = (rows(&k, sp), rows(&v, sp));
                for r in sp.row_range() {
                    let pos = r - sp.first_row;
                    let want = naive_attention(
                        &q[r * shape.q_dim()..(r + 1) * shape.q_dim()],
                        &ks,
                        &vs,
                        pos,
                        shape,
                    );
                    close(
                        &out[r * shape.q_dim()..(r + 1) * shape.q_dim()],
                        &want,
                        1e-5,
                    );
                }
            }
            // Decode: one query per sequence against everything written,
            // equal to the last prefill row of each sequence.
            let last: Vec<f32> = spans
                .iter()
                .flat_map(|sp| {
                    let r = sp.first_row + sp.rows - 1;
                    q[r * shape.q_dim()..(r + 1) * shape.q_dim()].to_vec()
                })
                .collect();
            let mut dec = Vec::new();
            b.attention_decode(&last, &views, shape, &mut dec).unwrap();
            for (i, sp) in spans.iter().enumerate() {
                let r = sp.first_row + sp.rows - 1;
                assert_eq!(
                    dec[i * shape.q_dim()..(i + 1) * shape.q_dim()],
                    out[r * shape.q_dim()..(r + 1) * shape.q_dim()]
                );
            }
            // A span asking for positions the sequence has not written is
            // refused, not served from whatever the page holds.
            let long = [SeqSpan {
                first_row: 0,
                rows: 12,
                first_pos: 0,
            }];
            let q12 = q[..12 * shape.q_dim()].to_vec();
            assert!(matches!(
                b.attention_prefill(&q12, &views[..1], &long, shape, &mut out),
                Err(BackendError::KvNotWritten {
                    needed: 12,
                    written: 11,
                    ..
                })
            ));
            drop(views);
            // Writes stop at the reservation.
            let mut small = pool.reserve(RequestId(9), page_size).unwrap();
            assert!(matches!(
                b.kv_append(&mut small, 0, &k, &v, 0..page_size + 1),
                Err(BackendError::Kv(_))
            ));
            drop((seqs, small));
            assert!(pool.stats().is_full());
        }
    }
}

#[test]
fn a_pass_append_names_the_sequence_at_fault_and_writes_nothing() {
    let shape = AttnShape {
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 8,
    };
    let kvd = shape.kv_dim();
    let pool = KvPool::new(PoolConfig::new(geometry(shape, KvDtype::F32), 4, 16)).unwrap();
    let other = KvPool::new(PoolConfig::new(geometry(shape, KvDtype::F32), 4, 4)).unwrap();
    let (k, v) = (data(10 * kvd, 1), data(10 * kvd, 2));
    let span = |first_row, rows| SeqSpan {
        first_row,
        rows,
        first_pos: 0,
    };
    for b in backends() {
        let mut a = pool.reserve(RequestId(1), 4).unwrap();
        let mut c = pool.reserve(RequestId(2), 4).unwrap();
        // c asks for 6 rows with 4 reserved.
        let err = b
            .kv_append_each(&mut [&mut a, &mut c], 0, &k, &v, &[span(0, 3), span(3, 6)])
            .unwrap_err();
        assert!(matches!(err, (1, BackendError::Kv(_))), "{err:?}");
        // A row range past the activations names its sequence too.
        let err = b
            .kv_append_each(&mut [&mut a, &mut c], 0, &k, &v, &[span(0, 3), span(8, 3)])
            .unwrap_err();
        assert!(matches!(err, (1, BackendError::Shape { .. })), "{err:?}");
        // A sequence of another pool is refused by position.
        let mut f = other.reserve(RequestId(3), 4).unwrap();
        let err = b
            .kv_append_each(&mut [&mut a, &mut f], 0, &k, &v, &[span(0, 3), span(3, 2)])
            .unwrap_err();
        assert!(matches!(err, (1, BackendError::Kv(_))), "{err:?}");
        assert_eq!((a.written(0), c.written(0), f.written(0)), (0, 0, 0));
        b.kv_append_each(&mut [&mut a, &mut c], 0, &k, &v, &[span(0, 3), span(3, 4)])
            .unwrap();
        assert_eq!((a.written(0), c.written(0)), (3, 4));
        drop((a, c, f));
        assert!(pool.stats().is_full() && other.stats().is_full());
    }
}

#[test]
fn logits_are_norm_then_projection_of_the_chosen_rows() {
    let b = CpuBackend::with_threads(1);
    let (d, vocab) = (8, 11);
    let x = data(3 * d, 15);
    let norm = b.upload(data(d, 16), 1, d).unwrap();
    let w = data(vocab * d, 17);
    let wm = b.upload(w, vocab, d).unwrap();
    let (mut t1, mut t2, mut out) = (Vec::new(), Vec::new(), Vec::new());
    b.logits(&x, &[2], &norm, 1e-5, &wm, &mut t1, &mut t2, &mut out)
        .unwrap();
    let (mut n, mut want) = (Vec::new(), Vec::new());
    b.rms_norm(&x[2 * d..].to_vec(), &norm, 1e-5, &mut n)
        .unwrap();
    b.matmul(&n, &wm, &mut want).unwrap();
    assert_eq!(out, want);
}
