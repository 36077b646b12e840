//! Authenticated links: the deployment's link key, the handshake that proves
//! both ends hold it, and the session keys that seal every frame after it.
//!
//! # Design
//!
//! A deployment shares one 32-byte [`LinkKey`] between its prefill and decode
//! workers (as it shares model weights). A TCP link configured with it
//! ([`TransferConfig::with_link_key`](crate::transfer::TransferConfig::with_link_key))
//! runs the Noise handshake `Noise_NNpsk0_25519_AESGCM_SHA256` (through the
//! `snow` crate) before any frame:
//!
//! ```text
//! prefill (initiator)                       decode (responder)
//!   -> psk, e          msg 1: sealed under a key derived from the link key
//!                      (a stranger's msg 1 does not decrypt: refused)
//!   <- e, ee           msg 2: sealed under the link key and the fresh
//!                      ephemeral-ephemeral secret (prefill refuses a decode
//!                      end without the key)
//!   -> Hello           the first frame, sealed under the session key: the
//!                      proof that this initiator took part in *this*
//!                      exchange (a replayed msg 1 cannot produce it)
//!   <- Hello           decode's first frame, sealed: the acceptance. The
//!                      decode end sends it only once its accept loop hands
//!                      this connection out as its link
//! ```
//!
//! Only after the prefill end's Hello opens does the decode end hand out
//! the link; only after the decode end's Hello opens, within the handshake
//! deadline, does the prefill end's `connect` return: a decode end that
//! completed the exchange but never took the link (its link already taken,
//! its owner no longer accepting) is [`AuthError::NotAccepted`], not a link
//! that silently never carries a plan.
//!
//! Every frame after the handshake is sealed with AEGIS-128X4 (the `aegis`
//! crate: CFRG's AEGIS AEAD, built on the AES round) under a per-direction key from the handshake's split,
//! with the frame counter as nonce and the frame header as associated data:
//! plans, KV bytes, receipts (and so the per-page checksums they carry),
//! aborts and credits are encrypted and bound to this session and to their
//! place in it. A frame altered, replayed, reordered or written by anyone
//! without the session key fails to open and closes the link
//! ([`AuthError::Forged`]). The ephemerals give forward secrecy: a recorded
//! session stays sealed if the link key leaks later.
//!
//! Why this and not mutual TLS: the deployment already distributes a secret
//! (no CA, certificates or rotation to run for a two-process link), Noise
//! NNpsk0 is a published, analysed pattern with a maintained implementation,
//! and a whole 1 MiB KV frame is sealed in place with one tag, where TLS
//! would split it into 16 KiB records. The handshake itself names AES-GCM
//! (it seals the two 48-byte handshake messages); only the split's keys
//! reach the frame cipher, and nothing else uses them.
//!
//! Why AEGIS-128X4 for frames: on a link that moves gigabytes of KV the
//! cipher's speed is the cost of authentication. AEGIS-128X4 runs four AES
//! lanes per block with VAES/AVX-512 and seals ~65-75 GB/s per core on the
//! 2-core machine of `BENCHMARKS.md`, where ring's AES-256-GCM sealed
//! 7-9 GB/s and cost a third of an 8k-token transfer. Its 128-bit key and
//! 128-bit nonce are AES-128's security level, TLS 1.3's default.
//!
//! Cost: `benches/transfer.rs` (8k tokens of Llama-3-8B-shaped KV, 1 GiB)
//! prints authentication's share of the TCP transfer per rep; the figures
//! are in `BENCHMARKS.md`. Everything is encrypted and authenticated, KV
//! included.
//!
//! Without a link key the TCP transport stays available on loopback only,
//! unauthenticated and unencrypted: for tests, demos and single-user hosts.
//! Any local process can then connect as the peer.

use std::fmt;

use aegis::aegis128x4::Aegis128X4;

use crate::http::HttpStatus;
use crate::transfer::error::LinkError;

