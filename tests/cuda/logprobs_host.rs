//! Device log-probabilities report what the host reports, proven without a
//! GPU.
//!
//! A request that asks for log-probabilities on the CUDA backend gets them
//! from `row_logprobs` (cuda/sampling.cuh), run after `sample_rows` on the
//! same buffer, so they cross to the host in the step's one download. This
//! story runs both kernel bodies on the host SIMT emulator over the rows of
//! the sampling story (peaked, flat, tied, extreme and signed-zero logits,
//! vocabularies of 1 to 3,000, block sizes 32, 64 and 256), each row asking
//! for 0, 1, 5 or 20 alternatives, and requires the host's
//! `token_logprobs`: the same alternatives in the same order (ranks are
//! integer keys, exact), and each value within about an f32 ulp (the f64
//! sum of exponentials is reduced in another order). A row that failed to
//! sample reports none.
//!
//! Without a C++ compiler the test prints `SKIP` and passes.

use handoff::SamplingParams;
use handoff::sampling::{Draw, token_logprobs};

use crate::sampling_host::{Row, emulate, host_answer, rows};
use crate::support::sim_host as host;

/// The same rows, each asking for `asks[i % 4]` alternatives.
fn asking(rows: Vec<Row>) -> Vec<Row> {
    let asks = [0u8, 1, 5, 20];
    rows.into_iter()
        .enumerate()
        .map(|(i, r)| {
            let d = r.draw;
            let p = SamplingParams {
                temperature: d.temperature(),
                top_k: d.top_k(),
                top_p: (d.top_p() < 1.0).then_some(d.top_p()),
                logprobs: Some(asks[i % 4]),
                ..SamplingParams::greedy()
            };
            Row {
                logits: r.logits,
                draw: Draw::new(&p, d.random()).unwrap(),
            }
        })
        .collect()
}

fn close(device: f32, host: f32) -> bool {
    device == host || (device - host).abs() <= 2e-7 * host.abs().max(1.0)
}

#[test]
fn device_log_probabilities_on_a_simt_emulator_match_the_hosts() {
    let test = "device_log_probabilities_on_a_simt_emulator_match_the_hosts";
    let dir = tempfile::tempdir().unwrap();
    let Some(exe) = host::emulated_or_skip(test, "sampling_main.cpp", dir.path()) else {
        return;
    };
    let (mut checked, mut alternatives, mut refused) = (0, 0, 0);
    for (block, vocabs) in [
        (32, &[1usize, 2, 21, 100, 1000, 3000][..]),
        (64, &[5, 64, 500][..]),
        (256, &[3, 300][..]),
    ] {
        let rows = asking(rows(vocabs, 2, 77 + block as u64));
        let lines = emulate(&exe, dir.path(), &rows, block);
        for (i, (r, line)) in rows.iter().zip(&lines).enumerate() {
            let what = format!(
                "block {block}, row {i}: vocab {}, {:?}",
                r.logits.len(),
                r.draw
            );
            let Ok(token) = host_answer(r) else {
                assert_eq!(
                    line.len(),
                    3,
                    "{what}: a failed row reports no log-probabilities"
                );
                refused += 1;
                continue;
            };
            let n = r.draw.logprobs().unwrap() as usize;
            let want = token_logprobs(&r.logits, token, n);
            let lp = &line[3..];
            assert_eq!(lp.len(), 1 + 2 * want.top.len(), "{what}: {lp:?}");
            let value = |bits: u64| f32::from_bits(bits as u32);
            assert!(
                close(value(lp[0]), want.logprob),
                "{what}: token {token}: {} vs {}",
                value(lp[0]),
                want.logprob
            );
            for (j, &(id, x)) in want.top.iter().enumerate() {
                assert_eq!(lp[1 + 2 * j] as u32, id, "{what}: alternative {j}");
                let got = value(lp[2 + 2 * j]);
                assert!(close(got, x), "{what}: alternative {j}: {got} vs {x}");
                alternatives += 1;
            }
            checked += 1;
        }
    }
    assert!(
        checked > 0 && alternatives > 0 && refused > 0,
        "every case ran"
    );
}
