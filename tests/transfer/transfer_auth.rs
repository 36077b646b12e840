//! Story: only the deployment's own prefill worker gets the link.
//!
//! A decode worker listens with its own worker key, trusting the
//! deployment's allowlist. Before its real prefill peer arrives, the port
//! sees a stranger holding a worker key of its own that is not on the
//! allowlist, a connection that never says a word, a flood of connections,
//! a prefill process without any credential that would compute perfectly
//! valid KV and checksums, a replay of a recorded authenticated session,
//! and a handshake dripped a byte at a time. Each is closed and recorded with a
//! typed reason, none of them ever sees a plan, the real peer is served
//! with KV that verifies, and both pools end full. On a link without a key,
//! a frame dripped byte by byte is cut off at the frame deadline, counted
//! for the whole frame. And a receipt with a nonce decode never issued is
//! ignored when the peer proved nothing, but fails its request when the
//! authenticated peer sends it.

use crate::support;

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use handoff::transfer::tcp::frame::{self, Frame, HEADER_LEN, Kind, Role, encode_frame};
use handoff::transfer::{
    Allowlist, AuthError, DecodeSide, Identity, IntegrityError, LinkError, Nonce, PeerId,
    PrefillLink, PrefillSide, Receipt, Refusal, Tcp, TcpAuth, TcpDecode, TcpDecodeListener,
    TcpPrefill, ToDecode, Transfer, TransferConfig, TransferError, WireError, WorkerKey,
};
use handoff::{AdmissionLimits, HttpStatus, KvPool, PoolConfig, RequestId};
use support::{Rig, geometry, request};

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// A deployment's prefill and decode worker: each with its own key, both
/// on the allowlist both trust.
struct Workers {
    prefill: TransferConfig,
    decode: TransferConfig,
    decode_id: PeerId,
    decode_identity: Arc<Identity>,
}

impl Workers {
    fn new() -> Self {
        let (p, d) = (
            WorkerKey::generate().unwrap(),
            WorkerKey::generate().unwrap(),
        );
        let decode_id = d.peer_id();
        let trusted = Allowlist::of([p.peer_id(), decode_id]);
        let decode_identity = Arc::new(Identity::new(d, trusted.clone()));
        let base = TransferConfig::default().with_auth_timeout(Duration::from_millis(500));
        Workers {
            prefill: base.clone().with_identity(Identity::new(p, trusted)),
            decode: base.with_identity(decode_identity.clone()),
            decode_id,
            decode_identity,
        }
    }

    fn with_auth_timeout(mut self, d: Duration) -> Self {
        self.prefill = self.prefill.with_auth_timeout(d);
        self.decode = self.decode.with_auth_timeout(d);
        self
    }

    /// The real prefill worker dials the decode worker at `addr`.
    fn connect(&self, addr: SocketAddr) -> Result<TcpPrefill, LinkError> {
        TcpPrefill::connect_to(addr, &self.decode_id, &self.prefill)
    }
}

/// The decode end waiting for its peer on a thread: the link it accepted
/// and everything it refused before that.
fn listen(
    listener: TcpDecodeListener,
    cfg: &TransferConfig,
) -> JoinHandle<(
    Result<TcpDecode, LinkError>,
    Vec<Refusal>,
    TcpDecodeListener,
)> {
    let cfg = cfg.clone();
    std::thread::spawn(move || {
        let mut listener = listener;
        let link = listener.accept_within(&cfg, Duration::from_secs(20));
        (link, listener.refusals(), listener)
    })
}

/// A rig over two accepted ends: prefill computes synthetic KV.
/// `pcfg` and `dcfg` are each side's own configuration (its identity).
fn rig(
    prefill: TcpPrefill,
    decode: TcpDecode,
    pcfg: &TransferConfig,
    dcfg: &TransferConfig,
) -> Rig<Tcp> {
    let g = geometry(handoff::KvDtype::BF16);
    let prefill_pool = KvPool::new(PoolConfig::new(g, 16, 32)).unwrap();
    let decode_pool = KvPool::new(PoolConfig::new(g, 16, 32)).unwrap();
    Rig {
        prefill: PrefillSide::new(
            prefill,
            prefill_pool.clone(),
            AdmissionLimits::new(256, 32, 16),
            pcfg.clone(),
        ),
        decode: DecodeSide::new(
            decode,
            decode_pool.clone(),
            AdmissionLimits::new(256, 32, 16),
            dcfg.clone(),
        ),
        prefill_pool,
        decode_pool,
    }
}

