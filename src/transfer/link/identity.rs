//! Worker identity: each worker's own long-term X25519 key pair
//! ([`WorkerKey`]), the public half that names it ([`PeerId`]), and the
//! operator's list of the workers a deployment trusts ([`Allowlist`]).
//!
//! A worker generates its key once ([`WorkerKey::generate`]), keeps it in a
//! file only the service user reads ([`WorkerKey::save`],
//! [`WorkerKey::load`]) and publishes its [`PeerId`]; the operator pins
//! the ids of the deployment's workers in an allowlist file:
//!
//! ```text
//! # one worker per line: its public key (64 hex digits), then a name
//! 3b6a27bcceb6a42d62a3a8d02a6f0d73653215771de243a63ac048a18b59da29 prefill-0
//! e7d8a5f0c1b2...                                                  decode-0
//! ```
//!
//! Links authenticate with these keys (see [`crate::transfer::link::auth`]):
//! a worker proves it holds the secret half of its id, and each end
//! refuses a peer whose id is not on its allowlist. No secret is shared
//! between workers, so one worker's key lets nobody else pose as another.

use std::fmt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use snow::params::DHChoice;
use snow::resolvers::{CryptoResolver, DefaultResolver};

/// Why a key or an allowlist could not be made, read or written.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IdentityError {
    #[error("{path}: {error}")]
    Io { path: String, error: String },
    #[error("{path}: not a worker key file: {what}")]
    KeyFile { path: String, what: &'static str },
    #[error("{path}: exists already; a worker key is never overwritten")]
    Exists { path: String },
    #[error("allowlist line {line}: {what}")]
    AllowlistLine { line: usize, what: &'static str },
    #[error("not a peer id: {what}")]
    PeerId { what: &'static str },
    #[error("local cryptography failed: {what}")]
    Crypto { what: &'static str },
}

/// A worker's public key: 32 bytes that name it on every link and in every
/// plan addressed to it. Displayed as 64 hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId([u8; 32]);

impl PeerId {
    /// The id of the public key `bytes`.
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        PeerId(bytes)
    }

    /// The public key's bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// An id from 64 hex digits (as `Display` writes it).
    pub fn from_hex(s: &str) -> Result<Self, IdentityError> {
        hex32(s).map(PeerId).ok_or(IdentityError::PeerId {
            what: "a peer id is 64 hex digits (32 bytes)",
        })
    }

    /// A random id that names no key: in-process links use one to tell
    /// their peers apart (nothing to authenticate in one process).
    pub(crate) fn random_label() -> Result<Self, IdentityError> {
        use ring::rand::SecureRandom;
        let mut b = [0u8; 32];
        ring::rand::SystemRandom::new()
            .fill(&mut b)
            .map_err(|_| IdentityError::Crypto {
                what: "the system random generator failed",
            })?;
        Ok(PeerId(b))
    }

    fn from_slice(b: &[u8]) -> Result<Self, IdentityError> {
        <[u8; 32]>::try_from(b)
            .map(PeerId)
            .map_err(|_| IdentityError::Crypto {
                what: "an X25519 public key is 32 bytes",
            })
    }
}

impl fmt::Display for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PeerId({self})")
    }
}

