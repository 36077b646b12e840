//! Device sampling picks the tokens the host picks, proven without a GPU.
//!
//! On the CUDA backend the logits never leave the device: the kernel of
//! cuda/sampling.cuh chooses each row's token and only the ids cross to the
//! host. A request's seed must still mean the same tokens on either backend
//! for the same logits, so the kernel follows the host's rule
//! (src/sampling/row.rs) bit for bit: integer keys and weights, f64 steps
//! rounded one at a time. This story compiles the kernel body for the host
//! against the SIMT emulator (tests/support/sim/: one OS thread per CUDA
//! thread, barriers for __syncthreads and shuffles, shared-memory atomics)
//! and requires its token for every row to equal
//! `handoff::sampling::sample_row`'s: greedy, temperature alone, top-k,
//! top-p, both, over vocabularies from 1 to 3,000 with peaked, flat, tied
//! and extreme logits, draws that land exactly on a weight boundary, and
//! rows holding NaN or infinity (the row fails with the first culprit's
//! index and value, never a token). Block sizes 32, 64 and 256 run the same
//! body, so the block-wide reductions and scans are covered across warps.
//!
//! Without a C++ compiler the test prints `SKIP` and passes; the GPU test in
//! cuda_kernels.rs runs the same comparison on the device.

use std::path::Path;
use std::process::Command;

use handoff::SamplingParams;
use handoff::sampling::{Draw, SamplingError, sample_row, weight};

use crate::support::sim_host as host;

