//! Story: bad bytes on the wire end the connection, not a request's
//! isolation.
//!
//! A peer (or a fault, or an attacker on the host) sends garbage, a frame
//! longer than allowed, frames out of sequence or in the wrong direction.
//! Each time the decode end reports a typed wire error, closes the
//! connection, fails the transfers in flight on it with that error, and
//! leaves its pool exactly as full as before. The prefill end, facing a
//! raw peer posing as a decode worker while it holds a transfer's source
//! pages for the peer's answer, does the same: a typed error, the
//! connection closed, the held pages released by the link's end (never by
//! a forged answer inside the bad frame), its pool back to full. The frame
//! decoder is a pure function that never panics, whatever bytes it is fed.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use handoff::transfer::tcp::frame::{
    self, Frame, HEADER_LEN, Kind, Role, decode_frame, encode_frame, put_header,
};
use handoff::transfer::{
    Answer, DecodeSide, FailReason, LinkError, Nonce, Plan, PlannedPage, PrefillSide, Receipt,
    TcpDecodeListener, TcpPrefill, ToDecode, ToPrefill, TransferConfig, TransferError, Verdict,
    WireError, WriteBatch, WriterRun, synthetic,
};
use handoff::{
    AdmissionLimits, KvDtype, KvGeometry, KvPool, PoolConfig, Request, RequestId, TenantId,
};
use proptest::prelude::*;

const MAX: usize = 1 << 20;

fn geometry() -> KvGeometry {
    KvGeometry {
        n_layers: 2,
        n_kv_heads: 2,
        head_dim: 4,
        dtype: KvDtype::F16,
    }
}

/// A decode side with one transfer in flight to a raw socket peer, which
/// then sends `bytes`. Returns the transfer's error and the decode pool.
fn decode_receives(bytes: Vec<u8>) -> (TransferError, KvPool) {
    decode_receives_with(wire_config(), bytes)
}

fn wire_config() -> TransferConfig {
    TransferConfig::default()
        .with_max_batch_bytes(64 << 10)
        .with_max_frame_bytes(MAX)
}

/// [`decode_receives`] under `cfg`.
fn decode_receives_with(cfg: TransferConfig, bytes: Vec<u8>) -> (TransferError, KvPool) {
    let listener = TcpDecodeListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
    let addr = listener.local_addr().unwrap();
    let peer = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut hello = Vec::new();
        encode_frame(&mut hello, 0, &Frame::Hello(Role::Prefill));
        s.write_all(&hello).unwrap();
        // Wait for the plan before misbehaving.
        let mut head = [0u8; HEADER_LEN];
        s.read_exact(&mut head).unwrap(); // decode's hello
        let h = frame::decode_header(&head, MAX).unwrap();
        let mut skip = vec![0u8; h.len as usize];
        s.read_exact(&mut skip).unwrap();
        s.read_exact(&mut head).unwrap(); // the plan
        assert_eq!(frame::decode_header(&head, MAX).unwrap().kind, Kind::Plan);
        let _ = s.write_all(&bytes);
        // The connection is closed on us: reads end.
        reads_end(&mut s)
    });
    let link = listener.accept(&cfg).unwrap();
    let pool = KvPool::new(PoolConfig::new(geometry(), 16, 8)).unwrap();
    let mut decode = DecodeSide::new(link, pool.clone(), AdmissionLimits::new(64, 8, 16), cfg);
    let _ = decode
        .submit(Request::new(RequestId(1), TenantId(1), vec![3; 20], 4))
        .unwrap();
    let mut outcomes = Vec::new();
    for _ in 0..50 {
        outcomes.extend(decode.poll(Duration::from_millis(100)));
        if !outcomes.is_empty() {
            break;
        }
    }
    assert!(
        peer.join().unwrap(),
        "decode kept the connection open after the bad bytes (the peer's reads timed out)"
    );
    assert_eq!(outcomes.len(), 1);
    let err = outcomes.pop().unwrap().result.unwrap_err();
    assert_eq!(decode.landing().refused_writes(), 0);
    assert_eq!(decode.stats().verified, 0);
    (err, pool)
}

