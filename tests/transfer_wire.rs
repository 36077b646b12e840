//! Story: bad bytes on the wire end the connection, not a request's
//! isolation.
//!
//! A peer (or a fault, or an attacker on the host) sends garbage, a frame
//! longer than allowed, frames out of sequence or in the wrong direction.
//! Each time the decode end reports a typed wire error, closes the
//! connection, fails the transfers in flight on it with that error, and
//! leaves its pool exactly as full as before. The frame decoder is a pure
//! function that never panics, whatever bytes it is fed.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use handoff::transfer::tcp::frame::{
    self, Frame, HEADER_LEN, Kind, Role, decode_frame, encode_frame, put_header,
};
use handoff::transfer::{
    Answer, DecodeSide, FailReason, LinkError, Nonce, Plan, PlannedPage, Receipt,
    TcpDecodeListener, ToDecode, ToPrefill, TransferConfig, TransferError, Verdict, WireError,
    WriteBatch, WriterRun,
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
    let cfg = TransferConfig::default()
        .with_max_batch_bytes(64 << 10)
        .with_max_frame_bytes(MAX);
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
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
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
    peer.join().unwrap();
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
            supported: 1
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
            },
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
        })),
    ]
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
