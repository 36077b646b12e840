//! Story: a perfect receipt from the wrong prefill worker is refused.
//!
//! A decode worker holds authenticated links to two prefill workers of its
//! deployment, A and B, each with its own worker key on the allowlist. It
//! addresses a plan to A. A computes the KV, every byte of it lands in the
//! destination pages, and A writes the receipt, exact to the last checksum.
//! That receipt never reaches the decode worker from A: it turns up on B's
//! link instead (a compromised or confused worker that got hold of it; B is
//! authenticated, just not the worker the plan was addressed to).
//!
//! What happened: the decode worker checked who sent the receipt before
//! anything else. The plan was addressed to A, the receipt came from B: the
//! request failed with `IntegrityError::WrongPeer` (500), its destination
//! pages were scrubbed and freed without ever becoming readable, nothing was
//! generated from them, and `cross_peer_receipts_refused` counted it. A was
//! told the transfer failed and let go of its source pages. B's own link
//! kept working: the next plan addressed to B verified. Every pool ended
//! full.

use crate::support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use handoff::transfer::{
    DecodeLink, DecodeSide, InFlightStats, IntegrityError, LinkError, PeerId, PrefillLink,
    PrefillSide, TcpDecodeListener, TcpPrefill, ToDecode, ToPrefill, TransferConfig, TransferError,
    WriteBatch, synthetic,
};
use handoff::{AdmissionLimits, HttpStatus, KvPool, PoolConfig, RequestId};
use support::{geometry, request};

/// Prefill worker A's link, except that its receipts are kept back (for B
/// to send) instead of going out.
struct ReceiptsKeptBack {
    inner: TcpPrefill,
    kept: Arc<Mutex<Vec<ToDecode>>>,
}

impl PrefillLink for ReceiptsKeptBack {
    fn recv(&mut self, timeout: Duration) -> Result<Option<ToPrefill>, LinkError> {
        self.inner.recv(timeout)
    }
    fn write_kv(
        &mut self,
        batch: WriteBatch,
        src: &Arc<handoff::kv::KvSeq<handoff::kv::Held>>,
    ) -> Result<(), LinkError> {
        self.inner.write_kv(batch, src)
    }
    fn send(&mut self, msg: ToDecode) -> Result<(), LinkError> {
        match msg {
            ToDecode::Receipt(_) => {
                self.kept.lock().unwrap().push(msg);
                Ok(())
            }
            other => self.inner.send(other),
        }
    }
    fn in_flight(&self) -> InFlightStats {
        self.inner.in_flight()
    }
    fn peer(&self) -> Option<PeerId> {
        self.inner.peer()
    }
    fn close(&mut self) {
        self.inner.close();
    }
}

fn pool() -> KvPool {
    KvPool::new(PoolConfig::new(geometry(handoff::KvDtype::BF16), 16, 8)).unwrap()
}

fn limits() -> AdmissionLimits {
    AdmissionLimits::new(64, 8, 16)
}

