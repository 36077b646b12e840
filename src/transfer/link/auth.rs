//! Authenticated links: the handshake that proves each end is the worker
//! it claims to be, and one its peer trusts, and the session keys that seal
//! every frame after it.
//!
//! # Design
//!
//! Every worker has its own long-term X25519 key pair
//! ([`WorkerKey`](crate::transfer::link::identity::WorkerKey)); its public
//! half is its [`PeerId`]. The operator pins the ids of the deployment's
//! workers in an [`Allowlist`](crate::transfer::link::identity::Allowlist).
//! A TCP link configured with an identity
//! ([`TransferConfig::with_identity`](crate::transfer::TransferConfig::with_identity))
//! runs the Noise handshake `Noise_IK_25519_AESGCM_SHA256` (through the
//! `snow` crate) before any frame. The prefill end dials one decode worker
//! by address *and* id (from the operator or the registry):
//!
//! ```text
//! prefill (initiator, knows decode's id)        decode (responder)
//!   -> e, es, s, ss    msg 1: prefill's static key, sealed to decode's; its
//!                      tag needs prefill's secret key. Decode opens it,
//!                      learns prefill's id and refuses it unless it is on
//!                      decode's allowlist (UnknownPeer), before answering
//!   <- e, ee, se       msg 2: opens at prefill only if the answering end
//!                      holds the secret of the id prefill dialled
//!   -> Hello           the first frame, sealed under the session key: the
//!                      proof that this initiator took part in *this*
//!                      exchange (a replayed msg 1 cannot produce it)
//!   <- Hello           decode's first frame, sealed: the acceptance. The
//!                      decode end sends it only once its accept loop hands
//!                      this connection out as its link
//! ```
//!
//! The prefill end refuses to dial an id that is not on its own allowlist.
//! Each refusal of an unknown peer is an [`AuthError::UnknownPeer`] and is
//! counted on the worker's identity
//! ([`Identity::refused_peers`](crate::transfer::link::identity::Identity::refused_peers)).
//! Only after the prefill end's Hello opens does the decode end hand out
//! the link; only after the decode end's Hello opens, within the handshake
//! deadline, does the prefill end's `connect` return: a decode end that
//! completed the exchange but never took the link is
//! [`AuthError::NotAccepted`], not a link that silently never carries a
//! plan. Both ends then know the link's authenticated peer, and the decode
//! side binds every plan, receipt and write to it.
//!
//! Why IK, and not XX or KK: the decode end must tell a trusted worker from
//! a stranger at the *first* message, because its accept loop protects a
//! connection that has begun a valid handshake from eviction by a flood; in
//! IK the first message already names the initiator's key and proves it
//! holds the secret, so a stranger's is refused at once (XX reveals the
//! initiator only in its third message, so any stranger could begin one).
//! KK would need the decode end to know which worker is dialling before
//! the first byte, which an accept loop serving many prefill workers does
//! not. IK's cost is that the prefill end must know the decode worker's id
//! in advance, which it does: it picks the decode worker by id. No shared
//! secret remains: with per-worker keys and the allowlist, a worker's key
//! lets nobody pose as another worker, and removing a worker from the
//! allowlist revokes it without touching the others, which a deployment-
//! wide pre-shared key could not do (so none is kept).
//!
//! Every frame after the handshake is sealed with AEGIS-128X4 (the `aegis`
//! crate: CFRG's AEGIS AEAD, built on the AES round) under a per-direction
//! key from the handshake's split, with the frame counter as nonce and the
//! frame header as associated data: plans, KV bytes, receipts (and so the
//! per-page checksums they carry), aborts and credits are encrypted and
//! bound to this session and to their place in it. A frame altered,
//! replayed, reordered or written by anyone without the session key fails
//! to open and closes the link ([`AuthError::Forged`]). The ephemerals give
//! forward secrecy: a recorded session stays sealed if a worker key leaks
//! later.
//!
//! Why this and not mutual TLS: Noise IK with pinned public keys needs no
//! CA or certificates, is a published, analysed pattern with a maintained
//! implementation, and a whole 1 MiB KV frame is sealed in place with one
//! tag, where TLS would split it into 16 KiB records. The handshake itself
//! names AES-GCM (it seals the two handshake messages); only the split's
//! keys reach the frame cipher, and nothing else uses them.
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
//! Without an identity the TCP transport stays available on loopback only,
//! unauthenticated and unencrypted: for tests, demos and single-user hosts.
//! Any local process can then connect as the peer.

use std::sync::Arc;

use aegis::aegis128x4::Aegis128X4;

use crate::http::HttpStatus;
use crate::transfer::link::identity::{Identity, PeerId};

