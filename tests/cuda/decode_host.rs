//! Decode attention reads the right KV and only it, proven without a GPU.
//!
//! Both paged decode kernels, the scalar one of cuda/decode_attention.cuh
//! and the tensor-core one of cuda/decode_mma.cuh (with its cp.async
//! pipeline; four warps a block, and eight in the wide form), and their
//! split-KV merge run here on the host SIMT emulator
//! (tests/support/sim/: one OS thread per CUDA thread, barriers for
//! __syncthreads and shuffles, mma.sync and ldmatrix from the PTX fragment
//! layouts, async copies that land only at their wait) over scattered pages
//! of a two-layer arena, and every output must match an f64 reference
//! computed from the same KV bytes: f32 (scalar only), f16, bf16 and FP8
//! E4M3 KV (its tensor-core tiles widened to f16 in shared memory), head
//! dims 64 and 128 (and 8, 16, 256 scalar), GQA ratios 1 to 32 (past the
//! largest compiled group in head slices per KV head), pages of 16 and 64, one chunk, fixed
//! chunks and automatic splits. Every slot past a sequence's length in its
//! last page holds NaN, as a poison-scrubbed page would, and must not reach
//! an output. A NaN-poisoned K slot inside a sequence
//! turns exactly that sequence's heads of that KV head into NaN; a sequence
//! computes the same bits alone as beside others.
//!
//! Without a C++ compiler the test prints `SKIP` and passes; the GPU tests
//! in cuda_kernels.rs run the same kernels on the device.

use std::io::Write;
use std::process::Command;

use half::{bf16, f16};
use handoff::kv::F8E4M3;

use crate::sampling_host::Rng;
use crate::support::sim_host as host;

/// Uniform in [-1, 1).
fn signed(rng: &mut Rng) -> f32 {
    2.0 * rng.unit() - 1.0
}

#[derive(Clone, Copy, Debug)]
enum Dtype {
    F32,
    F16,
    Bf16,
    /// FP8 E4M3.
    F8,
}

#[derive(Clone, Copy, Debug)]
enum Split {
    /// Every chunk this many positions.
    Chunk(u32),
    /// Each sequence's chunks from its own length, at most this many.
    Auto(u32),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    Scalar,
    TensorCore,
    /// Eight warps a block.
    TensorCoreWide,
}

#[derive(Clone, Debug)]
struct Case {
    dtype: Dtype,
    head_dim: usize,
    kernel: Kernel,
    /// The instantiation's GROUP (scalar 1, 4 or 8; tensor-core 8 or 16).
    kgroup: u32,
    n_kv_heads: usize,
    group: usize,
    page_log2: u32,
    lens: Vec<u32>,
    split: Split,
    /// A NaN in K at (sequence, position, KV head).
    poison: Option<(usize, usize, usize)>,
}

const N_LAYERS: usize = 2;
const LAYER: usize = 1;

/// The inputs of one launch: the queries, and the KV as f32 (each element
/// exactly as stored), for the emulated program and the reference.
struct Inputs {
    q: Vec<f32>,
    kv: Vec<f32>,
    pages: Vec<Vec<u32>>,
    page_stride: usize,
}

fn build(c: &Case, rng: &mut Rng) -> Inputs {
    let (hd, kvh) = (c.head_dim, c.n_kv_heads);
    let n_heads = kvh * c.group;
    let kv_dim = kvh * hd;
    let page = 1usize << c.page_log2;
    let page_stride = N_LAYERS * 2 * page * kv_dim;
    let need: Vec<usize> = c
        .lens
        .iter()
        .map(|&l| (l as usize).div_ceil(page))
        .collect();
    let n_pages = need.iter().sum::<usize>() + 2;
    // Scattered pages: sequence b's pages are taken from the end backwards.
    let mut free: Vec<u32> = (0..n_pages as u32).collect();
    let pages: Vec<Vec<u32>> = need
        .iter()
        .map(|&n| (0..n).map(|_| free.pop().unwrap()).collect())
        .collect();
    let mut kv: Vec<f32> = (0..n_pages * page_stride)
        .map(|_| {
            let x = signed(rng);
            match c.dtype {
                Dtype::F32 => x,
                Dtype::F16 => f16::from_f32(x).to_f32(),
                Dtype::Bf16 => bf16::from_f32(x).to_f32(),
                Dtype::F8 => F8E4M3::from_f32(x).to_f32(),
            }
        })
        .collect();
    // The slots past each sequence's length in its last page hold NaN, as
    // a page scrubbed with the poison would: a kernel that lets one reach an
    // output (a zero weight times NaN is NaN) fails the reference check.
    for (b, seq_pages) in pages.iter().enumerate() {
        for t in c.lens[b] as usize..seq_pages.len() * page {
            let p = seq_pages[t >> c.page_log2] as usize;
            for kv_half in 0..2 {
                let at =
                    p * page_stride + ((LAYER * 2 + kv_half) * page + (t & (page - 1))) * kv_dim;
                kv[at..at + kv_dim].fill(f32::NAN);
            }
        }
    }
    if let Some((b, t, h)) = c.poison {
        let p = pages[b][t >> c.page_log2] as usize;
        let at = p * page_stride + ((LAYER * 2) * page + (t & (page - 1))) * kv_dim + h * hd + 3;
        kv[at] = f32::NAN;
    }
    let q: Vec<f32> = (0..c.lens.len() * n_heads * hd)
        .map(|_| signed(rng))
        .collect();
    Inputs {
        q,
        kv,
        pages,
        page_stride,
    }
}

