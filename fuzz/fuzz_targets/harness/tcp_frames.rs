//! `tcp_frames`: arbitrary bytes into the TCP frame decoder, as one stream
//! of frames and as a single payload of every kind.

use handoff::HttpStatus;
use handoff::transfer::WireError;
use handoff::transfer::tcp::frame::{
    HEADER_LEN, Kind, decode_frame, decode_header, decode_payload, encode_frame,
};

/// The largest payload the stream decoder accepts here: small, so that a
/// header naming anything larger must be refused before any allocation.
const MAX_PAYLOAD: usize = 1 << 12;

const KINDS: [Kind; 7] = [
    Kind::Hello,
    Kind::Plan,
    Kind::Answer,
    Kind::Credit,
    Kind::Write,
    Kind::Receipt,
    Kind::Abort,
];

fn typed(e: &WireError) {
    assert!(!e.to_string().is_empty(), "{e:?} has an empty message");
    let _ = e.http_status();
}

/// Decodes `data` as a stream: each frame decoded is re-encoded to exactly
/// the bytes it came from (the decoder accepts one spelling per frame, so
/// a frame cannot mean two things), and the stream ends in a typed error
/// or an incomplete tail whose header (if whole) is valid. Then decodes the
/// whole input as a payload of every kind: a frame or a typed error.
pub fn tcp_frames(data: &[u8]) {
    let _ = tcp_frames_stream(data);
}

/// What the stream decoding of one input came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stream {
    pub frames: usize,
    /// The input ended exactly at a frame boundary.
    pub clean_end: bool,
}

/// [`tcp_frames`], reporting how the stream decoding ended.
pub fn tcp_frames_stream(data: &[u8]) -> Stream {
    let mut rest = data;
    let mut frames = 0;
    loop {
        match decode_frame(rest, MAX_PAYLOAD) {
            Ok(Some((header, frame, used))) => {
                assert!(
                    (HEADER_LEN..=rest.len()).contains(&used),
                    "used {used} of {}",
                    rest.len()
                );
                assert_eq!(used, HEADER_LEN + header.len as usize);
                assert_eq!(frame.kind(), header.kind);
                let mut again = Vec::new();
                encode_frame(&mut again, header.seq, &frame);
                assert!(again == rest[..used], "{frame:?} re-encodes differently");
                rest = &rest[used..];
                frames += 1;
            }
            Ok(None) => {
                if let Some(h) = rest.get(..HEADER_LEN) {
                    let header = decode_header(h, MAX_PAYLOAD)
                        .expect("an incomplete frame's header is valid");
                    assert!(HEADER_LEN + (header.len as usize) > rest.len());
                }
                break;
            }
            Err(e) => {
                typed(&e);
                break;
            }
        }
    }
    for kind in KINDS {
        match decode_payload(kind, data) {
            Ok(frame) => assert_eq!(frame.kind(), kind),
            Err(e) => typed(&e),
        }
    }
    Stream {
        frames,
        clean_end: rest.is_empty(),
    }
}
