//! Story: two prefill workers and two decode workers, every pair linked.
//!
//! Each decode worker holds a link to each prefill worker at once (one
//! `DecodeSide`, two links keyed by the prefill workers' ids) and takes the
//! links in turn for its requests; each prefill worker serves both decode
//! workers from one pool (a `PrefillSide` per link over that pool). Over the
//! in-process transport and over authenticated TCP with one worker key per
//! worker, every request's KV verifies byte for byte, each plan names the
//! prefill worker it went to, every link carries its share, no receipt is
//! refused as coming from the wrong peer, and all four pools end full.

use crate::support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use handoff::transfer::{
    DecodeLink, DecodeSide, InProcess, PeerId, PrefillLink, PrefillSide, TcpDecodeListener,
    TcpPrefill, Transfer, TransferConfig, TransferError, synthetic,
};
use handoff::{AdmissionLimits, KvPool, PoolConfig, RequestId};
use support::{geometry, request};

/// Requests each decode worker serves.
const PER_DECODE: u64 = 4;

fn pool() -> KvPool {
    KvPool::new(PoolConfig::new(geometry(handoff::KvDtype::BF16), 16, 16)).unwrap()
}

fn limits() -> AdmissionLimits {
    AdmissionLimits::new(64, 8, 16)
}

/// Runs the workload over `links[p][d]`, the link between prefill worker
/// `p` and decode worker `d`, each end with its worker's configuration.
fn two_by_two<P: PrefillLink + 'static, D: DecodeLink + 'static>(
    name: &str,
    links: [[(P, D); 2]; 2],
    prefill_cfgs: [TransferConfig; 2],
    decode_cfgs: [TransferConfig; 2],
) {
    let [[l00, l01], [l10, l11]] = links;
    let prefill_pools = [pool(), pool()];
    let decode_pools = [pool(), pool()];
    // Each prefill worker: one pool, a side per decode worker it serves.
    let mut prefills: Vec<(usize, PrefillSide<P>)> = Vec::new();
    let mut decodes: Vec<DecodeSide<D>> = Vec::new();
    let mut prefill_of: Vec<Option<PeerId>> = Vec::new();
    for (d, (first, second)) in [(l00, l10), (l01, l11)].into_iter().enumerate() {
        let (p0, d0) = first;
        let (p1, d1) = second;
        prefill_of.push(d0.peer());
        prefill_of.push(d1.peer());
        let mut side = DecodeSide::new(
            d0,
            decode_pools[d].clone(),
            limits(),
            decode_cfgs[d].clone(),
        );
        side.add_link(d1)
            .unwrap_or_else(|e| panic!("{name}: a second link: {e}"));
        assert_eq!(side.peers().len(), 2, "{name}");
        decodes.push(side);
        for (p, link) in [(0, p0), (1, p1)] {
            let side = PrefillSide::new(
                link,
                prefill_pools[p].clone(),
                limits(),
                prefill_cfgs[p].clone(),
            );
            prefills.push((p, side));
        }
    }
    for (d, side) in decodes.iter_mut().enumerate() {
        for i in 0..PER_DECODE {
            let id = 100 * (d as u64 + 1) + i;
            let _ = side
                .submit(request(id, 7 + d as u32, 24 + i as usize))
                .unwrap();
        }
    }
    let mut verified = Vec::new();
    let until = Instant::now() + support::DEADLINE;
    while verified.len() < 2 * PER_DECODE as usize {
        assert!(
            Instant::now() < until,
            "{name}: the workload did not finish"
        );
        for (_, side) in prefills.iter_mut() {
            match side.next_job_within(Duration::from_millis(2)) {
                Ok(mut job) => {
                    let (id, tokens) = (job.request(), job.plan().tokens as usize);
                    synthetic::fill(job.seq_mut(), id, tokens).unwrap();
                    side.complete(job, None).unwrap();
                }
                Err(TransferError::Timeout { .. }) => {}
                Err(e) => panic!("{name}: prefill: {e}"),
            }
        }
        for (d, side) in decodes.iter_mut().enumerate() {
            for outcome in side.poll(Duration::from_millis(2)) {
                let v = outcome
                    .result
                    .unwrap_or_else(|e| panic!("{name}: {}: {e}", outcome.request));
                assert_eq!(
                    synthetic::check(&decode_pools[d], v.seq(), outcome.request).unwrap(),
                    Ok(()),
                    "{name}: {} verified byte for byte",
                    outcome.request
                );
                verified.push(outcome.request);
            }
        }
    }
    verified.sort();
    let want: Vec<RequestId> = (0..2u64)
        .flat_map(|d| (0..PER_DECODE).map(move |i| RequestId(100 * (d + 1) + i)))
        .collect();
    assert_eq!(verified, want, "{name}");
    for side in &decodes {
        let s = side.stats();
        assert_eq!((s.planned, s.verified), (PER_DECODE, PER_DECODE), "{name}");
        assert_eq!(s.cross_peer_receipts_refused + s.integrity_failures, 0);
    }
    // Every link carried its share: the decode side took its links in turn.
    for (p, side) in &prefills {
        assert_eq!(side.stats().sent, PER_DECODE / 2, "{name}: prefill {p}");
    }
    let until = Instant::now() + support::DEADLINE;
    while !prefill_pools.iter().all(|p| p.stats().is_full()) {
        assert!(Instant::now() < until, "{name}: source pages still held");
        for (_, side) in prefills.iter_mut() {
            side.poll(Duration::from_millis(2)).unwrap();
        }
    }
    assert!(decode_pools.iter().all(|p| p.stats().is_full()), "{name}");
}

#[test]
fn two_prefill_and_two_decode_workers_in_process() {
    let cfg = TransferConfig::default();
    let link = || InProcess.connect(&cfg).unwrap();
    let links = [[link(), link()], [link(), link()]];
    two_by_two(
        "in-process",
        links,
        [cfg.clone(), cfg.clone()],
        [cfg.clone(), cfg.clone()],
    );
}

#[test]
fn two_prefill_and_two_decode_workers_over_authenticated_tcp() {
    // Four workers, each with its own key, all on one allowlist.
    let base = TransferConfig::default().with_auth_timeout(Duration::from_secs(5));
    let w = support::deployment(&base, 4);
    let (prefill_cfgs, decode_cfgs) = (
        [w[0].0.clone(), w[1].0.clone()],
        [w[2].0.clone(), w[3].0.clone()],
    );
    let decode_ids = [w[2].1, w[3].1];
    let listeners: Vec<TcpDecodeListener> = (0..2)
        .map(|_| TcpDecodeListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap())
        .collect();
    let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    // Prefill worker p dials decode worker d; decode worker d accepts, and
    // tells its two links apart by the peer each authenticated.
    let links = std::array::from_fn(|p| {
        std::array::from_fn(|d| {
            let dcfg = decode_cfgs[d].clone();
            let listener = &listeners[d];
            std::thread::scope(|s| {
                let accepted = s.spawn(move || listener.accept(&dcfg).unwrap());
                let prefill =
                    TcpPrefill::connect_to(addrs[d], &decode_ids[d], &prefill_cfgs[p]).unwrap();
                let decode = accepted.join().unwrap();
                assert_eq!(decode.peer(), Some(w[p].1));
                assert_eq!(prefill.peer(), Some(decode_ids[d]));
                (prefill, decode)
            })
        })
    });
    two_by_two("tcp+auth", links, prefill_cfgs.clone(), decode_cfgs.clone());
}
