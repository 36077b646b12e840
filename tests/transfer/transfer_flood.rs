//! Story: a flood of strangers at the decode end's port does not keep the
//! real prefill peer out, and a prefill end only ever holds a link the
//! decode end accepted.
//!
//! Eight threads of strangers open silent connections to a decode
//! listener as fast as it takes them (each holding a bounded number open,
//! for a bounded time, on loopback), far past its budget of connections in
//! progress per source, while the real prefill peer connects. Twenty times
//! over, the peer gets in, its link carries a transfer that verifies, and
//! the listener records strangers it displaced (none of them ever a
//! handshake in progress). And a prefill end whose decode end completes
//! the key exchange but never accepts the link, or never even answers, gets
//! a typed error within its handshake deadline instead of a link that
//! never carries a plan.

use crate::support;

use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use handoff::transfer::testing::peers::NeverAccepts;
use handoff::transfer::{
    AuthError, DecodeSide, LinkError, PrefillSide, Tcp, TcpDecodeListener, TcpPrefill,
    TransferConfig,
};
use handoff::{AdmissionLimits, HttpStatus, KvPool, PoolConfig, RequestId};
use support::{Rig, geometry, request};

/// Stranger threads.
const THREADS: usize = 8;
/// Connections each stranger thread holds open at once, at most.
const HELD: usize = 32;
/// Connections each stranger thread opens in a round, at most.
const OPENED: usize = 2_000;
/// How long a round's flood lasts, at most.
const FLOOD_FOR: Duration = Duration::from_secs(8);

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// Eight threads opening silent connections to `addr` until told to stop,
/// each holding at most [`HELD`] open and opening at most [`OPENED`], for
/// at most [`FLOOD_FOR`].
struct Flood {
    stop: Arc<AtomicBool>,
    opened: Arc<AtomicUsize>,
    threads: Vec<JoinHandle<()>>,
}

impl Flood {
    fn start(addr: SocketAddr) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let opened = Arc::new(AtomicUsize::new(0));
        let t0 = Instant::now();
        let threads = (0..THREADS)
            .map(|_| {
                let (stop, opened) = (stop.clone(), opened.clone());
                std::thread::spawn(move || {
                    let mut held = std::collections::VecDeque::new();
                    let mut n = 0;
                    while !stop.load(Ordering::Relaxed) && n < OPENED && t0.elapsed() < FLOOD_FOR {
                        if let Ok(s) = TcpStream::connect(addr) {
                            n += 1;
                            opened.fetch_add(1, Ordering::Relaxed);
                            held.push_back(s);
                        }
                        if held.len() > HELD {
                            held.pop_front();
                            // Past the first wave, a connection every
                            // millisecond per thread: far more than the
                            // listener's budget, without starving the
                            // two cores it shares.
                            std::thread::sleep(Duration::from_millis(1));
                        }
                    }
                })
            })
            .collect();
        Flood {
            stop,
            opened,
            threads,
        }
    }

    fn opened(&self) -> usize {
        self.opened.load(Ordering::Relaxed)
    }

    fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            t.join().unwrap();
        }
    }
}

fn rig(
    prefill: TcpPrefill,
    decode: handoff::transfer::TcpDecode,
    pcfg: &TransferConfig,
    dcfg: &TransferConfig,
) -> Rig<Tcp> {
    let g = geometry(handoff::KvDtype::BF16);
    let prefill_pool = KvPool::new(PoolConfig::new(g, 16, 8)).unwrap();
    let decode_pool = KvPool::new(PoolConfig::new(g, 16, 8)).unwrap();
    Rig {
        prefill: PrefillSide::new(
            prefill,
            prefill_pool.clone(),
            AdmissionLimits::new(64, 8, 16),
            pcfg.clone(),
        ),
        decode: DecodeSide::new(
            decode,
            decode_pool.clone(),
            AdmissionLimits::new(64, 8, 16),
            dcfg.clone(),
        ),
        prefill_pool,
        decode_pool,
    }
}