/// The Noise pattern and primitives of every authenticated link.
pub(crate) const NOISE_PATTERN: &str = "Noise_IK_25519_AESGCM_SHA256";
/// Bound into the handshake: a peer of another protocol or version derives
/// other keys.
const PROLOGUE: &[u8] = b"handoff transfer link, worker keys (Noise IK), frames v4 (AEGIS-128X4)";
/// First bytes of each handshake message ("HNDA": handoff, authenticated).
pub(crate) const HS_MAGIC: [u8; 4] = *b"HNDA";
/// Bytes of a handshake message's header: magic, version, length.
pub(crate) const HS_HEADER_LEN: usize = 8;
/// What a decode end sends, in place of its handshake message, to a
/// connection it closes unread to make room ("HNDB": handoff, busy). Not
/// authenticated: anyone could send it, and all it does is make the prefill
/// end try again within its own deadline.
pub(crate) const BUSY_MAGIC: [u8; 4] = *b"HNDB";
/// Version of the handshake framing (2: Noise IK with worker keys).
pub(crate) const HS_VERSION: u16 = 2;
/// The longest handshake message accepted (IK's are 96 and 48 bytes).
pub(crate) const HS_MAX: usize = 128;
/// Bytes of the tag that ends every sealed frame.
pub const TAG_LEN: usize = 16;

/// Why a connection was not authenticated, or an authenticated link ended.
/// The connection is closed; nothing it sent was applied.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AuthError {
    #[error(
        "the peer speaks the unauthenticated protocol: configure a worker identity on both ends"
    )]
    PeerUnauthenticated,
    #[error("the peer expects an authenticated link: configure a worker identity on both ends")]
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
        "the peer's handshake does not open: it does not hold the secret key of the worker it \
         claims to be (or, at the prefill end, of the decode worker it dialled); refused"
    )]
    BadCredential,
    #[error(
        "peer {peer} is not on this worker's allowlist: refused (add its id to the allowlist if \
         it belongs to the deployment)"
    )]
    UnknownPeer { peer: PeerId },
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
         that each end's id is on the other's allowlist)"
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
pub(crate) struct Handshake {
    state: snow::HandshakeState,
    identity: Arc<Identity>,
}

impl Handshake {
    /// The prefill end's handshake (it connects) to the decode worker
    /// `responder`, which must be on this worker's allowlist.
    pub(crate) fn initiator(
        identity: &Arc<Identity>,
        responder: &PeerId,
    ) -> Result<Self, AuthError> {
        if !identity.trusted().contains(responder) {
            identity.refused_one();
            return Err(AuthError::UnknownPeer { peer: *responder });
        }
        Self::build(identity, Some(responder))
    }
    /// The decode end's handshake (it listens).
    pub(crate) fn responder(identity: &Arc<Identity>) -> Result<Self, AuthError> {
        Self::build(identity, None)
    }

    fn build(identity: &Arc<Identity>, remote: Option<&PeerId>) -> Result<Self, AuthError> {
        let crypto = |_| AuthError::Crypto {
            what: "the Noise handshake could not be set up",
        };
        let params = NOISE_PATTERN.parse().map_err(crypto)?;
        let b = snow::Builder::new(params)
            .prologue(PROLOGUE)
            .map_err(crypto)?
            .local_private_key(identity.key().secret())
            .map_err(crypto)?;
        let state = match remote {
            Some(peer) => b
                .remote_public_key(peer.as_bytes())
                .map_err(crypto)?
                .build_initiator(),
            None => b.build_responder(),
        };
        Ok(Handshake {
            state: state.map_err(crypto)?,
            identity: identity.clone(),
        })
    }