fn wire(err: TransferError) -> WireError {
    match err {
        TransferError::Link(LinkError::Wire(w)) => w,
        other => panic!("expected a wire error, got {other:?}"),
    }
}

#[test]
fn garbage_bytes_close_the_connection_with_bad_magic() {
    let (e, pool) = decode_receives(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec());
    assert!(matches!(wire(e), WireError::BadMagic { got } if &got == b"GET "));
    assert!(pool.stats().is_full());
}

#[test]
fn oversized_frame_is_refused_before_reading_it() {
    let mut b = Vec::new();
    put_header(&mut b, Kind::Write, 1, (MAX + 1) as u32);
    let (e, pool) = decode_receives(b);
    assert_eq!(
        wire(e),
        WireError::Oversized {
            len: MAX as u64 + 1,
            max: MAX as u64
        }
    );
    assert!(pool.stats().is_full());
}

#[test]
fn out_of_sequence_frame_closes_the_connection() {
    let mut b = Vec::new();
    let abort = handoff::transfer::Abort {
        request: RequestId(1),
        nonce: Nonce(1),
        reason: handoff::transfer::AbortReason::ComputeFailed,
    };
    encode_frame(&mut b, 5, &Frame::ToDecode(ToDecode::Abort(abort)));
    let (e, pool) = decode_receives(b);
    assert_eq!(
        wire(e),
        WireError::OutOfOrder {
            expected: 1,
            got: 5
        }
    );
    assert!(pool.stats().is_full());
}

#[test]
fn frame_for_the_other_direction_closes_the_connection() {
    let mut b = Vec::new();
    encode_frame(&mut b, 1, &Frame::Credit(1 << 30));
    let (e, pool) = decode_receives(b);
    assert!(matches!(
        wire(e),
        WireError::Unexpected { kind: "credit", .. }
    ));
    assert!(pool.stats().is_full());
}

/// The frames of a link with a data plane (NIXL) mean nothing on a plain
/// one: a staged write names bytes this end has no way to fetch, and a
/// prefill end's data-plane metadata has no plane to go to.
#[test]
fn data_plane_frames_on_a_plain_link_close_the_connection() {
    let batch = WriteBatch {
        request: RequestId(1),
        nonce: Nonce(1),
        layer: 0,
        start: 0,
        tokens: 4,
    };
    let staged = frame::Staged {
        id: 0,
        len: 64,
        src: vec![(4096, 64)],
    };
    for (f, kind) in [
        (Frame::Staged(batch, staged), "staged write"),
        (Frame::DataPlane(b"parameters"), "data plane"),
    ] {
        let mut b = Vec::new();
        encode_frame(&mut b, 1, &f);
        let (e, pool) = decode_receives(b);
        assert!(
            matches!(wire(e.clone()), WireError::Unexpected { kind: k, .. } if k == kind),
            "{kind}: {e:?}"
        );
        assert!(pool.stats().is_full());
    }
}

#[test]
fn unknown_version_and_flags_are_refused() {
    let mut b = Vec::new();
    put_header(&mut b, Kind::Abort, 1, 0);
    b[4] = 9;
    let (e, _) = decode_receives(b);
    assert_eq!(
        wire(e),
        WireError::UnsupportedVersion {
            got: 9,
            supported: handoff::transfer::tcp::frame::VERSION
        }
    );
    let mut b = Vec::new();
    put_header(&mut b, Kind::Abort, 1, 0);
    b[7] = 0x80;
    let (e, _) = decode_receives(b);
    assert_eq!(wire(e), WireError::BadFlags { flags: 0x80 });
}