/// The Noise pattern and primitives of every authenticated link.
pub(crate) const NOISE_PATTERN: &str = "Noise_NNpsk0_25519_AESGCM_SHA256";
/// Bound into the handshake: a peer of another protocol or version derives
/// other keys.
const PROLOGUE: &[u8] = b"handoff transfer link, frames v3 (AEGIS-128X4)";
/// First bytes of each handshake message ("HNDA": handoff, authenticated).
pub(crate) const HS_MAGIC: [u8; 4] = *b"HNDA";
/// Bytes of a handshake message's header: magic, version, length.
pub(crate) const HS_HEADER_LEN: usize = 8;
/// What a decode end sends, in place of its handshake message, to a
/// connection it closes unread to make room ("HNDB": handoff, busy). Not
/// authenticated: anyone could send it, and all it does is make the prefill
/// end try again within its own deadline.
pub(crate) const BUSY_MAGIC: [u8; 4] = *b"HNDB";
/// Version of the handshake framing.
pub(crate) const HS_VERSION: u16 = 1;
/// The longest handshake message accepted (NNpsk0's are 48 bytes).
pub(crate) const HS_MAX: usize = 128;
/// Bytes of the tag that ends every sealed frame.
pub const TAG_LEN: usize = 16;

/// The deployment's shared secret for its transfer links: 32 random bytes,
/// the same at every prefill and decode worker of the deployment. Keep it
/// as you keep other credentials (a secret store, a file only the service
/// user reads); it never crosses the link. `Debug` does not print it.
#[derive(Clone, PartialEq, Eq)]
pub struct LinkKey([u8; 32]);

impl LinkKey {
    /// A key from its 32 bytes.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        LinkKey(bytes)
    }

    /// A fresh random key from the operating system's generator.
    pub fn generate() -> Result<Self, LinkError> {
        use ring::rand::SecureRandom;
        let mut k = [0u8; 32];
        ring::rand::SystemRandom::new()
            .fill(&mut k)
            .map_err(|_| AuthError::Crypto {
                what: "the system random generator failed",
            })?;
        Ok(LinkKey(k))
    }

    /// A key from 64 hex digits (as [`LinkKey::to_hex`] writes it).
    pub fn from_hex(s: &str) -> Result<Self, LinkError> {
        let bad = LinkError::Config {
            what: "a link key is 64 hex digits (32 bytes)",
        };
        let s = s.trim();
        if s.len() != 64 || !s.is_ascii() {
            return Err(bad);
        }
        let mut k = [0u8; 32];
        for (i, b) in k.iter_mut().enumerate() {
            *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| bad.clone())?;
        }
        Ok(LinkKey(k))
    }

    /// The key as 64 hex digits, to hand to another process of the
    /// deployment.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    pub(crate) fn bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Debug for LinkKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LinkKey(<redacted>)")
    }
}

/// Why a connection was not authenticated, or an authenticated link ended.
/// The connection is closed; nothing it sent was applied.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AuthError {
    #[error(
        "the peer speaks the unauthenticated protocol: configure the same link key on both ends"
    )]
    PeerUnauthenticated,
    #[error("the peer expects an authenticated link: configure the same link key on both ends")]
    PeerAuthenticated,
    #[error("the peer sent {got:02x?}, not a handoff handshake: check the address")]
    NotHandoff { got: [u8; 4] },
    #[error(
        "handshake version {got} not supported (this build speaks {supported}): upgrade one side"
    )]
    Version { got: u16, supported: u16 },
    #[error("handshake message of {len} bytes exceeds {max}: the peer is not handoff or broken")]
    Oversized { len: usize, max: usize },
    #[error(
        "the peer's handshake does not open under this deployment's link key: it holds another \
         key or none; refused"
    )]
    BadCredential,
    #[error(
        "the peer finished the key exchange but could not prove the session key: a replayed or \
         forged handshake; refused"
    )]
    NotConfirmed,
    #[error("the peer did not authenticate within {waited_ms} ms: closed")]
    Deadline { waited_ms: u128 },
    #[error(
        "{pending} connections from one source were waiting to authenticate, none of them having \
         sent a valid first handshake message: the oldest silent one was closed (a flood?)"
    )]
    Evicted { pending: usize },
    #[error(
        "the decode end was full of connections that had not authenticated and closed this one \
         before reading it: retried until the handshake deadline (a flood at the decode end?)"
    )]
    Busy,
    #[error(
        "the decode end completed the handshake but did not accept the link within {waited_ms} \
         ms: is it accepting (its link may be taken by another prefill worker)?"
    )]
    NotAccepted { waited_ms: u128 },
    #[error(
        "the decode end closed the connection during the handshake: it refused this peer (check \
         that both ends hold the same link key)"
    )]
    Closed,
    #[error(
        "frame {seq} failed authentication: altered, replayed, reordered or written without the \
         session key; link closed"
    )]
    Forged { seq: u64 },
    #[error("2^64 frames sealed under one session key: reconnect for a new session")]
    Exhausted,
    #[error("local cryptography failed: {what}")]
    Crypto { what: &'static str },
}