    /// This side's next handshake message, framed (magic, version, length).
    pub(crate) fn write(&mut self) -> Result<Vec<u8>, AuthError> {
        let mut msg = [0u8; HS_MAX];
        let n = self
            .state
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
    /// At the decode end this is the prefill end's first message, which
    /// names its worker key and proves it holds the secret half: a worker
    /// not on the allowlist is refused here, before any answer.
    pub(crate) fn read(&mut self, body: &[u8]) -> Result<(), AuthError> {
        let mut payload = [0u8; HS_MAX];
        self.state
            .read_message(body, &mut payload)
            .map_err(|_| AuthError::BadCredential)?;
        let peer = self.peer()?;
        if !self.identity.trusted().contains(&peer) {
            self.identity.refused_one();
            return Err(AuthError::UnknownPeer { peer });
        }
        Ok(())
    }

    /// The peer's worker key, once its handshake message named it (the
    /// decode end) or from the start (the prefill end, which dials one).
    fn peer(&self) -> Result<PeerId, AuthError> {
        self.state
            .get_remote_static()
            .and_then(|b| <[u8; 32]>::try_from(b).ok())
            .map(PeerId::from_bytes)
            .ok_or(AuthError::Crypto {
                what: "the handshake has no remote static key",
            })
    }

    /// The session's keys, once the exchange is complete.
    pub(crate) fn split(mut self) -> Result<Session, AuthError> {
        if !self.state.is_handshake_finished() {
            return Err(AuthError::Crypto {
                what: "session keys asked for before the handshake finished",
            });
        }
        let peer = self.peer()?;
        let initiator = self.state.is_initiator();
        let (i2r, r2i) = self.state.dangerously_get_raw_split();
        let (send, recv) = if initiator { (i2r, r2i) } else { (r2i, i2r) };
        Ok(Session {
            sealer: Sealer::new(&send),
            opener: Opener::new(&recv),
            peer,
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
    /// The peer's worker key, proved by the handshake.
    pub(crate) peer: PeerId,
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
    use crate::transfer::link::identity::{Allowlist, WorkerKey};

    fn identity(trusted: &[PeerId]) -> (Arc<Identity>, PeerId) {
        let key = WorkerKey::generate().unwrap();
        let id = key.peer_id();
        (
            Arc::new(Identity::new(key, Allowlist::of(trusted.iter().copied()))),
            id,
        )
    }

    fn pair(
        p: &Arc<Identity>,
        d: &Arc<Identity>,
        dialled: &PeerId,
    ) -> Result<(Session, Session), AuthError> {
        let mut i = Handshake::initiator(p, dialled)?;
        let mut r = Handshake::responder(d)?;
        let m1 = i.write()?;
        r.read(&m1[HS_HEADER_LEN..])?;
        let m2 = r.write()?;
        i.read(&m2[HS_HEADER_LEN..])?;
        Ok((i.split()?, r.split()?))
    }

    #[test]
    fn two_trusted_workers_share_a_session_and_each_learns_the_other() {
        let (pk, dk) = (
            WorkerKey::generate().unwrap(),
            WorkerKey::generate().unwrap(),
        );
        let (pid, did) = (pk.peer_id(), dk.peer_id());
        let both = Allowlist::of([pid, did]);
        let p = Arc::new(Identity::new(pk, both.clone()));
        let d = Arc::new(Identity::new(dk, both));
        let (mut ps, mut ds) = pair(&p, &d, &did).unwrap();
        assert_eq!((ps.peer, ds.peer), (did, pid));
        let header = [7u8; 16];
        let mut body = b"plan: tenant 7, prompt 1 2 3".to_vec();
        let tag = ps.sealer.seal(&header, &mut body).unwrap();
        assert_ne!(&body[..], b"plan: tenant 7, prompt 1 2 3", "encrypted");
        body.extend_from_slice(&tag);
        let mut replay = body.clone();
        ds.opener.open(&header, &mut body).unwrap();
        assert_eq!(&body[..], b"plan: tenant 7, prompt 1 2 3");
        // The same bytes again (a replay) are refused: the counter moved.
        assert_eq!(
            ds.opener.open(&header, &mut replay),
            Err(AuthError::Forged { seq: 1 })
        );
    }

    #[test]
    fn each_end_refuses_a_worker_off_its_allowlist_and_counts_it() {
        let (stranger, sid) = identity(&[]);
        let (d, did) = identity(&[]);
        // The decode end does not trust the stranger (who trusts it).
        let s2 = Arc::new(Identity::new(
            WorkerKey::from_secret(*stranger.key().secret()).unwrap(),
            Allowlist::of([did]),
        ));
        assert_eq!(
            pair(&s2, &d, &did).err(),
            Some(AuthError::UnknownPeer { peer: sid })
        );
        assert_eq!(d.refused_peers(), 1);
        // The prefill end refuses to dial a decode worker it does not trust.
        assert_eq!(
            pair(&stranger, &d, &did).err(),
            Some(AuthError::UnknownPeer { peer: did })
        );
        assert_eq!(stranger.refused_peers(), 1);
    }

    #[test]
    fn a_decode_end_without_the_dialled_key_cannot_answer() {
        let (pk, dk, ek) = (
            WorkerKey::generate().unwrap(),
            WorkerKey::generate().unwrap(),
            WorkerKey::generate().unwrap(),
        );
        let (pid, did, eid) = (pk.peer_id(), dk.peer_id(), ek.peer_id());
        let all = Allowlist::of([pid, did, eid]);
        let p = Arc::new(Identity::new(pk, all.clone()));
        // An impostor at the decode worker's address holds another
        // (trusted) key: the prefill end's message, sealed to the dialled
        // key, does not open there.
        let impostor = Arc::new(Identity::new(ek, all));
        assert_eq!(
            pair(&p, &impostor, &did).err(),
            Some(AuthError::BadCredential)
        );
    }
}