/// The real peer is served: a request's KV crosses and verifies, byte for
/// byte, and nothing else was ever verified, refused or ignored.
fn real_peer_is_served(mut rig: Rig<Tcp>) {
    let _ = rig.decode.submit(request(1, 7, 40)).unwrap();
    rig.serve_one().unwrap();
    let mut outcomes = rig.outcomes(1);
    assert_eq!(outcomes.len(), 1);
    let v = outcomes
        .pop()
        .unwrap()
        .result
        .expect("the real peer's KV verifies");
    assert_eq!(
        handoff::transfer::synthetic::check(&rig.decode_pool, v.seq(), RequestId(1)).unwrap(),
        Ok(())
    );
    drop(v);
    let s = rig.decode.stats();
    assert_eq!(
        (s.planned, s.verified),
        (1, 1),
        "one plan, to the real peer"
    );
    assert_eq!(
        s.ignored_receipts + s.ignored_aborts + s.integrity_failures,
        0
    );
    rig.assert_clean();
}

fn auth_errors(refusals: &[Refusal]) -> Vec<AuthError> {
    refusals
        .iter()
        .filter_map(|r| match &r.error {
            LinkError::Auth(e) => Some(e.clone()),
            _ => None,
        })
        .collect()
}

/// True once the other side has closed `s` (EOF or reset), false if it is
/// still open after 10 s.
fn closed_on(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut rest = Vec::new();
    match s.read_to_end(&mut rest) {
        Ok(_) => true,
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
    }
}

#[test]
fn a_stranger_with_another_key_that_connects_first_is_refused() {
    let w = Workers::new();
    let listener = TcpDecodeListener::bind(loopback()).unwrap();
    let addr = listener.local_addr().unwrap();
    let decode = listen(listener, &w.decode);

    // A worker key of its own, not on the decode worker's allowlist (the
    // stranger itself trusts the decode worker, so it dials).
    let key = WorkerKey::generate().unwrap();
    let stranger_id = key.peer_id();
    let stranger =
        TransferConfig::default().with_identity(Identity::new(key, Allowlist::of([w.decode_id])));
    let e = TcpPrefill::connect_to(addr, &w.decode_id, &stranger)
        .err()
        .expect("decode does not complete a handshake with a worker off its allowlist");
    assert_eq!(e, LinkError::Auth(AuthError::Closed));
    assert_eq!(e.http_status(), 502);

    let prefill = w.connect(addr).unwrap();
    let (link, refusals, _) = decode.join().unwrap();
    let link = link.unwrap();
    assert!(link.is_authenticated());
    assert_eq!(
        auth_errors(&refusals),
        vec![AuthError::UnknownPeer { peer: stranger_id }]
    );
    assert_eq!(w.decode_identity.refused_peers(), 1, "counted");
    assert_eq!(prefill.peer_id(), Some(w.decode_id));
    real_peer_is_served(rig(prefill, link, &w.prefill, &w.decode));
}