#[test]
fn malformed_receipt_is_refused_not_guessed() {
    // A receipt that claims a billion checksums in a 40-byte payload.
    let mut payload = Vec::new();
    payload.extend_from_slice(&1u64.to_le_bytes());
    payload.extend_from_slice(&1u64.to_le_bytes());
    payload.extend_from_slice(&0u32.to_le_bytes()); // layer counts
    payload.extend_from_slice(&0u32.to_le_bytes()); // pages
    payload.extend_from_slice(&1_000_000_000u32.to_le_bytes()); // checksums
    let mut b = Vec::new();
    put_header(&mut b, Kind::Receipt, 1, payload.len() as u32);
    b.extend_from_slice(&payload);
    let (e, pool) = decode_receives(b);
    assert_eq!(wire(e), WireError::Truncated { what: "checksums" });
    assert!(pool.stats().is_full());
}

// ---- The prefill end ---------------------------------------------------

/// The request and nonce of the plan the raw decode peer sends.
const HELD: RequestId = RequestId(1);
const NONCE: Nonce = Nonce(0x5eed_0001);
const PROMPT: usize = 20;

/// When the raw decode peer misbehaves.
#[derive(Clone, Copy, PartialEq, Eq)]
enum When {
    /// Instead of its hello: prefill holds nothing yet.
    First,
    /// After its hello (sequence 0) and a plan (1), once prefill has sent
    /// the KV and the receipt and holds the source pages for the answer.
    /// The bad bytes are built for sequence number 2.
    WhileHeld,
}

fn held_plan() -> Plan {
    Plan {
        request: HELD,
        tenant: TenantId(1),
        nonce: NONCE,
        prompt: vec![3; PROMPT],
        tokens: PROMPT as u32,
        geometry: geometry(),
        page_size: 16,
        pages: (0..PROMPT.div_ceil(16) as u32)
            .map(|index| PlannedPage {
                index,
                generation: 1,
            })
            .collect(),
        sampling: handoff::SamplingParams::default(),
        model: None,
        peer: None,
        prefix_cache: false,
    }
}

/// The answer that would release the held transfer, as frame `seq`.
fn ack(seq: u32) -> Vec<u8> {
    let mut b = Vec::new();
    encode_frame(
        &mut b,
        seq,
        &Frame::ToPrefill(ToPrefill::Answer(Answer {
            request: HELD,
            nonce: NONCE,
            verdict: Verdict::Ack,
        })),
    );
    b
}

/// What the prefill end did with bad bytes from a raw decode peer.
struct PrefillEnd {
    error: LinkError,
    /// The peer's reads ended (EOF or reset) rather than timing out.
    closed: bool,
}

/// A raw peer posing as a decode worker on `listener`: accepts one
/// connection, (if `when` is `WhileHeld`, first plans a transfer and reads
/// it to its receipt), sends `bytes`, closes its sending half if `hang_up`;
/// returns true if prefill then closed the connection (reads ended rather
/// than timing out after 10 s).
fn raw_decode_peer(
    listener: TcpListener,
    when: When,
    bytes: Vec<u8>,
    hang_up: bool,
) -> std::thread::JoinHandle<bool> {
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        if when == When::WhileHeld {
            let mut out = Vec::new();
            encode_frame(&mut out, 0, &Frame::Hello(Role::Decode));
            encode_frame(&mut out, 1, &Frame::ToPrefill(ToPrefill::Plan(held_plan())));
            s.write_all(&out).unwrap();
            // Prefill's hello, the KV writes, then the receipt.
            loop {
                let mut head = [0u8; HEADER_LEN];
                s.read_exact(&mut head).unwrap();
                let h = frame::decode_header(&head, MAX).unwrap();
                let mut payload = vec![0u8; h.len as usize];
                s.read_exact(&mut payload).unwrap();
                if h.kind == Kind::Receipt {
                    break;
                }
            }
        }
        let _ = s.write_all(&bytes);
        if hang_up {
            let _ = s.shutdown(Shutdown::Write);
        }
        reads_end(&mut s)
    })
}

