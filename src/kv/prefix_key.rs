//! Keys of the prefix cache: a hash chain over full pages, salted per tenant.
//!
//! # Why a hash chain (vLLM's block hashes), not a radix tree (SGLang's)
//!
//! The unit of sharing here is a whole page: a cached page is immutable and
//! the last, partial page of every sequence is private. A chain of page keys
//! matches exactly that unit: key `i` is a keyed hash of key `i - 1` and the
//! token ids of page `i`, so it names the page *and every token before it*;
//! a lookup walks the prompt's keys and stops at the first miss, one O(1)
//! map probe per page. A radix tree's gain is matching at token granularity
//! inside a page, which this cache never shares. Keys also make isolation a
//! property of the key rather than of a traversal: every key is computed
//! under the tenant's salt, so two tenants' chains have no key in common
//! (up to a 2^-256 collision of BLAKE3) and no lookup, however written, can
//! reach another tenant's page. Eviction needs no tree surgery either: an
//! evicted page only makes the keys after it unreachable, and those are
//! released to the LRU deepest-first so they go before their ancestors.
//!
//! # Salts come from the server
//!
//! A tenant's salt is `BLAKE3-keyed(server secret, tenant id)`. Hosts name
//! the tenant ([`TenantId`]); they never supply a salt or a key, so a client
//! cannot pick one to probe another tenant's prompts (vLLM's client-supplied
//! `cache_salt`, CVE-2025-46570). The secret is drawn from the OS by default
//! ([`CacheSecret::random`]) and never printed.

use crate::ids::TenantId;
use crate::kv::KvError;
use crate::kv::page::PoolId;

/// The server secret every tenant salt is derived from. Never printed.
#[derive(Clone)]
pub struct CacheSecret([u8; 32]);

impl std::fmt::Debug for CacheSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CacheSecret(..)")
    }
}

impl CacheSecret {
    /// A secret the host keeps (for example, from its secret store).
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        CacheSecret(bytes)
    }

    /// A fresh secret from the operating system's random source. The cache
    /// lives in memory, so a secret per process is enough.
    pub fn random() -> Result<Self, KvError> {
        let mut b = [0u8; 32];
        getrandom::fill(&mut b).map_err(|e| KvError::NoEntropy {
            reason: e.to_string(),
        })?;
        Ok(CacheSecret(b))
    }

    /// The keys of `prompt`'s full pages for `tenant`, exactly as a
    /// [`PrefixCache`](crate::kv::PrefixCache) under this secret, for a model
    /// of fingerprint `model_fingerprint` and pages of `page_size` tokens,
    /// derives them, but without a pool: what a router that holds the
    /// deployment's secret indexes the workers' cached pages by. Each key is
    /// salted with the tenant's salt, so one tenant's keys never name another
    /// tenant's pages. Only [`PrefixKeys`] (from a cache) can lease pages.
    pub fn page_keys(
        &self,
        tenant: TenantId,
        model_fingerprint: u64,
        page_size: usize,
        prompt: &[u32],
    ) -> Vec<PageKey> {
        chain_keys(&self.salt(tenant), model_fingerprint, page_size, prompt)
    }

    /// The tenant's salt: a keyed hash of its id under this secret.
    pub(crate) fn salt(&self, tenant: TenantId) -> TenantSalt {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(b"handoff prefix-cache tenant salt v1");
        h.update(&tenant.0.to_le_bytes());
        TenantSalt(*h.finalize().as_bytes())
    }
}

/// One tenant's salt; only [`CacheSecret::salt`] makes one.
pub(crate) struct TenantSalt([u8; 32]);

/// The key of one full cached page: a hash of the tenant's salt, the model,
/// the page size and every token up to the end of this page.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PageKey([u8; 32]);

impl std::fmt::Debug for PageKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PageKey(")?;
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "..)")
    }
}

#[cfg(test)]
impl PageKey {
    /// A key for bookkeeping tests.
    pub(crate) fn test_key(b: u8) -> Self {
        PageKey([b; 32])
    }
}

/// The keys of a prompt's full pages for one tenant, in one pool. Only a
/// [`crate::kv::PrefixCache`] makes them (from a [`TenantId`] and the
/// prompt), so no caller can present a key it did not derive.
#[derive(Clone, Debug)]
pub struct PrefixKeys {
    pub(crate) pool: PoolId,
    pub(crate) tenant: TenantId,
    pub(crate) prompt_len: usize,
    /// One key per full page of the prompt.
    pub(crate) keys: Vec<PageKey>,
    pub(crate) page_size: usize,
}