#[test]
fn a_prefill_worker_refuses_to_dial_a_decode_worker_off_its_allowlist() {
    let w = Workers::new();
    let listener = TcpDecodeListener::bind(loopback()).unwrap();
    let addr = listener.local_addr().unwrap();
    // A decode worker whose key the prefill worker does not trust (it
    // trusts the prefill worker, and would accept it).
    let rogue_key = WorkerKey::generate().unwrap();
    let rogue_id = rogue_key.peer_id();
    let prefill_id = w.prefill.peer_id().unwrap();
    let rogue = w
        .decode
        .clone()
        .with_identity(Identity::new(rogue_key, Allowlist::of([prefill_id])));
    let decode = std::thread::spawn(move || {
        let mut listener = listener;
        let link = listener.accept_within(&rogue, Duration::from_secs(2));
        (link.map(|l| l.is_authenticated()), listener.refusals())
    });
    let e = TcpPrefill::connect_to(addr, &rogue_id, &w.prefill)
        .err()
        .expect("no handshake with a decode worker off the allowlist");
    assert_eq!(
        e,
        LinkError::Auth(AuthError::UnknownPeer { peer: rogue_id })
    );
    let identity = w.prefill.identity().unwrap();
    assert_eq!(identity.refused_peers(), 1, "counted");
    // And one that answers at the trusted decode worker's address without
    // its secret key cannot complete the handshake.
    let e = w.connect(addr).err().expect("an impostor decode end");
    assert!(matches!(e, LinkError::Auth(AuthError::Closed)), "{e}");
    let (link, refusals) = decode.join().unwrap();
    assert!(
        matches!(link, Err(LinkError::AcceptTimeout { .. })),
        "{link:?}"
    );
    assert_eq!(auth_errors(&refusals), vec![AuthError::BadCredential]);
}

#[test]
fn a_silent_connection_is_closed_at_its_deadline_and_does_not_take_the_link() {
    let w = Workers::new().with_auth_timeout(Duration::from_millis(200));
    let listener = TcpDecodeListener::bind(loopback()).unwrap();
    let addr = listener.local_addr().unwrap();
    let decode = listen(listener, &w.decode);

    let mut silent = TcpStream::connect(addr).unwrap();
    let t0 = Instant::now();
    assert!(closed_on(&mut silent), "the silent connection is closed");
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_millis(150) && waited < Duration::from_secs(5),
        "closed after {waited:?}, the deadline is 200 ms"
    );

    let prefill = w.connect(addr).unwrap();
    let (link, refusals, _) = decode.join().unwrap();
    assert!(matches!(
        auth_errors(&refusals)[..],
        [AuthError::Deadline { waited_ms }] if waited_ms >= 200
    ));
    real_peer_is_served(rig(prefill, link.unwrap(), &w.prefill, &w.decode));
}