/// 32 bytes from exactly 64 hex digits.
fn hex32(s: &str) -> Option<[u8; 32]> {
    let s = s.trim();
    if s.len() != 64 || !s.is_ascii() {
        return None;
    }
    let mut k = [0u8; 32];
    for (i, b) in k.iter_mut().enumerate() {
        *b = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(k)
}

fn io(path: &Path, e: std::io::Error) -> IdentityError {
    IdentityError::Io {
        path: path.display().to_string(),
        error: e.to_string(),
    }
}

/// First line of a worker key file.
const KEY_FILE_HEADER: &str = "handoff worker key v1 (X25519 secret, keep private)";

/// A worker's long-term X25519 key pair. The secret never leaves the
/// process except through [`WorkerKey::save`]; `Debug` prints only the
/// public half, and the secret is wiped when the key is dropped.
pub struct WorkerKey {
    secret: zeroize::Zeroizing<[u8; 32]>,
    public: PeerId,
}

impl WorkerKey {
    /// A fresh key pair from the operating system's generator (through
    /// `snow`'s X25519).
    pub fn generate() -> Result<Self, IdentityError> {
        let crypto = |_| IdentityError::Crypto {
            what: "an X25519 key pair could not be generated",
        };
        let params = crate::transfer::link::auth::NOISE_PATTERN
            .parse()
            .map_err(crypto)?;
        let pair = snow::Builder::new(params)
            .generate_keypair()
            .map_err(crypto)?;
        let mut secret = zeroize::Zeroizing::new([0u8; 32]);
        let private = zeroize::Zeroizing::new(pair.private);
        if private.len() != 32 {
            return Err(IdentityError::Crypto {
                what: "an X25519 secret is 32 bytes",
            });
        }
        secret.copy_from_slice(&private);
        Ok(WorkerKey {
            secret,
            public: PeerId::from_slice(&pair.public)?,
        })
    }

    /// The key whose secret half is `secret` (its public half derived).
    pub fn from_secret(secret: [u8; 32]) -> Result<Self, IdentityError> {
        let secret = zeroize::Zeroizing::new(secret);
        let mut dh =
            DefaultResolver
                .resolve_dh(&DHChoice::Curve25519)
                .ok_or(IdentityError::Crypto {
                    what: "X25519 is not available",
                })?;
        dh.set(&secret[..]);
        let public = PeerId::from_slice(dh.pubkey())?;
        Ok(WorkerKey { secret, public })
    }

    /// Reads a key written by [`WorkerKey::save`].
    pub fn load(path: impl AsRef<Path>) -> Result<Self, IdentityError> {
        let path = path.as_ref();
        let text = zeroize::Zeroizing::new(std::fs::read_to_string(path).map_err(|e| io(path, e))?);
        let bad = |what| IdentityError::KeyFile {
            path: path.display().to_string(),
            what,
        };
        let mut lines = text.lines();
        if lines.next().map(str::trim) != Some(KEY_FILE_HEADER) {
            return Err(bad("its first line is not the worker key header"));
        }
        let secret = lines
            .next()
            .and_then(hex32)
            .ok_or(bad("its second line is not 64 hex digits"))?;
        if lines.any(|l| !l.trim().is_empty()) {
            return Err(bad("it has more than the header and the key"));
        }
        Self::from_secret(secret)
    }

    /// Writes the key to a new file readable by its owner only (mode 0600
    /// on Unix); an existing file is never overwritten
    /// ([`IdentityError::Exists`]).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), IdentityError> {
        use std::io::Write;
        let path = path.as_ref();
        let mut opts = std::fs::OpenOptions::new();
        opts.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
        let mut f = opts.open(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::AlreadyExists => IdentityError::Exists {
                path: path.display().to_string(),
            },
            _ => io(path, e),
        })?;
        let hex: zeroize::Zeroizing<String> =
            zeroize::Zeroizing::new(self.secret.iter().map(|b| format!("{b:02x}")).collect());
        let text = zeroize::Zeroizing::new(format!("{KEY_FILE_HEADER}\n{}\n", hex.as_str()));
        f.write_all(text.as_bytes()).map_err(|e| io(path, e))?;
        f.sync_all().map_err(|e| io(path, e))
    }

    /// The public half: this worker's id.
    pub fn peer_id(&self) -> PeerId {
        self.public
    }

    pub(crate) fn secret(&self) -> &[u8; 32] {
        &self.secret
    }
}

impl fmt::Debug for WorkerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "WorkerKey {{ peer: {}, secret: <redacted> }}",
            self.public
        )
    }
}

/// The workers a deployment trusts, pinned by the operator: their ids and
/// optional names. A link to or from a worker not on it is refused.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Allowlist {
    peers: Vec<(PeerId, Option<String>)>,
}

impl Allowlist {
    /// An allowlist of `peers` (unnamed).
    pub fn of(peers: impl IntoIterator<Item = PeerId>) -> Self {
        let mut list = Allowlist::default();
        for p in peers {
            if !list.contains(&p) {
                list.peers.push((p, None));
            }
        }
        list
    }

    /// Parses an operator's allowlist: one peer per line, its id (64 hex
    /// digits) then optionally a name (one word); `#` starts a comment;
    /// blank lines are skipped. A line that is none of these, or names a
    /// peer twice, is an [`IdentityError::AllowlistLine`] naming it (lines
    /// count from 1).
    pub fn parse(text: &str) -> Result<Self, IdentityError> {
        let mut list = Allowlist::default();
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            let bad = |what| IdentityError::AllowlistLine { line, what };
            let content = raw.split('#').next().unwrap_or("").trim();
            if content.is_empty() {
                continue;
            }
            let mut words = content.split_whitespace();
            let id = words
                .next()
                .and_then(hex32)
                .map(PeerId)
                .ok_or(bad("a peer id is 64 hex digits (32 bytes)"))?;
            let name = words.next().map(str::to_owned);
            if words.next().is_some() {
                return Err(bad("after the id, at most one word (the peer's name)"));
            }
            if list.contains(&id) {
                return Err(bad("this peer id is listed on an earlier line"));
            }
            list.peers.push((id, name));
        }
        Ok(list)
    }

    /// Reads and parses the allowlist file at `path` ([`Allowlist::parse`]).
    pub fn load(path: impl AsRef<Path>) -> Result<Self, IdentityError> {
        let path = path.as_ref();
        Self::parse(&std::fs::read_to_string(path).map_err(|e| io(path, e))?)
    }

    /// True when `peer` is trusted.
    pub fn contains(&self, peer: &PeerId) -> bool {
        self.peers.iter().any(|(p, _)| p == peer)
    }

    /// The name the operator gave `peer`, if any.
    pub fn name(&self, peer: &PeerId) -> Option<&str> {
        self.peers
            .iter()
            .find(|(p, _)| p == peer)
            .and_then(|(_, n)| n.as_deref())
    }

    /// How many peers are trusted.
    pub fn len(&self) -> usize {
        self.peers.len()
    }

    /// True when no peer is trusted (every link is refused).
    pub fn is_empty(&self) -> bool {
        self.peers.is_empty()
    }
}