impl HttpStatus for AuthError {
    fn http_status(&self) -> u16 {
        match self {
            // This host could not run its own cryptography.
            AuthError::Crypto { .. } => 500,
            _ => 502,
        }
    }
}

/// One side of a handshake in progress.
pub(crate) struct Handshake(snow::HandshakeState);

impl Handshake {
    /// The prefill end's handshake (it connects).
    pub(crate) fn initiator(key: &LinkKey) -> Result<Self, AuthError> {
        Self::build(key, true)
    }
    /// The decode end's handshake (it listens).
    pub(crate) fn responder(key: &LinkKey) -> Result<Self, AuthError> {
        Self::build(key, false)
    }

    fn build(key: &LinkKey, initiator: bool) -> Result<Self, AuthError> {
        let crypto = |_| AuthError::Crypto {
            what: "the Noise handshake could not be set up",
        };
        let params = NOISE_PATTERN.parse().map_err(crypto)?;
        let b = snow::Builder::new(params)
            .prologue(PROLOGUE)
            .map_err(crypto)?
            .psk(0, key.bytes())
            .map_err(crypto)?;
        let hs = if initiator {
            b.build_initiator()
        } else {
            b.build_responder()
        };
        Ok(Handshake(hs.map_err(crypto)?))
    }

    /// This side's next handshake message, framed (magic, version, length).
    pub(crate) fn write(&mut self) -> Result<Vec<u8>, AuthError> {
        let mut msg = [0u8; HS_MAX];
        let n = self
            .0
            .write_message(&[], &mut msg)
            .map_err(|_| AuthError::Crypto {
                what: "a handshake message could not be written",
            })?;
        let mut out = Vec::with_capacity(HS_HEADER_LEN + n);
        out.extend_from_slice(&HS_MAGIC);
        out.extend_from_slice(&HS_VERSION.to_le_bytes());
        out.extend_from_slice(&(n as u16).to_le_bytes());
        out.extend_from_slice(&msg[..n]);
        Ok(out)
    }

    /// Reads the peer's handshake message (its body, after the header).
    pub(crate) fn read(&mut self, body: &[u8]) -> Result<(), AuthError> {
        let mut payload = [0u8; HS_MAX];
        self.0
            .read_message(body, &mut payload)
            .map(|_| ())
            .map_err(|_| AuthError::BadCredential)
    }

    /// The session's keys, once the exchange is complete.
    pub(crate) fn split(mut self) -> Result<Session, AuthError> {
        if !self.0.is_handshake_finished() {
            return Err(AuthError::Crypto {
                what: "session keys asked for before the handshake finished",
            });
        }
        let initiator = self.0.is_initiator();
        let (i2r, r2i) = self.0.dangerously_get_raw_split();
        let (send, recv) = if initiator { (i2r, r2i) } else { (r2i, i2r) };
        Ok(Session {
            sealer: Sealer::new(&send),
            opener: Opener::new(&recv),
        })
    }
}

/// Checks a handshake message's header; `Ok(len)` is its body's length.
pub(crate) fn hs_header(h: &[u8; HS_HEADER_LEN]) -> Result<usize, AuthError> {
    let magic = [h[0], h[1], h[2], h[3]];
    if magic == crate::transfer::link::tcp::frame::MAGIC {
        return Err(AuthError::PeerUnauthenticated);
    }
    if magic == BUSY_MAGIC {
        return Err(AuthError::Busy);
    }
    if magic != HS_MAGIC {
        return Err(AuthError::NotHandoff { got: magic });
    }
    let version = u16::from_le_bytes([h[4], h[5]]);
    if version != HS_VERSION {
        return Err(AuthError::Version {
            got: version,
            supported: HS_VERSION,
        });
    }
    let len = u16::from_le_bytes([h[6], h[7]]) as usize;
    if len > HS_MAX {
        return Err(AuthError::Oversized { len, max: HS_MAX });
    }
    Ok(len)
}

/// The two directions of an authenticated session.
pub(crate) struct Session {
    pub(crate) sealer: Sealer,
    pub(crate) opener: Opener,
}

/// The frame cipher's key: the first 16 bytes of a direction's 32-byte
/// split key (HKDF output, uniformly random, so any 16 of its bytes are a
/// uniformly random AEGIS-128X4 key; the other 16 are never used).
fn aead_key(k: &[u8; 32]) -> aegis::aegis128x4::Key {
    let mut key = [0u8; 16];
    key.copy_from_slice(&k[..16]);
    key
}

