//! Story: a model whose ids are bytes streams a character one byte at a
//! time. [`Utf8Decoder`] lets each character out whole once its last byte
//! has come, turns an invalid byte into U+FFFD where it stands, and at the
//! end shows an unfinished character as U+FFFD: what it emits, joined, is
//! `String::from_utf8_lossy` of all the bytes.

use handoff::text::Utf8Decoder;

#[test]
fn bytes_stream_out_as_whole_characters() {
    let mut d = Utf8Decoder::new();
    let euro = "€".as_bytes();
    assert_eq!(d.push(b'a'), "a");
    assert_eq!(d.push(euro[0]), "");
    assert_eq!(d.push(euro[1]), "");
    assert_eq!(d.pending(), &euro[..2]);
    assert_eq!(d.push(euro[2]), "€");
    assert!(d.pending().is_empty());
    assert_eq!(d.finish(), "");
}

#[test]
fn the_joined_output_is_the_lossy_decoding_of_every_byte() {
    let cases: [&[u8]; 5] = [
        "héllo → wörld 🎉".as_bytes(),
        b"ok\xffthen",
        b"\xe2\x82",
        b"a\xf0\x9f\x8e",
        b"\xc3\x28x",
    ];
    for bytes in cases {
        let mut d = Utf8Decoder::new();
        let mut out: String = bytes.iter().map(|&b| d.push(b)).collect();
        out.push_str(&d.finish());
        assert_eq!(out, String::from_utf8_lossy(bytes), "{bytes:?}");
        let mut whole = Utf8Decoder::new();
        let mut at_once = whole.push_bytes(bytes);
        at_once.push_str(&whole.finish());
        assert_eq!(at_once, out);
    }
}