/// The bytes the emulated program reads for `c` over `inp`.
fn encode(c: &Case, inp: &Inputs) -> Vec<u8> {
    let (hd, kvh) = (c.head_dim, c.n_kv_heads);
    let max_len = *c.lens.iter().max().unwrap();
    let (num_splits, chunk, auto) = match c.split {
        Split::Chunk(n) => (max_len.div_ceil(n), n, 0),
        Split::Auto(m) => (m.min(max_len.div_ceil(64)), 64, m),
    };
    let mut b = Vec::new();
    let u32s = |b: &mut Vec<u8>, xs: &[u32]| xs.iter().for_each(|x| b.extend(x.to_le_bytes()));
    let dtype = match c.dtype {
        Dtype::F32 => 0,
        Dtype::F16 => 1,
        Dtype::Bf16 => 2,
        Dtype::F8 => 3,
    };
    let kernel = match c.kernel {
        Kernel::Scalar => 0,
        Kernel::TensorCore => 1,
        Kernel::TensorCoreWide => 2,
    };
    u32s(&mut b, &[dtype, hd as u32, c.kgroup, kernel]);
    u32s(
        &mut b,
        &[
            c.lens.len() as u32,
            (kvh * c.group) as u32,
            kvh as u32,
            c.group as u32,
            LAYER as u32,
            c.page_log2,
            num_splits,
            chunk,
            auto,
        ],
    );
    let scale = std::f32::consts::LOG2_E / (hd as f32).sqrt();
    b.extend(scale.to_le_bytes());
    b.extend((inp.page_stride as u64).to_le_bytes());
    b.extend((inp.kv.len() as u64).to_le_bytes());
    inp.q.iter().for_each(|x| b.extend(x.to_le_bytes()));
    for &x in &inp.kv {
        match c.dtype {
            Dtype::F32 => b.extend(x.to_le_bytes()),
            Dtype::F16 => b.extend(f16::from_f32(x).to_le_bytes()),
            Dtype::Bf16 => b.extend(bf16::from_f32(x).to_le_bytes()),
            Dtype::F8 => b.push(F8E4M3::from_f32(x).0),
        }
    }
    let mut indptr = vec![0u32];
    for p in &inp.pages {
        indptr.push(indptr.last().unwrap() + p.len() as u32);
    }
    u32s(&mut b, &indptr);
    u32s(&mut b, &inp.pages.concat());
    u32s(&mut b, &c.lens);
    b
}

/// Softmax(q·k / sqrt(d)) v in f64 for head `h` of sequence `b`.
fn reference(c: &Case, inp: &Inputs, b: usize, h: usize) -> Vec<f64> {
    let (hd, kv_dim) = (c.head_dim, c.n_kv_heads * c.head_dim);
    let n_heads = c.n_kv_heads * c.group;
    let page = 1usize << c.page_log2;
    let kvh = h / c.group;
    let q = &inp.q[(b * n_heads + h) * hd..][..hd];
    let at = |t: usize, kv: usize| {
        let p = inp.pages[b][t >> c.page_log2] as usize;
        p * inp.page_stride + ((LAYER * 2 + kv) * page + (t & (page - 1))) * kv_dim + kvh * hd
    };
    let len = c.lens[b] as usize;
    let scores: Vec<f64> = (0..len)
        .map(|t| {
            let k = &inp.kv[at(t, 0)..][..hd];
            q.iter()
                .zip(k)
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum::<f64>()
                / (hd as f64).sqrt()
        })
        .collect();
    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
    let z: f64 = w.iter().sum();
    (0..hd)
        .map(|d| {
            (0..len)
                .map(|t| w[t] * inp.kv[at(t, 1) + d] as f64)
                .sum::<f64>()
                / z
        })
        .collect()
}