impl PrefixKeys {
    /// Chains the keys of every full page of `prompt`.
    pub(crate) fn chain(
        pool: PoolId,
        salt: &TenantSalt,
        tenant: TenantId,
        model_fingerprint: u64,
        page_size: usize,
        prompt: &[u32],
    ) -> Self {
        PrefixKeys {
            pool,
            tenant,
            prompt_len: prompt.len(),
            keys: chain_keys(salt, model_fingerprint, page_size, prompt),
            page_size: page_size.max(1),
        }
    }

    /// The tenant these keys were derived for.
    pub fn tenant(&self) -> TenantId {
        self.tenant
    }
    /// Tokens in the prompt.
    pub fn prompt_len(&self) -> usize {
        self.prompt_len
    }
    /// Full pages of the prompt (what a finished prefill may publish).
    pub fn full_pages(&self) -> usize {
        self.keys.len()
    }
    /// Pages a lookup may reuse: full pages before the prompt's last token,
    /// which is always computed (its logits give the first output token).
    pub fn reusable_pages(&self) -> usize {
        self.prompt_len.saturating_sub(1) / self.page_size
    }
    /// The keys, one per full page.
    pub fn keys(&self) -> &[PageKey] {
        &self.keys
    }
}

/// The chain itself: key `i` hashes key `i - 1` and page `i`'s tokens under
/// the tenant's salt, from a root naming the model and the page size.
fn chain_keys(
    salt: &TenantSalt,
    model_fingerprint: u64,
    page_size: usize,
    prompt: &[u32],
) -> Vec<PageKey> {
    let mut root = blake3::Hasher::new_keyed(&salt.0);
    root.update(b"handoff prefix-cache chain v1");
    root.update(&model_fingerprint.to_le_bytes());
    root.update(&(page_size as u64).to_le_bytes());
    let mut prev = *root.finalize().as_bytes();
    // Each page's tokens go in as one slice: the same bytes, so the same
    // keys, as one update per token, without a call per token.
    let mut bytes = Vec::with_capacity(page_size.max(1) * 4);
    prompt
        .chunks_exact(page_size.max(1))
        .map(|page| {
            bytes.clear();
            bytes.extend(page.iter().flat_map(|t| t.to_le_bytes()));
            let mut h = blake3::Hasher::new_keyed(&salt.0);
            h.update(&prev);
            h.update(&bytes);
            prev = *h.finalize().as_bytes();
            PageKey(prev)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(secret: u8, tenant: u32, model: u64, prompt: &[u32]) -> PrefixKeys {
        let s = CacheSecret::from_bytes([secret; 32]);
        let pool = PoolId::fresh();
        PrefixKeys::chain(
            pool,
            &s.salt(TenantId(tenant)),
            TenantId(tenant),
            model,
            4,
            prompt,
        )
    }

    #[test]
    fn a_key_names_its_page_and_every_token_before_it() {
        let p: Vec<u32> = (0..12).collect();
        let a = keys(1, 1, 9, &p);
        assert_eq!(a.keys.len(), 3);
        let mut q = p.clone();
        q[1] = 99; // changes page 0, so every later key
        let b = keys(1, 1, 9, &q);
        assert!(a.keys.iter().zip(&b.keys).all(|(x, y)| x != y));
        let mut r = p.clone();
        r[9] = 99; // changes page 2 only
        let c = keys(1, 1, 9, &r);
        assert_eq!(a.keys[..2], c.keys[..2]);
        assert_ne!(a.keys[2], c.keys[2]);
    }

    #[test]
    fn tenant_secret_and_model_each_change_every_key() {
        let p: Vec<u32> = (0..8).collect();
        let base = keys(1, 1, 9, &p);
        for other in [keys(1, 2, 9, &p), keys(2, 1, 9, &p), keys(1, 1, 10, &p)] {
            assert!(base.keys.iter().all(|k| !other.keys.contains(k)));
        }
    }

    #[test]
    fn only_pages_before_the_last_token_are_reusable() {
        assert_eq!(keys(1, 1, 9, &[1; 8]).reusable_pages(), 1);
        assert_eq!(keys(1, 1, 9, &[1; 9]).reusable_pages(), 2);
        assert_eq!(keys(1, 1, 9, &[1; 3]).reusable_pages(), 0);
        assert_eq!(keys(1, 1, 9, &[1; 8]).full_pages(), 2);
    }

    #[test]
    fn page_keys_are_the_caches_keys_without_a_pool() {
        let p: Vec<u32> = (0..13).collect();
        let s = CacheSecret::from_bytes([1; 32]);
        assert_eq!(s.page_keys(TenantId(1), 9, 4, &p), keys(1, 1, 9, &p).keys);
        assert_ne!(s.page_keys(TenantId(2), 9, 4, &p), keys(1, 1, 9, &p).keys);
    }

    #[test]
    fn the_secret_is_never_printed() {
        let s = CacheSecret::from_bytes([0xab; 32]);
        assert_eq!(format!("{s:?}"), "CacheSecret(..)");
    }
}