#[test]
fn a_perfect_receipt_for_a_plan_addressed_to_a_arriving_from_b_is_refused_and_counted() {
    let base = TransferConfig::default().with_auth_timeout(Duration::from_secs(5));
    let workers = support::deployment(&base, 3);
    let [(cfg_a, a_id), (cfg_b, b_id), (cfg_d, d_id)] = [0, 1, 2].map(|i| workers[i].clone());

    // The decode worker accepts both prefill workers.
    let listener = TcpDecodeListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
    let addr = listener.local_addr().unwrap();
    let accepting = {
        let cfg = cfg_d.clone();
        std::thread::spawn(move || {
            let first = listener.accept(&cfg).unwrap();
            let second = listener.accept(&cfg).unwrap();
            (first, second)
        })
    };
    let link_a = TcpPrefill::connect_to(addr, &d_id, &cfg_a).unwrap();
    let mut link_b = TcpPrefill::connect_to(addr, &d_id, &cfg_b).unwrap();
    let (d1, d2) = accepting.join().unwrap();
    let (d_a, d_b) = if d1.peer() == Some(a_id) {
        (d1, d2)
    } else {
        (d2, d1)
    };
    assert_eq!((d_a.peer(), d_b.peer()), (Some(a_id), Some(b_id)));
    assert_eq!((link_a.peer(), link_b.peer()), (Some(d_id), Some(d_id)));

    let decode_pool = pool();
    let mut decode = DecodeSide::new(d_a, decode_pool.clone(), limits(), cfg_d.clone());
    assert_eq!(decode.add_link(d_b).unwrap(), b_id);
    let mut peers = decode.peers();
    peers.sort();
    let mut both = vec![a_id, b_id];
    both.sort();
    assert_eq!(peers, both);

    // A computes request 1's KV, addressed to it; its receipt is kept back.
    let kept = Arc::new(Mutex::new(Vec::new()));
    let pool_a = pool();
    let mut prefill_a = PrefillSide::new(
        ReceiptsKeptBack {
            inner: link_a,
            kept: kept.clone(),
        },
        pool_a.clone(),
        limits(),
        cfg_a,
    );
    let id = RequestId(1);
    let _ = decode.submit_to(request(1, 7, 40), &a_id).unwrap();
    let mut job = prefill_a.next_job().unwrap();
    assert_eq!(job.plan().peer, Some(a_id), "the plan names its addressee");
    let nonce = job.plan().nonce;
    synthetic::fill(job.seq_mut(), id, 40).unwrap();
    prefill_a.complete(job, None).unwrap();
    support::wait_until("A's receipt is written", || {
        std::thread::sleep(Duration::from_millis(2));
        !kept.lock().unwrap().is_empty()
    });
    let stolen = kept.lock().unwrap().pop().unwrap();
    assert!(matches!(&stolen, ToDecode::Receipt(r) if r.nonce == nonce));

    // The receipt arrives from B.
    link_b.send(stolen).unwrap();
    let mut outcomes = Vec::new();
    support::wait_until("the transfer ends", || {
        outcomes.extend(decode.poll(Duration::from_millis(20)));
        !outcomes.is_empty()
    });
    let outcome = outcomes.pop().unwrap();
    assert_eq!(outcome.request, id);
    let e = outcome.result.expect_err("nothing is generated from it");
    assert_eq!(
        e,
        TransferError::Integrity(IntegrityError::WrongPeer {
            request: id,
            nonce,
            planned: Some(a_id),
            got: Some(b_id),
        })
    );
    assert_eq!(e.http_status(), 500);
    let s = decode.stats();
    assert_eq!(s.cross_peer_receipts_refused, 1, "counted");
    assert_eq!((s.verified, s.integrity_failures), (0, 1));
    assert!(
        decode_pool.stats().is_full(),
        "the destination pages were scrubbed and freed, never readable"
    );
    // A is told its transfer failed, and lets go of its source pages.
    support::wait_until("A releases its source pages", || {
        prefill_a.poll(Duration::from_millis(20)).unwrap();
        pool_a.stats().is_full()
    });

    // B's own link still works: a plan addressed to B verifies.
    let pool_b = pool();
    let mut prefill_b = PrefillSide::new(link_b, pool_b.clone(), limits(), cfg_b);
    let id2 = RequestId(2);
    let _ = decode.submit_to(request(2, 8, 24), &b_id).unwrap();
    let mut job = prefill_b.next_job().unwrap();
    assert_eq!(job.plan().peer, Some(b_id));
    synthetic::fill(job.seq_mut(), id2, 24).unwrap();
    prefill_b.complete(job, None).unwrap();
    let mut outcomes = Vec::new();
    support::wait_until("B's transfer ends", || {
        outcomes.extend(decode.poll(Duration::from_millis(20)));
        !outcomes.is_empty()
    });
    let v = outcomes.pop().unwrap().result.expect("B's own KV verifies");
    assert_eq!(
        synthetic::check(&decode_pool, v.seq(), id2).unwrap(),
        Ok(())
    );
    drop(v);
    support::wait_until("B releases its source pages", || {
        prefill_b.poll(Duration::from_millis(20)).unwrap();
        pool_b.stats().is_full()
    });
    assert_eq!(decode.stats().cross_peer_receipts_refused, 1);
    assert!(decode_pool.stats().is_full() && pool_a.stats().is_full());
}