fn run(exe: &std::path::Path, dir: &std::path::Path, c: &Case, inp: &Inputs) -> Vec<f32> {
    let path = dir.join("decode.bin");
    std::fs::write(&path, encode(c, inp)).unwrap();
    let out = Command::new(exe).arg(&path).output().unwrap();
    assert!(out.status.success(), "emulator exited {}", out.status);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| f32::from_bits(l.parse().unwrap()))
        .collect()
}

fn case(dtype: Dtype, head_dim: usize, kgroup: u32, group: usize, page_log2: u32) -> Case {
    Case {
        dtype,
        head_dim,
        kernel: Kernel::Scalar,
        kgroup,
        n_kv_heads: 2,
        group,
        page_log2,
        lens: vec![37, 150, 1],
        split: Split::Chunk(1024),
        poison: None,
    }
}

/// Runs every case on the emulator and checks each output element against
/// the f64 reference within `tol`.
fn check_against_reference(test: &str, cases: &[Case], tol: f64) {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = host::emulated_or_skip(test, "decode_main.cpp", dir.path()) else {
        return;
    };
    let mut rng = Rng(2026);
    for c in cases {
        let inp = build(c, &mut rng);
        let got = run(&exe, dir.path(), c, &inp);
        let n_heads = c.n_kv_heads * c.group;
        assert_eq!(got.len(), c.lens.len() * n_heads * c.head_dim);
        let mut worst = 0.0f64;
        for b in 0..c.lens.len() {
            for h in 0..n_heads {
                let want = reference(c, &inp, b, h);
                let row = &got[(b * n_heads + h) * c.head_dim..][..c.head_dim];
                for (d, (&g, &w)) in row.iter().zip(&want).enumerate() {
                    let err = (g as f64 - w).abs();
                    assert!(err <= tol, "{c:?}: seq {b} head {h} dim {d}: {g} vs {w}");
                    worst = worst.max(err);
                }
            }
        }
        let _ = writeln!(std::io::stderr(), "PASS {c:?}: worst error {worst:.2e}");
    }
}

#[test]
fn decode_attention_on_a_simt_emulator_matches_an_f64_reference() {
    let cases = [
        case(Dtype::F32, 64, 1, 1, 4),
        case(Dtype::F16, 128, 4, 4, 4),
        Case {
            split: Split::Chunk(64),
            ..case(Dtype::Bf16, 64, 4, 3, 6)
        },
        Case {
            split: Split::Auto(4),
            ..case(Dtype::Bf16, 128, 8, 8, 4)
        },
        // A ratio of 16: the group-8 kernel in two slices per KV head.
        Case {
            split: Split::Auto(4),
            ..case(Dtype::F16, 64, 8, 16, 4)
        },
        Case {
            split: Split::Chunk(32),
            ..case(Dtype::F32, 128, 8, 12, 6)
        },
        // 130 chunks of 2 positions: the merge weighs its splits in groups
        // of 128 (one per thread), so this takes a second group.
        Case {
            split: Split::Chunk(2),
            lens: vec![37, 260, 1],
            ..case(Dtype::F32, 256, 1, 1, 4)
        },
        // FP8 KV: 16-byte loads of 16 elements (head_dim 128 and 64), one
        // 16-byte load a row (16), and an 8-byte load a row (8).
        Case {
            split: Split::Auto(4),
            ..case(Dtype::F8, 128, 8, 8, 4)
        },
        Case {
            split: Split::Chunk(64),
            ..case(Dtype::F8, 64, 4, 3, 6)
        },
        case(Dtype::F8, 16, 1, 2, 0),
        Case {
            split: Split::Chunk(40),
            ..case(Dtype::F8, 8, 4, 4, 4)
        },
    ];
    check_against_reference(
        "decode_attention_on_a_simt_emulator_matches_an_f64_reference",
        &cases,
        2e-6,
    );
}

/// A tensor-core case: `kgroup` 8 or 16.
fn mma(dtype: Dtype, head_dim: usize, kgroup: u32, group: usize, page_log2: u32) -> Case {
    Case {
        kernel: Kernel::TensorCore,
        ..case(dtype, head_dim, kgroup, group, page_log2)
    }
}

