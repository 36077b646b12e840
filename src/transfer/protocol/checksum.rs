//! Per-destination-page checksums of transferred KV.
//!
//! A page's checksum is xxh3-64 over the little-endian concatenation of its
//! region hashes `[h(l0,K), h(l0,V), h(l1,K), h(l1,V), ...]`, where
//! `h(l,K)` is xxh3-64 of the K rows written to that page in layer `l`
//! (slots `0..t` of the page, raw storage-dtype bytes), likewise for V.
//! Two levels let the sender hash each region as it sends it, in any order,
//! and the receiver recompute the same value over the bytes that landed.
//!
//! xxh3-64 (seed 0, default secret) comes from `twox-hash`, which picks its
//! AVX2 or SSE2 code at run time: the crate needs no particular CPU, and
//! gets the wide loop where there is one (twice as fast as SSE2 on the
//! regions hashed here).

use std::hash::Hasher;

use twox_hash::XxHash3_64;

fn xxh3_64(bytes: &[u8]) -> u64 {
    XxHash3_64::oneshot(bytes)
}

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

    /// Region hashes already computed, as `[page][layer][K, V]`.
    pub(crate) fn from_hashes(n_layers: usize, hashes: Vec<u64>) -> Self {
        RegionHashes { n_layers, hashes }
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
            .map(page_checksum)
            .collect()
    }
}

/// A page's checksum from its region hashes `[l0 K, l0 V, l1 K, ...]`.
fn page_checksum(regions: &[u64]) -> u64 {
    let bytes: Vec<u8> = regions.iter().flat_map(|h| h.to_le_bytes()).collect();
    xxh3_64(&bytes)
}

/// Region hashes recomputed by the decode side over the bytes that landed
/// in the destination pages, each taken from the pages right after the
/// region's last row was written there (so from cache, not from memory).
///
/// Nothing can change a region after that: destination pages of a transfer
/// in flight are written only through its landing-zone entry, in order and
/// append-only (a row is never written twice), and verification fences the
/// entry before it compares. With the audit trail on, the verifier
/// recomputes every region over the pages once more and requires the same
/// hashes (see `decode::verify`).
#[derive(Debug)]
pub(crate) struct LandedHashes {
    n_layers: usize,
    page_size: usize,
    tokens: usize,
    row_bytes: usize,
    /// `[page][layer][K, V]`; `None` until the region is complete.
    hashes: Vec<Option<u64>>,
}

impl LandedHashes {
    /// For a transfer of `tokens` tokens into pages of `page_size` slots,
    /// `row_bytes` bytes per token row of K (or V) of one layer.
    pub(crate) fn new(tokens: usize, page_size: usize, n_layers: usize, row_bytes: usize) -> Self {
        let n_pages = crate::kv::pages_for(tokens, page_size.max(1));
        LandedHashes {
            n_layers,
            page_size,
            tokens,
            row_bytes,
            hashes: vec![None; n_pages * n_layers * 2],
        }
    }

    /// Rows `[0, end)` of page `page`, `layer`, K (`kv == 0`) or V, as they
    /// are in the destination right after a write ended at `end`: hashed
    /// once the region holds every row the plan puts in it.
    pub(crate) fn landed(&mut self, page: usize, layer: usize, kv: usize, rows: &[u8]) {
        let planned = self
            .tokens
            .saturating_sub(page * self.page_size)
            .min(self.page_size);
        if planned == 0 || rows.len() != planned * self.row_bytes {
            return;
        }
        if let Some(h) = self.hashes.get_mut((page * self.n_layers + layer) * 2 + kv) {
            *h = Some(region_hash(rows));
        }
    }

    /// The per-page checksums; `None` for a page with a region that never
    /// completed (such a transfer fails verification).
    pub(crate) fn finish(&self) -> Vec<Option<u64>> {
        self.hashes
            .chunks(self.n_layers * 2)
            .map(|regions| {
                let regions: Option<Vec<u64>> = regions.iter().copied().collect();
                regions.map(|r| page_checksum(&r))
            })
            .collect()
    }
}

/// Hashes a region given as pieces, as one byte stream.
pub(crate) struct RegionHasher(XxHash3_64);

impl RegionHasher {
    pub(crate) fn new() -> Self {
        RegionHasher(XxHash3_64::new())
    }
    pub(crate) fn update(&mut self, bytes: &[u8]) {
        self.0.write(bytes);
    }
    pub(crate) fn digest(&self) -> u64 {
        self.0.finish()
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
    fn region_hash_is_the_same_xxh3_64_as_before_the_switch_of_crate() {
        // Checksums travel in receipts: a peer built with the previous hash
        // crate (xxhash-rust) must compute the same values, whatever code
        // path the length or the CPU selects.
        let buf: Vec<u8> = (0..70_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        assert_eq!(region_hash(&[]), 0x2D06_8005_38D3_94C2);
        for len in [
            1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1024, 32_768, 65_537,
        ] {
            let want = xxhash_rust::xxh3::xxh3_64(&buf[..len]);
            assert_eq!(region_hash(&buf[..len]), want, "len {len}");
            let mut h = RegionHasher::new();
            for piece in buf[..len].chunks(1000) {
                h.update(piece);
            }
            assert_eq!(h.digest(), want, "streamed, len {len}");
        }
    }

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
    fn landed_hashes_equal_the_senders_whatever_the_write_split() {
        // 2 layers, pages of 4 rows of 3 bytes, 10 tokens: the last page
        // holds 2 rows. The sender hashes each region in one piece.
        let (ps, row, tokens, n_layers) = (4, 3, 10, 2);
        let data: Vec<u8> = (0..(n_layers * 2 * tokens * row) as u32)
            .map(|i| (i * 7 % 253) as u8)
            .collect();
        let rows_of = |layer: usize, kv: usize| {
            let at = (layer * 2 + kv) * tokens * row;
            &data[at..at + tokens * row]
        };
        let mut sent = RegionHashes::new(3, n_layers);
        for layer in 0..n_layers {
            for kv in 0..2 {
                for (page, region) in rows_of(layer, kv).chunks(ps * row).enumerate() {
                    sent.set(page, layer, kv, region_hash(region));
                }
            }
        }
        let sent = sent.finish();
        for split in [1, 3, 4, 10] {
            let mut landed = LandedHashes::new(tokens, ps, n_layers, row);
            for layer in 0..n_layers {
                let mut pos = 0;
                while pos < tokens {
                    let n = split.min(tokens - pos);
                    // The write ends at `end` in each page it touches.
                    let mut p = pos;
                    while p < pos + n {
                        let page = p / ps;
                        let end = (pos + n).min((page + 1) * ps);
                        for kv in 0..2 {
                            let region = &rows_of(layer, kv)[page * ps * row..end * row];
                            landed.landed(page, layer, kv, region);
                        }
                        p = end;
                    }
                    pos += n;
                }
            }
            let got: Vec<u64> = landed.finish().into_iter().flatten().collect();
            assert_eq!(got, sent, "split {split}");
        }
    }

    #[test]
    fn a_region_that_never_completed_leaves_its_page_without_checksum() {
        let mut landed = LandedHashes::new(6, 4, 1, 2);
        landed.landed(0, 0, 0, &[1; 8]);
        landed.landed(0, 0, 1, &[2; 8]);
        landed.landed(1, 0, 0, &[3; 4]);
        landed.landed(1, 0, 1, &[4; 2]); // one row of two
        let pages = landed.finish();
        assert!(pages[0].is_some());
        assert_eq!(pages[1], None);
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