/// Reads `s` to its end: true if the other side closed the connection (EOF
/// or reset), false if the reads timed out with the connection still open.
fn reads_end(s: &mut TcpStream) -> bool {
    let mut rest = Vec::new();
    match s.read_to_end(&mut rest) {
        Ok(_) => true,
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
    }
}

/// A prefill side connects to a raw peer posing as a decode worker, which
/// sends `bytes` at `when` (then, if `hang_up`, closes its sending half).
/// Checks that prefill applied nothing from them and that its pool is full
/// afterwards; returns the error that ended the link.
fn prefill_receives(when: When, bytes: Vec<u8>, hang_up: bool) -> PrefillEnd {
    prefill_receives_with(wire_config(), when, bytes, hang_up)
}

/// [`prefill_receives`] under `cfg`.
fn prefill_receives_with(
    cfg: TransferConfig,
    when: When,
    bytes: Vec<u8>,
    hang_up: bool,
) -> PrefillEnd {
    let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
    let addr = listener.local_addr().unwrap();
    let peer = raw_decode_peer(listener, when, bytes, hang_up);
    let link = TcpPrefill::connect(addr, &cfg).unwrap();
    let pool = KvPool::new(PoolConfig::new(geometry(), 16, 8)).unwrap();
    let mut prefill = PrefillSide::new(link, pool.clone(), AdmissionLimits::new(64, 8, 16), cfg);
    if when == When::WhileHeld {
        let mut job = prefill.next_job_within(Duration::from_secs(10)).unwrap();
        synthetic::fill(job.seq_mut(), HELD, PROMPT).unwrap();
        prefill.complete(job, Some(1)).unwrap();
        assert_eq!(prefill.held_transfers(), 1);
        assert_eq!(pool.stats().held, 2, "the source pages wait for the answer");
    }
    let until = Instant::now() + Duration::from_secs(10);
    let mut r = Ok(());
    while r.is_ok() && Instant::now() < until {
        r = prefill.poll(Duration::from_millis(50));
    }
    let closed = peer.join().unwrap();
    let stats = prefill.stats();
    assert_eq!(stats.acked, 0, "nothing in the bad bytes was applied");
    assert_eq!(stats.ignored_answers, 0);
    assert_eq!(prefill.held_transfers(), 0, "the link's end releases them");
    let s = pool.stats();
    assert!(s.is_full() && s.balanced(), "prefill pool: {s:?}");
    assert_eq!(s.isolation_violations, 0);
    let error = match r {
        Err(TransferError::Link(e)) => e,
        other => panic!("expected the link to end with an error, got {other:?}"),
    };
    assert_eq!(prefill.link_error(), Some(&error));
    PrefillEnd { error, closed }
}

/// The typed wire error that ended the prefill end, which closed the
/// connection.
fn prefill_wire(when: When, bytes: Vec<u8>) -> WireError {
    let end = prefill_receives(when, bytes, false);
    assert!(end.closed, "prefill must close the connection");
    match end.error {
        LinkError::Wire(w) => w,
        other => panic!("expected a wire error, got {other:?}"),
    }
}

#[test]
fn prefill_end_closes_on_garbage_instead_of_the_hello() {
    let e = prefill_wire(When::First, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec());
    assert!(matches!(e, WireError::BadMagic { got } if &got == b"GET "));
}

#[test]
fn prefill_end_closes_on_garbage_while_holding_a_transfer() {
    let e = prefill_wire(When::WhileHeld, b"GET / HTTP/1.1\r\n\r\n".to_vec());
    assert!(matches!(e, WireError::BadMagic { got } if &got == b"GET "));
}