/// A SplitMix64 stream for test data.
pub(crate) struct Rng(pub u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub(crate) fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// One row: its logits and draw.
pub(crate) struct Row {
    pub logits: Vec<f32>,
    pub draw: Draw,
}

fn params(t: f32, k: Option<usize>, p: Option<f32>) -> SamplingParams {
    SamplingParams {
        temperature: t,
        top_k: k,
        top_p: p,
        ..SamplingParams::greedy()
    }
}

/// Rows over every parameter combination and logit shape the rule has a
/// branch for, `per_shape` draws each.
pub(crate) fn rows(vocabs: &[usize], per_shape: usize, seed: u64) -> Vec<Row> {
    let mut rng = Rng(seed);
    let mut out = Vec::new();
    let settings = [
        params(0.0, None, None),
        params(1.0, None, None),
        params(0.7, Some(40), None),
        params(1.3, None, Some(0.9)),
        params(0.8, Some(50), Some(0.95)),
        params(2.0, Some(3), Some(0.2)),
        params(1.0, Some(1), None),
        params(1e-30, None, Some(0.5)),
        params(f32::MAX, Some(7), None),
        params(1.0, None, Some(1e-7)),
    ];
    for &vocab in vocabs {
        for shape in 0..5 {
            let logits: Vec<f32> = (0..vocab)
                .map(|i| match shape {
                    // A few likely tokens over a wide tail.
                    0 => 3.0 * rng.unit() + if i % 97 == 5 { 9.0 } else { 0.0 },
                    // Flat: every weight counts.
                    1 => 0.01 * rng.unit(),
                    // Ties: ranks fall back to token ids.
                    2 => (rng.next() % 4) as f32,
                    // Extremes: a subtraction that overflows f32.
                    3 if i % 5 == 0 => f32::MAX,
                    3 => -f32::MAX,
                    // Signed zeros and tiny values.
                    _ => match i % 3 {
                        0 => 0.0,
                        1 => -0.0,
                        _ => 1e-30 * i as f32,
                    },
                })
                .collect();
            for s in 0..per_shape {
                let p = &settings[(s + shape * 3) % settings.len()];
                out.push(Row {
                    logits: logits.clone(),
                    draw: Draw::new(p, rng.next()).unwrap(),
                });
            }
        }
    }
    // Draws exactly on a boundary between two tokens' weights.
    let t1 = params(1.0, None, None);
    for r in [1u64 << 63, (1 << 63) - (1 << 11), u64::MAX, 0] {
        out.push(Row {
            logits: vec![1.0, 1.0],
            draw: Draw::new(&t1, r).unwrap(),
        });
    }
    // Rows the device must refuse: the first non-finite logit is named.
    for (at, bad) in [
        (0usize, f32::NAN),
        (17, f32::INFINITY),
        (63, f32::NEG_INFINITY),
    ] {
        let mut logits: Vec<f32> = (0..64).map(|i| i as f32 * 0.1).collect();
        logits[at] = bad;
        logits[63] = f32::NAN;
        for p in [params(0.0, None, None), params(1.0, Some(5), Some(0.9))] {
            out.push(Row {
                logits: logits.clone(),
                draw: Draw::new(&p, rng.next()).unwrap(),
            });
        }
    }
    out
}

fn encode(rows: &[Row]) -> Vec<u8> {
    let mut b = Vec::new();
    for r in rows {
        let d = &r.draw;
        b.extend((r.logits.len() as u32).to_le_bytes());
        b.extend(d.temperature().to_le_bytes());
        b.extend((d.top_k().unwrap_or(0) as u32).to_le_bytes());
        b.extend(d.top_p().to_le_bytes());
        b.extend(d.logprobs().map_or(0u32, |n| 1 + n as u32).to_le_bytes());
        b.extend(d.random().to_le_bytes());
        for l in &r.logits {
            b.extend(l.to_le_bytes());
        }
    }
    b
}

/// The host's answer for a row, as the device reports it: (status, token
/// or the culprit's bits).
pub(crate) fn host_answer(r: &Row) -> Result<u32, SamplingError> {
    sample_row(&r.logits, &r.draw, &mut Default::default())
}

/// The sum of every finite logit's weight against the row's largest, at
/// its temperature (1 when greedy): pins the weight function bit for bit.
fn host_weights(r: &Row) -> u64 {
    let finite = r.logits.iter().filter(|l| l.is_finite());
    let max = finite.clone().fold(f32::NEG_INFINITY, |m, &l| m.max(l));
    let t = match r.draw.temperature() {
        0.0 => 1.0,
        t => t,
    };
    finite.map(|&l| weight(l, max, t)).sum()
}

/// Runs the emulated sampler (`exe`) over `rows` with `block` threads per
/// block: each row's line of numbers (see sampling_main.cpp).
pub(crate) fn emulate(exe: &Path, dir: &Path, rows: &[Row], block: usize) -> Vec<Vec<u64>> {
    let input = dir.join(format!("rows_{block}.bin"));
    std::fs::write(&input, encode(rows)).unwrap();
    let run = Command::new(exe)
        .arg(&input)
        .arg(block.to_string())
        .output()
        .unwrap();
    assert!(run.status.success(), "emulator exited {}", run.status);
    let lines: Vec<Vec<u64>> = String::from_utf8_lossy(&run.stdout)
        .lines()
        .map(|l| l.split(' ').map(|x| x.parse().unwrap()).collect())
        .collect();
    assert_eq!(lines.len(), rows.len(), "one answer per row");
    lines
}

#[test]
fn device_sampling_on_a_simt_emulator_picks_the_hosts_tokens() {
    let test = "device_sampling_on_a_simt_emulator_picks_the_hosts_tokens";
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = host::emulated_or_skip(test, "sampling_main.cpp", dir.path()) else {
        return;
    };
    // Many rows on one warp; fewer, smaller ones on 2 and 8 warps (each
    // emulated thread is an OS thread).
    for (block, vocabs, per_shape) in [
        (32, &[1usize, 2, 31, 33, 100, 257, 1000, 3000][..], 3),
        (64, &[5, 64, 65, 500][..], 2),
        (256, &[3, 300][..], 1),
    ] {
        let rows = rows(vocabs, per_shape, 2026 + block as u64);
        let lines: Vec<(u32, u32, u64)> = emulate(&exe, dir.path(), &rows, block)
            .iter()
            .map(|l| (l[0] as u32, l[1] as u32, l[2]))
            .collect();
        assert_eq!(lines.len(), rows.len(), "one answer per row");
        let (mut sampled, mut refused) = (0, 0);
        for (i, (r, &(status, token, weights))) in rows.iter().zip(&lines).enumerate() {
            let what = format!(
                "block {block}, row {i}: vocab {}, {:?}",
                r.logits.len(),
                r.draw
            );
            assert_eq!(weights, host_weights(r), "{what}: the weights differ");
            match host_answer(r) {
                Ok(want) => {
                    assert_eq!((status, token), (0, want), "{what}");
                    sampled += 1;
                }
                Err(SamplingError::NonFinite { index, value }) => {
                    assert_eq!(status as usize, index + 1, "{what}");
                    assert_eq!(token, value.to_bits(), "{what}");
                    refused += 1;
                }
                Err(e) => panic!("{what}: the host refused the row: {e}"),
            }
        }
        assert!(sampled > 0 && refused > 0, "both outcomes ran");
    }
}