#[test]
fn both_tensor_core_decodes_with_their_copy_pipelines_match_an_f64_reference() {
    // 700 positions in one chunk: 44 tiles, 11 per warp (5 or 6 of eight),
    // so every warp's three stages are reused several times (the emulator
    // lands a copy only at its wait: a stage read too early is NaN); 37
    // positions leave warps without a tile, which add nothing.
    let long = vec![37, 700, 1];
    let cases = [
        Case {
            lens: long.clone(),
            ..mma(Dtype::Bf16, 128, 8, 8, 4)
        },
        Case {
            lens: long.clone(),
            ..mma(Dtype::F16, 64, 8, 4, 6)
        },
        // FP8: four stages of bytes, each tile widened to f16 in shared
        // memory; every stage reused, pages of one position, two octets.
        Case {
            lens: long,
            ..mma(Dtype::F8, 128, 8, 8, 4)
        },
        Case {
            split: Split::Chunk(48),
            ..mma(Dtype::F8, 64, 8, 2, 0)
        },
        Case {
            split: Split::Auto(4),
            ..mma(Dtype::F8, 128, 16, 16, 6)
        },
        // Ratio 1 and 3: padding heads computed, not written; pages of
        // one position (every row of a tile from another page).
        Case {
            split: Split::Chunk(64),
            ..mma(Dtype::Bf16, 64, 8, 1, 0)
        },
        Case {
            split: Split::Chunk(40),
            ..mma(Dtype::F16, 128, 8, 3, 4)
        },
        // Two octets, and a ratio of 32 in two slices of 16.
        Case {
            split: Split::Auto(4),
            ..mma(Dtype::Bf16, 128, 16, 12, 6)
        },
        Case {
            split: Split::Auto(4),
            ..mma(Dtype::F16, 64, 16, 32, 4)
        },
    ];
    let test = "both_tensor_core_decodes_with_their_copy_pipelines_match_an_f64_reference";
    check_against_reference(test, &cases, 2e-6);
    check_against_reference(test, &cases.map(wide), 2e-6);
}

/// `c` on the wide tensor-core kernel (eight warps a block).
fn wide(c: Case) -> Case {
    Case {
        kernel: Kernel::TensorCoreWide,
        ..c
    }
}

#[test]
fn a_poisoned_slot_is_nan_in_its_heads_only_and_batch_mates_change_no_bit() {
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = host::emulated_or_skip(
        "a_poisoned_slot_is_nan_in_its_heads_only_and_batch_mates_change_no_bit",
        "decode_main.cpp",
        dir.path(),
    ) else {
        return;
    };
    // Each kernel with a ratio of 16 in its largest group (two slices of 8
    // for the scalar kernel, one block of two octets for tensor cores).
    for base in [
        case(Dtype::Bf16, 64, 8, 16, 4),
        case(Dtype::F8, 64, 8, 16, 4),
        mma(Dtype::Bf16, 64, 16, 16, 4),
        mma(Dtype::F8, 128, 16, 16, 4),
        wide(mma(Dtype::Bf16, 64, 16, 16, 4)),
    ] {
        poisoned_heads_only(&exe, dir.path(), base.clone());
        alone_equals_batched(&exe, dir.path(), base);
    }
}

/// Poison: sequence 1, position 100, KV head 1, automatic splits: every
/// head of KV head 1 in sequence 1 is NaN, nothing else is.
fn poisoned_heads_only(exe: &std::path::Path, dir: &std::path::Path, base: Case) {
    let c = Case {
        split: Split::Auto(4),
        poison: Some((1, 100, 1)),
        ..base
    };
    let got = run(exe, dir, &c, &build(&c, &mut Rng(7)));
    let n_heads = c.n_kv_heads * c.group;
    for b in 0..c.lens.len() {
        for h in 0..n_heads {
            let row = &got[(b * n_heads + h) * c.head_dim..][..c.head_dim];
            let poisoned = b == 1 && h / c.group == 1;
            assert_eq!(
                row.iter().all(|x| x.is_nan()),
                poisoned,
                "{:?}: seq {b} head {h}: {:?}",
                c.kernel,
                &row[..4]
            );
            assert!(poisoned || row.iter().all(|x| x.is_finite()));
        }
    }
}

/// Batch invariance: sequence 0 of three, then alone on the same pages
/// with the same query, automatic splits: the same bits.
fn alone_equals_batched(exe: &std::path::Path, dir: &std::path::Path, base: Case) {
    let batched = Case {
        split: Split::Auto(4),
        lens: vec![150, 300, 5],
        dtype: match base.dtype {
            Dtype::F8 => Dtype::F8,
            _ => Dtype::F16,
        },
        group: 4,
        ..base
    };
    let all = build(&batched, &mut Rng(11));
    let per_seq = batched.n_kv_heads * batched.group * batched.head_dim;
    let alone = Case {
        lens: vec![150],
        ..batched.clone()
    };
    let first = Inputs {
        q: all.q[..per_seq].to_vec(),
        kv: all.kv.clone(),
        pages: all.pages[..1].to_vec(),
        page_stride: all.page_stride,
    };
    let gb = run(exe, dir, &batched, &all);
    let ga = run(exe, dir, &alone, &first);
    assert!(
        ga.iter()
            .zip(&gb[..per_seq])
            .all(|(x, y)| x.to_bits() == y.to_bits()),
        "{:?}: sequence 0 alone and batched differ",
        batched.kernel
    );
}