#[test]
fn prefill_end_refuses_an_answer_of_another_version_or_with_flags() {
    let mut b = ack(2);
    b[4] = 9;
    assert_eq!(
        prefill_wire(When::WhileHeld, b),
        WireError::UnsupportedVersion {
            got: 9,
            supported: handoff::transfer::tcp::frame::VERSION
        }
    );
    let mut b = ack(2);
    b[7] = 0x80;
    assert_eq!(
        prefill_wire(When::WhileHeld, b),
        WireError::BadFlags { flags: 0x80 }
    );
}

#[test]
fn prefill_end_refuses_an_unknown_frame_kind() {
    let mut b = ack(2);
    b[6] = 0x42;
    assert_eq!(
        prefill_wire(When::WhileHeld, b),
        WireError::UnknownKind { kind: 0x42 }
    );
}

#[test]
fn prefill_end_refuses_an_oversized_frame_before_reading_it() {
    let mut b = Vec::new();
    put_header(&mut b, Kind::Answer, 2, (MAX + 1) as u32);
    assert_eq!(
        prefill_wire(When::WhileHeld, b),
        WireError::Oversized {
            len: MAX as u64 + 1,
            max: MAX as u64
        }
    );
}

#[test]
fn prefill_end_refuses_an_answer_out_of_sequence() {
    // The answer is genuine but numbered 7 where 2 is due: not applied.
    assert_eq!(
        prefill_wire(When::WhileHeld, ack(7)),
        WireError::OutOfOrder {
            expected: 2,
            got: 7
        }
    );
}

#[test]
fn prefill_end_refuses_malformed_answer_payloads() {
    // Cut after 9 of its 17 bytes, the length field agreeing.
    let mut b = ack(2);
    b.truncate(HEADER_LEN + 9);
    b[12..16].copy_from_slice(&9u32.to_le_bytes());
    assert_eq!(
        prefill_wire(When::WhileHeld, b),
        WireError::Truncated { what: "nonce" }
    );
    // One byte more than an answer holds.
    let mut b = ack(2);
    b.push(0);
    b[12..16].copy_from_slice(&18u32.to_le_bytes());
    assert_eq!(
        prefill_wire(When::WhileHeld, b),
        WireError::TrailingBytes {
            kind: "answer",
            extra: 1
        }
    );
    // A verdict that does not exist.
    let mut b = ack(2);
    *b.last_mut().unwrap() = 9;
    assert_eq!(
        prefill_wire(When::WhileHeld, b),
        WireError::Invalid { what: "verdict" }
    );
}

#[test]
fn prefill_end_treats_a_peer_hanging_up_mid_frame_as_a_disconnect() {
    // Header and part of the payload, then the peer closes its side.
    let mut b = ack(2);
    b.truncate(HEADER_LEN + 5);
    let end = prefill_receives(When::WhileHeld, b, true);
    assert_eq!(end.error, LinkError::Disconnected);
    assert!(end.closed);
}

#[test]
fn prefill_end_refuses_frames_only_prefill_may_send() {
    let receipt = Frame::ToDecode(ToDecode::Receipt(Receipt {
        request: HELD,
        nonce: NONCE,
        layer_tokens: vec![PROMPT as u32; 2],
        pages: held_plan().pages,
        page_checksums: vec![0; 2],
        writers: vec![],
        first_token: Some(1),
        first_logprobs: None,
    }));
    let abort = Frame::ToDecode(ToDecode::Abort(handoff::transfer::Abort {
        request: HELD,
        nonce: NONCE,
        reason: handoff::transfer::AbortReason::ComputeFailed,
    }));
    let write = Frame::Write(
        WriteBatch {
            request: HELD,
            nonce: NONCE,
            layer: 0,
            start: 0,
            tokens: 1,
        },
        &[0; 32],
    );
    for (frame, kind) in [(receipt, "receipt"), (abort, "abort"), (write, "write")] {
        let mut b = Vec::new();
        encode_frame(&mut b, 2, &frame);
        assert_eq!(
            prefill_wire(When::WhileHeld, b),
            WireError::Unexpected {
                kind,
                context: "from a decode worker"
            }
        );
    }
}

