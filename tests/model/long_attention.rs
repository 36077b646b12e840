//! Attention over contexts of many position tiles (the CPU backend merges
//! tiles of 64 positions with an online softmax, and splits a decode
//! row's tiles over its threads): close to a float64 reference at f32 KV,
//! and the same bits whatever the page size, the thread count, the batch,
//! the prefill chunking, and whether a row came from prefill or decode.

use handoff::backend::{AttnShape, Backend, CpuBackend, Isa, SeqSpan};
use handoff::kv::{Filling, KvSeq};
use handoff::{KvDtype, KvGeometry, KvPool, PoolConfig, RequestId};

fn data(n: usize, seed: u32, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(747796405).wrapping_add(1);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(1664525).wrapping_add(1013904223);
            ((s >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// Row `pos`'s attention over rows `0..=pos` of `k`/`v`, in float64.
fn reference(q: &[f32], k: &[f32], v: &[f32], pos: usize, s: AttnShape) -> Vec<f32> {
    let (hd, kvd) = (s.head_dim, s.kv_dim());
    let g = s.n_heads / s.n_kv_heads;
    let mut out = vec![0f32; s.q_dim()];
    for h in 0..s.n_heads {
        let ko = (h / g) * hd;
        let scores: Vec<f64> = (0..=pos)
            .map(|t| {
                (0..hd)
                    .map(|i| q[h * hd + i] as f64 * k[t * kvd + ko + i] as f64)
                    .sum::<f64>()
                    / (hd as f64).sqrt()
            })
            .collect();
        let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
        let sum: f64 = e.iter().sum();
        for i in 0..hd {
            out[h * hd + i] = ((0..=pos)
                .map(|t| e[t] / sum * v[t * kvd + ko + i] as f64)
                .sum::<f64>()) as f32;
        }
    }
    out
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

const LENS: [usize; 5] = [1, 64, 65, 130, 333];

/// For one backend and page size: every sequence of `LENS` prefilled
/// whole (one batch), then prefilled again in chunks of 50 rows, then
/// decoded once each (one batch); returns the whole prefill's rows, the
/// chunked prefill's rows and the decode rows.
fn run(
    b: &CpuBackend,
    shape: AttnShape,
    dtype: KvDtype,
    page: usize,
    k: &[f32],
    v: &[f32],
    q: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (qd, kvd) = (shape.q_dim(), shape.kv_dim());
    let geometry = KvGeometry {
        n_layers: 1,
        n_kv_heads: shape.n_kv_heads,
        head_dim: shape.head_dim,
        dtype,
    };
    let max = LENS.iter().max().copied().unwrap_or(1);
    let pool = KvPool::new(PoolConfig::new(
        geometry,
        page,
        LENS.len() * max.div_ceil(page),
    ))
    .unwrap();
    let mut seqs: Vec<KvSeq<Filling>> = (0..LENS.len())
        .map(|i| pool.reserve(RequestId(i as u64), max).unwrap())
        .collect();
    for (seq, &len) in seqs.iter_mut().zip(&LENS) {
        seq.append(0, &k[..len * kvd], &v[..len * kvd]).unwrap();
    }
    let reader = pool.reader();
    let views: Vec<_> = seqs
        .iter()
        .map(|s| reader.seq(s).unwrap().layer(0).unwrap())
        .collect();
    // Whole prompts, one batch: sequence i's rows are q's first LENS[i].
    let mut spans = Vec::new();
    let mut rows = Vec::new();
    for &len in &LENS {
        spans.push(SeqSpan {
            first_row: rows.len() / qd,
            rows: len,
            first_pos: 0,
        });
        rows.extend_from_slice(&q[..len * qd]);
    }
    let mut whole = Vec::new();
    b.attention_prefill(&rows, &views, &spans, shape, &mut whole)
        .unwrap();
    // Chunks of 50 rows, one sequence per call.
    let mut chunked = Vec::new();
    for (view, &len) in views.iter().zip(&LENS) {
        for c0 in (0..len).step_by(50) {
            let n = (len - c0).min(50);
            let span = [SeqSpan {
                first_row: 0,
                rows: n,
                first_pos: c0,
            }];
            let mut o = Vec::new();
            b.attention_prefill(
                &q[c0 * qd..(c0 + n) * qd].to_vec(),
                std::slice::from_ref(view),
                &span,
                shape,
                &mut o,
            )
            .unwrap();
            chunked.extend_from_slice(&o);
        }
    }
    // Decode: each sequence's last query against all its positions.
    let last: Vec<f32> = LENS
        .iter()
        .flat_map(|&len| q[(len - 1) * qd..len * qd].to_vec())
        .collect();
    let mut dec = Vec::new();
    b.attention_decode(&last, &views, shape, &mut dec).unwrap();
    drop(views);
    drop(seqs);
    assert!(pool.stats().is_full());
    (whole, chunked, dec)
}

#[test]
fn long_context_attention_is_exact_and_invariant() {
    let shapes = [
        // SmolLM2-135M's heads: a block of eight and one more, three groups.
        (9, 3, 64),
        // The head_dim-8 kernel's layouts.
        (16, 4, 8),
        (8, 8, 8),
        (4, 2, 12),
    ];
    for (nh, nkv, hd) in shapes {
        let shape = AttnShape {
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
        };
        let (qd, kvd) = (shape.q_dim(), shape.kv_dim());
        let max = LENS.iter().max().copied().unwrap_or(1);
        let k = data(max * kvd, 21, 1.0);
        let v = data(max * kvd, 22, 1.0);
        // Large queries: peaked scores whose maxima differ between tiles.
        let q = data(max * qd, 23, 6.0);
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::BF16] {
            for isa in Isa::available() {
                let mut first: Option<(Vec<u32>, Vec<u32>)> = None;
                for (threads, page) in [(1, 16), (2, 16), (2, 4), (1, 128), (2, 64)] {
                    let b = CpuBackend::with_isa(threads, isa)
                        .unwrap()
                        .min_parallel_work(1);
                    let (whole, chunked, dec) = run(&b, shape, dtype, page, &k, &v, &q);
                    let what = format!("{nh}/{nkv}x{hd} {dtype:?} {isa:?} {threads}t page {page}");
                    assert_eq!(bits(&whole), bits(&chunked), "chunked prefill, {what}");
                    // The decode row of each sequence is its last prefill row.
                    let mut end = 0;
                    for (i, &len) in LENS.iter().enumerate() {
                        end += len;
                        assert_eq!(
                            bits(&dec[i * qd..(i + 1) * qd]),
                            bits(&whole[(end - 1) * qd..end * qd]),
                            "decode of {len}, {what}"
                        );
                    }
                    assert!(whole.iter().all(|x| x.is_finite()), "{what}");
                    let got = (bits(&whole), bits(&dec));
                    match &first {
                        None => first = Some(got),
                        Some(f) => assert!(*f == got, "threads and pages change bits, {what}"),
                    }
                    if dtype == KvDtype::F32 && threads == 1 && page == 16 {
                        // Against float64, every 7th row of the longest.
                        let start = (LENS.iter().sum::<usize>() - max) * qd;
                        for pos in (0..max).step_by(7) {
                            let want = reference(&q[pos * qd..(pos + 1) * qd], &k, &v, pos, shape);
                            let row = &whole[start + pos * qd..start + (pos + 1) * qd];
                            for (x, y) in row.iter().zip(&want) {
                                assert!(
                                    (x - y).abs() <= 2e-5 * (1.0 + y.abs()),
                                    "row {pos}: {x} vs {y}, {what}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn avx2_and_avx512_give_the_same_long_context_bits() {
    let avail = Isa::available();
    if !(avail.contains(&Isa::Avx2Fma) && avail.contains(&Isa::Avx512)) {
        let _ =
            std::io::Write::write_all(&mut std::io::stderr(), b"skipped: this CPU lacks AVX-512\n");
        return;
    }
    let shape = AttnShape {
        n_heads: 9,
        n_kv_heads: 3,
        head_dim: 64,
    };
    let max = LENS.iter().max().copied().unwrap_or(1);
    let k = data(max * shape.kv_dim(), 31, 1.0);
    let v = data(max * shape.kv_dim(), 32, 1.0);
    let q = data(max * shape.q_dim(), 33, 6.0);
    let a = CpuBackend::with_isa(2, Isa::Avx2Fma).unwrap();
    let b = CpuBackend::with_isa(2, Isa::Avx512).unwrap();
    let ra = run(&a, shape, KvDtype::F16, 16, &k, &v, &q);
    let rb = run(&b, shape, KvDtype::F16, 16, &k, &v, &q);
    assert_eq!(bits(&ra.0), bits(&rb.0));
    assert_eq!(bits(&ra.2), bits(&rb.2));
}
