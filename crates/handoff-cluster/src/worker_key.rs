//! A worker's long-term public key as registered, and the operator's
//! allowlist of them.
//!
//! The transfer layer authenticates links with each worker's Noise static
//! key; the registry only carries the public half so that peers and routers
//! know whom to expect at an address. A registration whose key is not on the
//! operator's list is refused, whatever else it says.

use std::collections::HashSet;
use std::fmt;

use crate::ClusterError;

/// A worker's X25519 static public key: 32 bytes, written as 64 hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct WorkerKey([u8; 32]);

impl WorkerKey {
    /// A key from its bytes.
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        WorkerKey(bytes)
    }

    /// The key's bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Parses exactly 64 hex digits (either case).
    pub fn parse_hex(s: &str) -> Result<Self, ClusterError> {
        let bad = || ClusterError::BadPublicKey {
            given: s.chars().take(80).collect(),
        };
        let b = s.as_bytes();
        if b.len() != 64 {
            return Err(bad());
        }
        let mut out = [0u8; 32];
        for (o, pair) in out.iter_mut().zip(b.chunks_exact(2)) {
            let hi = hex_digit(pair[0]).ok_or_else(bad)?;
            let lo = hex_digit(pair[1]).ok_or_else(bad)?;
            *o = hi << 4 | lo;
        }
        Ok(WorkerKey(out))
    }
}

fn hex_digit(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

impl fmt::Display for WorkerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for WorkerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "WorkerKey({self})")
    }
}

/// The public keys the operator trusts (pinned from a file or a secret
/// store): a registration under any other key is refused.
#[derive(Clone, Debug, Default)]
pub struct TrustedKeys(HashSet<WorkerKey>);

impl TrustedKeys {
    /// The allowlist of `keys`.
    pub fn new(keys: impl IntoIterator<Item = WorkerKey>) -> Self {
        TrustedKeys(keys.into_iter().collect())
    }

    /// Whether `key` is on the list.
    pub fn contains(&self, key: &WorkerKey) -> bool {
        self.0.contains(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_and_rejects_everything_else() {
        let k = WorkerKey::from_bytes(core::array::from_fn(|i| i as u8 * 7));
        let s = k.to_string();
        assert_eq!(s.len(), 64);
        assert_eq!(WorkerKey::parse_hex(&s).ok(), Some(k));
        assert_eq!(WorkerKey::parse_hex(&s.to_uppercase()).ok(), Some(k));
        for bad in [&s[..62], &format!("{s}00"), &s.replacen('0', "g", 1), ""] {
            assert!(matches!(
                WorkerKey::parse_hex(bad),
                Err(ClusterError::BadPublicKey { .. })
            ));
        }
    }

    #[test]
    fn the_allowlist_holds_only_what_it_was_given() {
        let a = WorkerKey::from_bytes([1; 32]);
        let b = WorkerKey::from_bytes([2; 32]);
        let list = TrustedKeys::new([a]);
        assert!(list.contains(&a));
        assert!(!list.contains(&b));
    }
}
