//! Per-destination-page checksums of transferred KV.
//!
//! A page's checksum is xxh3-64 over the little-endian concatenation of its
//! region hashes `[h(l0,K), h(l0,V), h(l1,K), h(l1,V), ...]`, where
//! `h(l,K)` is xxh3-64 of the K rows written to that page in layer `l`
//! (slots `0..t` of the page, raw storage-dtype bytes), likewise for V.
//! Two levels let the sender hash each region as it sends it, in any order,
//! and the receiver recompute the same value over the bytes that landed.

use xxhash_rust::xxh3::{Xxh3Default, xxh3_64};

/// Region hashes of a transfer, filled as regions are sent or read.
#[derive(Debug)]
pub(crate) struct RegionHashes {
    n_layers: usize,
    hashes: Vec<u64>,
}

impl RegionHashes {
    /// `n_pages` destination pages of `n_layers` layers; every region starts
    /// as the hash of no bytes.
    pub(crate) fn new(n_pages: usize, n_layers: usize) -> Self {
        RegionHashes {
            n_layers,
            hashes: vec![xxh3_64(&[]); n_pages * n_layers * 2],
        }
    }

    /// Sets the hash of page `page`, layer `layer`, K (`kv == 0`) or V.
    pub(crate) fn set(&mut self, page: usize, layer: usize, kv: usize, hash: u64) {
        if let Some(h) = self.hashes.get_mut((page * self.n_layers + layer) * 2 + kv) {
            *h = hash;
        }
    }

    /// The per-page checksums.
    pub(crate) fn finish(&self) -> Vec<u64> {
        self.hashes
            .chunks(self.n_layers * 2)
            .map(|regions| {
                let bytes: Vec<u8> = regions.iter().flat_map(|h| h.to_le_bytes()).collect();
                xxh3_64(&bytes)
            })
            .collect()
    }
}

/// Hashes a region given as pieces, as one byte stream.
pub(crate) struct RegionHasher(Xxh3Default);

impl RegionHasher {
    pub(crate) fn new() -> Self {
        RegionHasher(Xxh3Default::new())
    }
    pub(crate) fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }
    pub(crate) fn digest(&self) -> u64 {
        self.0.digest()
    }
}

/// xxh3-64 of one contiguous region.
pub(crate) fn region_hash(bytes: &[u8]) -> u64 {
    xxh3_64(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streaming_equals_one_shot_whatever_the_split() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 31 % 251) as u8).collect();
        for split in [1, 7, 64, 4096, 9_999] {
            let mut h = RegionHasher::new();
            for piece in data.chunks(split) {
                h.update(piece);
            }
            assert_eq!(h.digest(), region_hash(&data));
        }
    }

    #[test]
    fn page_checksum_depends_on_every_region_and_its_place() {
        let mut a = RegionHashes::new(2, 2);
        a.set(1, 1, 1, 42);
        let base = a.finish();
        assert_eq!(base.len(), 2);
        let mut b = RegionHashes::new(2, 2);
        b.set(1, 1, 0, 42);
        let swapped = b.finish();
        assert_eq!(base[0], swapped[0]);
        assert_ne!(base[1], swapped[1]);
    }
}