/// What a worker authenticates with: its own key and the peers it trusts
/// ([`TransferConfig::with_identity`](crate::transfer::TransferConfig::with_identity)).
#[derive(Debug)]
pub struct Identity {
    key: WorkerKey,
    trusted: Allowlist,
    /// Handshakes refused because the peer was not on `trusted`.
    refused: AtomicU64,
}

impl Identity {
    /// `key`, trusting the peers of `trusted`.
    pub fn new(key: WorkerKey, trusted: Allowlist) -> Self {
        Identity {
            key,
            trusted,
            refused: AtomicU64::new(0),
        }
    }
    /// How many handshakes this worker refused, at either end of a link,
    /// because the peer's id was not on its allowlist.
    pub fn refused_peers(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
    pub(crate) fn refused_one(&self) {
        self.refused.fetch_add(1, Ordering::Relaxed);
    }
    /// This worker's key.
    pub fn key(&self) -> &WorkerKey {
        &self.key
    }
    /// This worker's id.
    pub fn peer_id(&self) -> PeerId {
        self.key.peer_id()
    }
    /// The peers this worker trusts.
    pub fn trusted(&self) -> &Allowlist {
        &self.trusted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_round_trips_through_its_file_and_never_prints_its_secret() {
        let dir = std::env::temp_dir().join(format!("handoff-key-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("worker.key");
        let key = WorkerKey::generate().unwrap();
        key.save(&path).unwrap();
        let back = WorkerKey::load(&path).unwrap();
        assert_eq!(back.peer_id(), key.peer_id());
        assert_eq!(back.secret(), key.secret());
        let secret_hex: String = key.secret().iter().map(|b| format!("{b:02x}")).collect();
        assert!(!format!("{key:?}").contains(&secret_hex[..16]));
        assert!(format!("{key:?}").contains(&key.peer_id().to_string()));
        assert!(matches!(key.save(&path), Err(IdentityError::Exists { .. })));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o077, 0, "readable by its owner only");
        }
        std::fs::write(dir.join("bad.key"), "not a key\n").unwrap();
        assert!(matches!(
            WorkerKey::load(dir.join("bad.key")),
            Err(IdentityError::KeyFile { .. })
        ));
        assert!(matches!(
            WorkerKey::load(dir.join("missing.key")),
            Err(IdentityError::Io { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_peer_id_is_its_public_key_in_hex() {
        let key = WorkerKey::generate().unwrap();
        let id = key.peer_id();
        assert_eq!(id.to_string().len(), 64);
        assert_eq!(PeerId::from_hex(&id.to_string()), Ok(id));
        assert!(PeerId::from_hex("abc").is_err());
        assert_eq!(
            WorkerKey::from_secret(*key.secret()).unwrap().peer_id(),
            id,
            "the public half is derived from the secret"
        );
    }

    #[test]
    fn an_allowlist_reads_ids_names_and_comments_and_names_a_bad_line() {
        let (a, b) = (
            WorkerKey::generate().unwrap(),
            WorkerKey::generate().unwrap(),
        );
        let text = format!(
            "# the deployment's workers\n\n{} prefill-0\n  {}   # decode, unnamed\n",
            a.peer_id(),
            b.peer_id()
        );
        let list = Allowlist::parse(&text).unwrap();
        assert_eq!(list.len(), 2);
        assert!(list.contains(&a.peer_id()) && list.contains(&b.peer_id()));
        assert_eq!(list.name(&a.peer_id()), Some("prefill-0"));
        assert_eq!(list.name(&b.peer_id()), None);
        assert!(!list.contains(&WorkerKey::generate().unwrap().peer_id()));

        let short = format!("{}\n{}\n", a.peer_id(), &b.peer_id().to_string()[..60]);
        assert!(matches!(
            Allowlist::parse(&short),
            Err(IdentityError::AllowlistLine { line: 2, .. })
        ));
        let extra = format!("# x\n{} two words\n", a.peer_id());
        assert!(matches!(
            Allowlist::parse(&extra),
            Err(IdentityError::AllowlistLine { line: 2, .. })
        ));
        let twice = format!("{}\n{} again\n", a.peer_id(), a.peer_id());
        assert!(matches!(
            Allowlist::parse(&twice),
            Err(IdentityError::AllowlistLine { line: 2, .. })
        ));
        let not_hex = format!("{}\n", "zz".repeat(32));
        assert!(matches!(
            Allowlist::parse(&not_hex),
            Err(IdentityError::AllowlistLine { line: 1, .. })
        ));
    }
}