#[test]
fn prefill_end_refuses_a_second_hello_and_a_hello_of_its_own_role() {
    let mut b = Vec::new();
    encode_frame(&mut b, 2, &Frame::Hello(Role::Decode));
    assert_eq!(
        prefill_wire(When::WhileHeld, b),
        WireError::Unexpected {
            kind: "hello",
            context: "after the first frame"
        }
    );
    let mut b = Vec::new();
    encode_frame(&mut b, 0, &Frame::Hello(Role::Prefill));
    assert_eq!(
        prefill_wire(When::First, b),
        WireError::Unexpected {
            kind: "hello",
            context: "from a peer of the same role"
        }
    );
}

#[test]
fn prefill_end_refuses_a_plan_before_the_hello() {
    let mut b = Vec::new();
    encode_frame(&mut b, 0, &Frame::ToPrefill(ToPrefill::Plan(held_plan())));
    assert_eq!(
        prefill_wire(When::First, b),
        WireError::Unexpected {
            kind: "plan",
            context: "before the hello"
        }
    );
}

#[test]
fn the_tcp_transport_refuses_non_loopback_addresses() {
    let e = TcpDecodeListener::bind(SocketAddr::from(([0, 0, 0, 0], 0)))
        .err()
        .unwrap();
    assert!(matches!(e, LinkError::NotLoopback { .. }));
}

fn sample_frames() -> Vec<Frame<'static>> {
    let g = geometry();
    vec![
        Frame::Hello(Role::Decode),
        Frame::ToPrefill(ToPrefill::Plan(Plan {
            request: RequestId(7),
            tenant: TenantId(3),
            nonce: Nonce(0xfeed),
            prompt: vec![1, 2, 3],
            tokens: 3,
            geometry: g,
            page_size: 16,
            pages: vec![PlannedPage {
                index: 4,
                generation: 9,
            }],
            sampling: handoff::SamplingParams {
                temperature: 0.7,
                top_k: Some(40),
                top_p: Some(0.9),
                seed: 99,
                stop_ids: vec![1, 2],
                logprobs: Some(5),
            },
            model: Some(handoff::model::ModelFingerprint::from_u64(
                0xabcd_ef01_2345_6789,
            )),
            peer: Some(handoff::transfer::PeerId::from_bytes([0x5a; 32])),
            prefix_cache: true,
        })),
        Frame::ToPrefill(ToPrefill::Answer(Answer {
            request: RequestId(7),
            nonce: Nonce(1),
            verdict: Verdict::Fail(FailReason::Cancelled),
        })),
        Frame::Credit(4096),
        Frame::Write(
            WriteBatch {
                request: RequestId(7),
                nonce: Nonce(2),
                layer: 1,
                start: 16,
                tokens: 1,
            },
            &[1, 2, 3, 4, 5, 6, 7, 8],
        ),
        Frame::ToDecode(ToDecode::Receipt(Receipt {
            request: RequestId(7),
            nonce: Nonce(3),
            layer_tokens: vec![3, 3],
            pages: vec![PlannedPage {
                index: 4,
                generation: 9,
            }],
            page_checksums: vec![u64::MAX],
            writers: vec![WriterRun {
                layer: 0,
                start: 0,
                len: 3,
                writer: RequestId(7),
            }],
            first_token: Some(42),
            first_logprobs: Some(handoff::sampling::TokenLogprobs {
                token: 42,
                logprob: -0.25,
                top: vec![(42, -0.25), (7, -1.5)],
            }),
        })),
    ]
}