#[test]
fn the_real_peer_gets_in_through_a_flood_of_strangers_every_time() {
    let budget = handoff::transfer::tcp::MAX_PENDING_PER_SOURCE;
    let mut displaced = 0;
    for round in 0..20 {
        let base = TransferConfig::default().with_auth_timeout(Duration::from_secs(3));
        let workers = support::deployment(&base, 2);
        let (pcfg, (cfg, decode_id)) = (workers[0].0.clone(), workers[1].clone());
        let mut listener = TcpDecodeListener::bind(loopback()).unwrap();
        let addr = listener.local_addr().unwrap();
        let decode = {
            let cfg = cfg.clone();
            std::thread::spawn(move || {
                let link = listener.accept_within(&cfg, Duration::from_secs(20));
                (link, listener)
            })
        };
        let flood = Flood::start(addr);
        support::wait_until("the flood is past the listener's budget", || {
            std::thread::sleep(Duration::from_millis(2));
            flood.opened() >= 4 * budget
        });

        let t0 = Instant::now();
        let prefill = TcpPrefill::connect_to(addr, &decode_id, &pcfg);
        let waited = t0.elapsed();
        let (link, listener) = decode.join().unwrap();
        flood.stop();
        let prefill =
            prefill.unwrap_or_else(|e| panic!("round {round}: the peer was kept out: {e}"));
        let link = link.unwrap_or_else(|e| panic!("round {round}: decode took no link: {e}"));
        assert!(link.is_authenticated());
        assert!(
            waited < Duration::from_secs(3),
            "round {round}: the peer waited {waited:?}"
        );
        let refusals = listener.refusals();
        assert!(
            refusals.iter().all(|r| !matches!(
                r.error,
                LinkError::Auth(AuthError::BadCredential | AuthError::NotConfirmed)
            )),
            "round {round}: no stranger spoke, and the peer was never refused: {refusals:?}"
        );
        displaced += refusals
            .iter()
            .filter(|r| matches!(r.error, LinkError::Auth(AuthError::Evicted { .. })))
            .count();

        // The link is the peer's: a transfer over it verifies.
        let mut rig = rig(prefill, link, &pcfg, &cfg);
        let id = RequestId(round + 1);
        let _ = rig.decode.submit(request(id.0, 7, 24)).unwrap();
        rig.serve_one().unwrap();
        let v = rig.outcomes(1).pop().unwrap().result.expect("verifies");
        assert_eq!(
            handoff::transfer::synthetic::check(&rig.decode_pool, v.seq(), id).unwrap(),
            Ok(())
        );
        drop(v);
        rig.assert_clean();
    }
    assert!(
        displaced > 0,
        "the flood went past the per-source budget, so silent strangers were displaced"
    );
}

#[test]
fn a_connect_that_the_decode_end_never_accepts_fails_typed_within_its_deadline() {
    let limit = Duration::from_millis(400);
    let workers = support::deployment(&TransferConfig::default().with_auth_timeout(limit), 2);
    let (cfg, (dcfg, decode_id)) = (workers[0].0.clone(), workers[1].clone());
    let connect = |addr, cfg: &TransferConfig| TcpPrefill::connect_to(addr, &decode_id, cfg);

    // The decode end completes the key exchange and opens the prefill
    // end's hello, then never hands the connection out as its link.
    let never = NeverAccepts::start(dcfg.identity().unwrap()).unwrap();
    let t0 = Instant::now();
    let e = connect(never.local_addr(), &cfg)
        .err()
        .expect("no link without the decode end's acceptance");
    let waited = t0.elapsed();
    assert!(
        matches!(e, LinkError::Auth(AuthError::NotAccepted { waited_ms }) if waited_ms == 400),
        "{e}"
    );
    assert_eq!(e.http_status(), 502);
    assert_eq!(never.handshakes(), 1, "the key exchange itself completed");
    assert!(
        waited >= limit && waited < limit + Duration::from_secs(2),
        "failed after {waited:?}, the deadline is {limit:?}"
    );

    // A decode listener whose owner never calls accept: the connection
    // waits in its queue, and the key exchange never completes.
    let listener = TcpDecodeListener::bind(loopback()).unwrap();
    let t0 = Instant::now();
    let e = connect(listener.local_addr().unwrap(), &cfg)
        .err()
        .expect("no link from a listener that never accepts");
    let waited = t0.elapsed();
    assert!(
        matches!(e, LinkError::Auth(AuthError::Deadline { waited_ms }) if waited_ms == 400),
        "{e}"
    );
    assert!(
        waited >= limit && waited < limit + Duration::from_secs(2),
        "failed after {waited:?}, the deadline is {limit:?}"
    );

    // A decode end that takes one link accepts no second prefill end.
    let mut listener = listener;
    let addr = listener.local_addr().unwrap();
    let first = std::thread::spawn({
        let cfg = cfg.clone();
        move || TcpPrefill::connect_to(addr, &decode_id, &cfg)
    });
    let taken = listener
        .accept_within(&dcfg, Duration::from_secs(10))
        .unwrap();
    let first = first.join().unwrap().unwrap();
    let second = connect(addr, &cfg).err();
    assert!(
        matches!(second, Some(LinkError::Auth(AuthError::Deadline { .. }))),
        "{second:?}"
    );
    drop((first, taken));
}