#[test]
fn a_flood_of_connections_does_not_keep_the_real_peer_out() {
    let w = Workers::new().with_auth_timeout(Duration::from_secs(5));
    let listener = TcpDecodeListener::bind(loopback()).unwrap();
    let addr = listener.local_addr().unwrap();
    let decode = listen(listener, &w.decode);

    // More silent connections than the listener keeps authenticating at
    // once, and more arriving while the real peer connects.
    let flood = handoff::transfer::tcp::MAX_PENDING * 3;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let opened = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let flooder = {
        let (stop, opened) = (stop.clone(), opened.clone());
        std::thread::spawn(move || {
            let mut held = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && held.len() < 4 * flood {
                if let Ok(s) = TcpStream::connect(addr) {
                    held.push(s);
                    opened.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                if held.len() > flood {
                    std::thread::sleep(Duration::from_millis(2));
                }
            }
        })
    };
    support::wait_until("the flood is under way", || {
        std::thread::sleep(Duration::from_millis(10));
        opened.load(std::sync::atomic::Ordering::Relaxed) >= flood
    });

    let t0 = Instant::now();
    let prefill = w.connect(addr).expect("the real peer gets through");
    let (link, refusals, listener) = decode.join().unwrap();
    let link = link.unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "the real peer waited {:?}",
        t0.elapsed()
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    flooder.join().unwrap();
    assert!(
        auth_errors(&refusals)
            .iter()
            .any(|e| matches!(e, AuthError::Evicted { .. })),
        "the oldest strangers were closed to make room"
    );
    assert!(listener.refused_total() >= flood as u64 - handoff::transfer::tcp::MAX_PENDING as u64);
    real_peer_is_served(rig(prefill, link, &w.prefill, &w.decode));
}

#[test]
fn a_prefill_without_the_credential_never_sees_a_plan_however_valid_its_kv() {
    let w = Workers::new();
    let listener = TcpDecodeListener::bind(loopback()).unwrap();
    let addr = listener.local_addr().unwrap();
    let decode = listen(listener, &w.decode);

    // A complete prefill side, speaking the protocol faithfully and ready
    // to compute KV with correct checksums, but holding no worker key.
    let plain = TransferConfig::default();
    let impostor_link = TcpPrefill::connect(addr, &plain).unwrap();
    let impostor_pool =
        KvPool::new(PoolConfig::new(geometry(handoff::KvDtype::BF16), 16, 32)).unwrap();
    let mut impostor = PrefillSide::new(
        impostor_link,
        impostor_pool.clone(),
        AdmissionLimits::new(256, 32, 16),
        plain,
    );
    let e = impostor
        .next_job_within(Duration::from_secs(10))
        .expect_err("no plan reaches a peer without a worker key");
    assert!(
        matches!(e, TransferError::Link(LinkError::Disconnected)),
        "{e}"
    );
    assert!(impostor_pool.stats().is_full());

    let prefill = w.connect(addr).unwrap();
    let (link, refusals, _) = decode.join().unwrap();
    assert_eq!(auth_errors(&refusals), vec![AuthError::PeerUnauthenticated]);
    real_peer_is_served(rig(prefill, link.unwrap(), &w.prefill, &w.decode));
}

/// Forwards one connection both ways, recording what the client sent.
fn recording_proxy(target: SocketAddr) -> (SocketAddr, JoinHandle<Vec<u8>>) {
    let front = TcpListener::bind(loopback()).unwrap();
    let addr = front.local_addr().unwrap();
    let h = std::thread::spawn(move || {
        let (mut client, _) = front.accept().unwrap();
        let mut server = TcpStream::connect(target).unwrap();
        let (mut c2, mut s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
        let back = std::thread::spawn(move || {
            let _ = std::io::copy(&mut s2, &mut c2);
            let _ = c2.shutdown(Shutdown::Both);
        });
        let mut recorded = Vec::new();
        let mut buf = [0u8; 64 << 10];
        loop {
            match client.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    recorded.extend_from_slice(&buf[..n]);
                    if server.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = server.shutdown(Shutdown::Both);
        let _ = back.join();
        recorded
    });
    (addr, h)
}

#[test]
fn a_replayed_authenticated_session_is_refused() {
    let w = Workers::new();
    let listener = TcpDecodeListener::bind(loopback()).unwrap();
    let addr = listener.local_addr().unwrap();

    // A genuine session, recorded on the way: handshake, sealed hello, KV,
    // receipt.
    let decode = listen(listener, &w.decode);
    let (proxy, recording) = recording_proxy(addr);
    let prefill = w.connect(proxy).unwrap();
    let (link, _, listener) = decode.join().unwrap();
    real_peer_is_served(rig(prefill, link.unwrap(), &w.prefill, &w.decode));
    let recorded = recording.join().unwrap();
    // 40 tokens x 3 layers x (K + V) x 2 heads x 8 dims x 2 bytes.
    assert!(recorded.len() > 7680, "the recording holds the KV");

    // The same bytes, played to the same decode worker.
    let decode = listen(listener, &w.decode);
    let mut replay = TcpStream::connect(addr).unwrap();
    let _ = replay.write_all(&recorded);
    assert!(closed_on(&mut replay), "the replay is cut off");

    let prefill = w.connect(addr).unwrap();
    let (link, refusals, _) = decode.join().unwrap();
    assert_eq!(auth_errors(&refusals), vec![AuthError::NotConfirmed]);
    real_peer_is_served(rig(prefill, link.unwrap(), &w.prefill, &w.decode));
}

#[test]
fn a_handshake_dripped_a_byte_at_a_time_is_closed_at_its_deadline() {
    let w = Workers::new().with_auth_timeout(Duration::from_millis(400));
    let listener = TcpDecodeListener::bind(loopback()).unwrap();
    let addr = listener.local_addr().unwrap();
    let decode = listen(listener, &w.decode);

    let mut drip = TcpStream::connect(addr).unwrap();
    let t0 = Instant::now();
    for b in b"HNDA\x02\x00\x60\x00".iter().chain([0u8; 96].iter()) {
        if drip.write_all(&[*b]).is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
        if t0.elapsed() > Duration::from_secs(3) {
            break;
        }
    }
    assert!(closed_on(&mut drip));
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "dripped for {:?}",
        t0.elapsed()
    );

    let prefill = w.connect(addr).unwrap();
    let (link, refusals, _) = decode.join().unwrap();
    assert!(matches!(
        auth_errors(&refusals)[..],
        [AuthError::Deadline { .. }]
    ));
    real_peer_is_served(rig(prefill, link.unwrap(), &w.prefill, &w.decode));
}

#[test]
fn a_frame_dripped_a_byte_at_a_time_ends_at_the_frame_deadline() {
    // Without a key (loopback): a peer sends its hello, takes a plan, then
    // starts a receipt and feeds it one byte every 100 ms. Each byte comes
    // well within the 400 ms write timeout, but the frame as a whole does
    // not: the link ends at the frame's deadline with a typed error.
    let cfg = TransferConfig::default().with_write_timeout(Duration::from_millis(400));
    let listener = TcpDecodeListener::bind(loopback()).unwrap();
    let addr = listener.local_addr().unwrap();
    let peer = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        let mut out = Vec::new();
        encode_frame(&mut out, 0, &Frame::Hello(Role::Prefill));
        s.write_all(&out).unwrap();
        // Decode's hello, then the plan.
        for want in [Kind::Hello, Kind::Plan] {
            let mut head = [0u8; HEADER_LEN];
            s.read_exact(&mut head).unwrap();
            let h = frame::decode_header(&head, 1 << 20).unwrap();
            assert_eq!(h.kind, want);
            let mut skip = vec![0u8; h.len as usize];
            s.read_exact(&mut skip).unwrap();
        }
        let receipt = Receipt {
            request: RequestId(1),
            nonce: Nonce(1),
            layer_tokens: vec![20; 3],
            pages: vec![],
            page_checksums: vec![],
            writers: vec![],
            first_token: None,
            first_logprobs: None,
        };
        let mut frame = Vec::new();
        encode_frame(&mut frame, 1, &Frame::ToDecode(ToDecode::Receipt(receipt)));
        let t0 = Instant::now();
        for b in frame {
            if s.write_all(&[b]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        t0.elapsed()
    });
    let link = listener.accept(&cfg).unwrap();
    let pool = KvPool::new(PoolConfig::new(geometry(handoff::KvDtype::BF16), 16, 32)).unwrap();
    let mut decode = DecodeSide::new(link, pool.clone(), AdmissionLimits::new(256, 32, 16), cfg);
    let _ = decode.submit(request(1, 7, 20)).unwrap();
    let t0 = Instant::now();
    let mut outcomes = Vec::new();
    while outcomes.is_empty() && t0.elapsed() < Duration::from_secs(10) {
        outcomes = decode.poll(Duration::from_millis(50));
    }
    let ended = t0.elapsed();
    let err = outcomes
        .pop()
        .expect("the transfer ends")
        .result
        .unwrap_err();
    assert_eq!(
        err,
        TransferError::Link(LinkError::Wire(WireError::Stalled { waited_ms: 400 }))
    );
    assert!(
        ended < Duration::from_secs(2),
        "ended after {ended:?}: a frame may take 400 ms as a whole"
    );
    let dripped = peer.join().unwrap();
    assert!(
        dripped < Duration::from_secs(3),
        "the drip was cut off after {dripped:?}"
    );
    assert_eq!(decode.stats().verified, 0);
    assert!(pool.stats().is_full());
}

/// A transfer whose first receipt names the live request with a nonce
/// decode never issued; the real receipt follows. Returns the request's
/// outcome and how many receipts decode ignored.
fn wrong_nonce_then_real_receipt<T: Transfer<Prefill = TcpPrefill, Decode = TcpDecode>>(
    t: T,
) -> (Result<(), TransferError>, u64) {
    let cfg = TransferConfig::default();
    let (mut prefill, decode) = t.connect(&cfg).unwrap();
    prefill
        .send(ToDecode::Receipt(Receipt {
            request: RequestId(1),
            nonce: Nonce(0x5eed),
            layer_tokens: vec![40; 3],
            pages: vec![],
            page_checksums: vec![],
            writers: vec![],
            first_token: Some(1),
            first_logprobs: None,
        }))
        .unwrap();
    let mut rig = rig(prefill, decode, &cfg, &cfg);
    let _ = rig.decode.submit(request(1, 7, 40)).unwrap();
    rig.serve_one().unwrap();
    let mut outcomes = rig.outcomes(1);
    // The real receipt, if the request already ended, arrives after.
    let _ = rig.decode.poll(Duration::from_millis(200));
    let ignored = rig.decode.stats().ignored_receipts;
    let result = outcomes.pop().expect("the request ends").result.map(drop);
    rig.assert_clean();
    (result, ignored)
}

#[test]
fn a_wrong_nonce_from_an_unauthenticated_peer_is_ignored_and_the_transfer_goes_on() {
    let (result, ignored) = wrong_nonce_then_real_receipt(Tcp);
    assert_eq!(result, Ok(()), "the real receipt verifies");
    assert_eq!(ignored, 1, "the stray receipt is counted, never applied");
}

#[test]
fn a_wrong_nonce_from_the_authenticated_peer_fails_its_request() {
    let (result, ignored) = wrong_nonce_then_real_receipt(TcpAuth);
    let e = result.expect_err("a lying authenticated peer fails the request closed");
    assert!(
        matches!(
            e,
            TransferError::Integrity(IntegrityError::NonceMismatch { request, .. })
                if request == RequestId(1)
        ),
        "{e}"
    );
    assert_eq!(e.http_status(), 500);
    assert_eq!(ignored, 1, "the late real receipt is ignored");
}

#[test]
fn non_loopback_addresses_need_a_worker_identity() {
    let any = SocketAddr::from(([0, 0, 0, 0], 0));
    let e = TcpDecodeListener::bind_with(any, &TransferConfig::default())
        .err()
        .expect("no identity, no wildcard address");
    assert!(matches!(e, LinkError::NotLoopback { .. }));
    assert_eq!(e.http_status(), 500);
    let listener = TcpDecodeListener::bind_with(any, &Workers::new().decode).unwrap();
    // The same listener refuses to serve a configuration without one.
    let e = listener
        .accept(&TransferConfig::default())
        .err()
        .expect("an unauthenticated accept on a wildcard address");
    assert!(matches!(e, LinkError::NotLoopback { .. }));
    let remote = SocketAddr::from(([192, 0, 2, 1], 9));
    let e = TcpPrefill::connect(remote, &TransferConfig::default())
        .err()
        .unwrap();
    assert!(matches!(e, LinkError::NotLoopback { .. }));
}

#[test]
fn a_handshake_spanning_several_bounded_accepts_is_not_dropped() {
    // A host that waits in short slices (checking on its prefill process
    // between them) must not close a peer whose handshake is still going
    // when a slice ends.
    let w = Workers::new();
    // A handshake usually spans several 1 ns slices; on a loaded machine
    // one slice can last long enough for the peer to finish within it,
    // which is not the case this story is about: try again then.
    for _ in 0..10 {
        let mut listener = TcpDecodeListener::bind(loopback()).unwrap();
        let addr = listener.local_addr().unwrap();
        let peer = {
            let (cfg, decode_id) = (w.prefill.clone(), w.decode_id);
            std::thread::spawn(move || TcpPrefill::connect_to(addr, &decode_id, &cfg))
        };
        // The peer has connected and sent its first message.
        std::thread::sleep(Duration::from_millis(50));
        let until = Instant::now() + Duration::from_secs(20);
        let mut slices = 0;
        let link = loop {
            slices += 1;
            // Slices too short for a handshake: each ends right after the
            // listener's first pass over its connections.
            match listener.accept_within(&w.decode, Duration::from_nanos(1)) {
                Ok(link) => break link,
                Err(LinkError::AcceptTimeout { .. }) if Instant::now() < until => {}
                Err(e) => panic!("{e}"),
            }
        };
        let prefill = peer
            .join()
            .unwrap()
            .expect("the peer's handshake completed");
        assert!(listener.refusals().is_empty(), "{:?}", listener.refusals());
        if slices > 1 {
            real_peer_is_served(rig(prefill, link, &w.prefill, &w.decode));
            return;
        }
    }
    panic!("ten handshakes in a row each completed within one accept slice");
}