#[test]
fn a_receipt_with_more_than_twenty_alternatives_is_refused() {
    let Some(Frame::ToDecode(ToDecode::Receipt(mut r))) = sample_frames().pop() else {
        panic!("the last sample frame is a receipt");
    };
    let lp = r.first_logprobs.as_mut().unwrap();
    lp.top = (0..21).map(|i| (i, -1.0 - i as f32)).collect();
    let mut b = Vec::new();
    encode_frame(&mut b, 0, &Frame::ToDecode(ToDecode::Receipt(r.clone())));
    assert!(matches!(
        decode_frame(&b, MAX),
        Err(WireError::Invalid { .. })
    ));
    r.first_logprobs.as_mut().unwrap().top.truncate(20);
    let mut b = Vec::new();
    encode_frame(&mut b, 0, &Frame::ToDecode(ToDecode::Receipt(r)));
    assert!(matches!(decode_frame(&b, MAX), Ok(Some(_))));
}

#[test]
fn every_frame_kind_round_trips() {
    for (seq, f) in sample_frames().into_iter().enumerate() {
        let mut b = Vec::new();
        encode_frame(&mut b, seq as u32, &f);
        let (h, back, used) = decode_frame(&b, MAX).unwrap().unwrap();
        assert_eq!(h.seq, seq as u32);
        assert_eq!(used, b.len());
        assert_eq!(back, f);
        // Every strict prefix is "incomplete" or a typed error, never a frame.
        for cut in 0..b.len() {
            assert!(!matches!(decode_frame(&b[..cut], MAX), Ok(Some(_))));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn the_decoder_never_panics_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_frame(&bytes, 1 << 16);
    }

    #[test]
    fn the_decoder_never_panics_on_valid_headers_with_arbitrary_payloads(
        kind in 1u8..=7,
        payload in proptest::collection::vec(any::<u8>(), 0..512),
    ) {
        let mut b = Vec::new();
        b.extend_from_slice(&frame::MAGIC);
        b.extend_from_slice(&frame::VERSION.to_le_bytes());
        b.push(kind);
        b.push(0);
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        b.extend_from_slice(&payload);
        let _ = decode_frame(&b, 1 << 16);
    }

    #[test]
    fn flipping_any_byte_of_a_frame_never_panics(i in 0usize..4096, bit in 0u8..8) {
        for f in sample_frames() {
            let mut b = Vec::new();
            encode_frame(&mut b, 0, &f);
            let i = i % b.len();
            b[i] ^= 1 << bit;
            let _ = decode_frame(&b, MAX);
        }
    }
}

#[test]
fn prefill_end_closes_on_a_bad_frame_before_its_side_reads_anything() {
    // The connection ends as soon as the bytes are bad, not when the host
    // next polls its prefill side (it may be busy computing a long prompt).
    let cfg = TransferConfig::default()
        .with_max_batch_bytes(64 << 10)
        .with_max_frame_bytes(MAX);
    let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
    let addr = listener.local_addr().unwrap();
    let peer = raw_decode_peer(
        listener,
        When::First,
        b"GET / HTTP/1.1\r\n\r\n".to_vec(),
        false,
    );
    let link = TcpPrefill::connect(addr, &cfg).unwrap();
    let closed = peer.join().unwrap();
    drop(link);
    assert!(
        closed,
        "the prefill end kept a connection open after bad bytes"
    );
}

/// The first bytes of a valid frame: a header and part of its payload.
fn half_a_frame(seq: u32, frame: &Frame<'_>) -> Vec<u8> {
    let mut b = Vec::new();
    encode_frame(&mut b, seq, frame);
    assert!(b.len() > HEADER_LEN + 2);
    b.truncate(HEADER_LEN + 2);
    b
}

#[test]
fn a_peer_stuck_in_the_middle_of_a_frame_ends_the_decode_link() {
    // Once a frame has begun, the rest must follow within the write
    // timeout; between frames a link may idle as long as it likes.
    let receipt = Receipt {
        request: RequestId(1),
        nonce: Nonce(1),
        layer_tokens: vec![20; 2],
        pages: vec![],
        page_checksums: vec![],
        writers: vec![],
        first_token: None,
        first_logprobs: None,
    };
    let half = half_a_frame(1, &Frame::ToDecode(ToDecode::Receipt(receipt)));
    let cfg = wire_config().with_write_timeout(Duration::from_millis(300));
    let (err, pool) = decode_receives_with(cfg, half);
    assert!(matches!(wire(err), WireError::Stalled { waited_ms: 300 }));
    assert!(pool.stats().is_full());
}

#[test]
fn a_peer_stuck_in_the_middle_of_a_frame_ends_the_prefill_link() {
    let answer = Answer {
        request: RequestId(1),
        nonce: Nonce(1),
        verdict: Verdict::Ack,
    };
    let half = half_a_frame(1, &Frame::ToPrefill(ToPrefill::Answer(answer)));
    let mut hello = Vec::new();
    encode_frame(&mut hello, 0, &Frame::Hello(Role::Decode));
    hello.extend(half);
    let cfg = wire_config().with_write_timeout(Duration::from_millis(300));
    let end = prefill_receives_with(cfg, When::First, hello, false);
    assert!(end.closed, "prefill must close the connection");
    assert!(
        matches!(
            end.error,
            LinkError::Wire(WireError::Stalled { waited_ms: 300 })
        ),
        "{:?}",
        end.error
    );
}

#[test]
fn an_idle_link_between_frames_stays_up() {
    // A read timeout between frames is no error: a decode end with nothing
    // to send for many write timeouts keeps its link.
    let cfg = wire_config().with_write_timeout(Duration::from_millis(50));
    let listener = TcpDecodeListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
    let addr = listener.local_addr().unwrap();
    let prefill = std::thread::spawn({
        let cfg = cfg.clone();
        move || TcpPrefill::connect(addr, &cfg).unwrap()
    });
    let link = listener.accept(&cfg).unwrap();
    let prefill_link = prefill.join().unwrap();
    let pool = KvPool::new(PoolConfig::new(geometry(), 16, 8)).unwrap();
    let mut decode = DecodeSide::new(link, pool.clone(), AdmissionLimits::new(64, 8, 16), cfg);
    // Ten write timeouts of silence.
    let _ = decode.poll(Duration::from_millis(500));
    assert_eq!(decode.link_error(), None);
    drop(prefill_link);
}

#[test]
fn a_decode_listener_waits_for_a_prefill_peer_only_as_long_as_it_is_told() {
    // A prefill process that died before connecting: accept_within gives up
    // with a typed timeout (504) instead of blocking for ever.
    let cfg = TransferConfig::default();
    let mut listener = TcpDecodeListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
    let start = std::time::Instant::now();
    let e = listener
        .accept_within(&cfg, Duration::from_millis(100))
        .err()
        .expect("nobody connected");
    assert!(
        matches!(e, LinkError::AcceptTimeout { waited_ms } if waited_ms >= 100),
        "{e}"
    );
    assert_eq!(handoff::HttpStatus::http_status(&e), 504);
    assert!(start.elapsed() < Duration::from_secs(5));
    // The same listener still accepts a peer that does connect, and the link
    // it gives works in blocking mode.
    let addr = listener.local_addr().unwrap();
    let peer = std::thread::spawn(move || TcpPrefill::connect(addr, &TransferConfig::default()));
    let mut decode = listener
        .accept_within(&cfg, Duration::from_secs(10))
        .unwrap();
    let mut prefill = peer.join().unwrap().unwrap();
    use handoff::transfer::{DecodeLink, PrefillLink};
    prefill
        .send(ToDecode::Abort(handoff::transfer::Abort {
            request: RequestId(1),
            nonce: Nonce(7),
            reason: handoff::transfer::AbortReason::EmptyPrompt,
        }))
        .unwrap();
    let got = decode.recv(Duration::from_secs(5)).unwrap();
    assert!(matches!(got, Some(ToDecode::Abort(_))), "{got:?}");
}