/// The frame counter as a 128-bit AEGIS nonce. Each direction has its own
/// key, and the counter never repeats under it.
fn nonce(n: u64) -> aegis::aegis128x4::Nonce {
    let mut b = [0u8; 16];
    b[8..].copy_from_slice(&n.to_be_bytes());
    b
}

/// Seals this side's frames, in order.
pub(crate) struct Sealer {
    key: aegis::aegis128x4::Key,
    next: u64,
}

impl Sealer {
    fn new(k: &[u8; 32]) -> Self {
        Sealer {
            key: aead_key(k),
            next: 0,
        }
    }

    /// Encrypts `body` in place under `header` (associated data) and returns
    /// the tag to append. The header must already carry the sealed flag and
    /// the sealed length.
    pub(crate) fn seal(
        &mut self,
        header: &[u8],
        body: &mut [u8],
    ) -> Result<[u8; TAG_LEN], AuthError> {
        let n = self.next;
        self.next = n.checked_add(1).ok_or(AuthError::Exhausted)?;
        Ok(Aegis128X4::<TAG_LEN>::new(&self.key, &nonce(n)).encrypt_in_place(body, header))
    }
}

/// Opens the peer's frames, in order.
pub(crate) struct Opener {
    key: aegis::aegis128x4::Key,
    next: u64,
}

impl Opener {
    fn new(k: &[u8; 32]) -> Self {
        Opener {
            key: aead_key(k),
            next: 0,
        }
    }

    /// Decrypts `sealed` (body then tag) in place under `header`; on success
    /// `sealed` is truncated to the plaintext body. A frame that does not
    /// open is [`AuthError::Forged`] (its buffer is wiped).
    pub(crate) fn open(&mut self, header: &[u8], sealed: &mut Vec<u8>) -> Result<(), AuthError> {
        let n = self.next;
        self.next = n.checked_add(1).ok_or(AuthError::Exhausted)?;
        let body_len = sealed
            .len()
            .checked_sub(TAG_LEN)
            .ok_or(AuthError::Forged { seq: n })?;
        let (body, tag) = sealed.split_at_mut(body_len);
        let mut t = [0u8; TAG_LEN];
        t.copy_from_slice(tag);
        Aegis128X4::<TAG_LEN>::new(&self.key, &nonce(n))
            .decrypt_in_place(body, &t, header)
            .map_err(|_| AuthError::Forged { seq: n })?;
        sealed.truncate(body_len);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(a: &LinkKey, b: &LinkKey) -> Result<(Session, Session), AuthError> {
        let mut i = Handshake::initiator(a)?;
        let mut r = Handshake::responder(b)?;
        let m1 = i.write()?;
        r.read(&m1[HS_HEADER_LEN..])?;
        let m2 = r.write()?;
        i.read(&m2[HS_HEADER_LEN..])?;
        Ok((i.split()?, r.split()?))
    }

    #[test]
    fn both_ends_with_the_key_share_a_session_and_strangers_do_not() {
        let key = LinkKey::generate().unwrap();
        let (mut p, mut d) = pair(&key, &key).unwrap();
        let header = [7u8; 16];
        let mut body = b"plan: tenant 7, prompt 1 2 3".to_vec();
        let tag = p.sealer.seal(&header, &mut body).unwrap();
        assert_ne!(&body[..], b"plan: tenant 7, prompt 1 2 3", "encrypted");
        body.extend_from_slice(&tag);
        let mut replay = body.clone();
        d.opener.open(&header, &mut body).unwrap();
        assert_eq!(&body[..], b"plan: tenant 7, prompt 1 2 3");
        // The same bytes again (a replay) are refused: the counter moved.
        assert_eq!(
            d.opener.open(&header, &mut replay),
            Err(AuthError::Forged { seq: 1 })
        );

        let other = LinkKey::generate().unwrap();
        assert_eq!(pair(&other, &key).err(), Some(AuthError::BadCredential));
    }

    #[test]
    fn a_key_survives_hex_and_debug_hides_it() {
        let key = LinkKey::generate().unwrap();
        assert_eq!(LinkKey::from_hex(&key.to_hex()).unwrap(), key);
        assert!(!format!("{key:?}").contains(&key.to_hex()[..8]));
        assert!(LinkKey::from_hex("12").is_err());
        assert!(LinkKey::from_hex(&"zz".repeat(32)).is_err());
    }
}
