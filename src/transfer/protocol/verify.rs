//! The verifier: a receipt against its plan and the bytes that landed.
//!
//! Every field of a receipt is the peer's claim. [`verify`] checks them, in
//! order, against what the plan asked for and what actually landed in the
//! fenced destination pages (their checksums recomputed here, not taken
//! from the peer), and returns either the destination as a readable
//! `KvSeq<Ready>` or a typed [`IntegrityError`] with the destination to
//! release. It does no I/O and keeps no state: the decode side calls it
//! once per receipt, and its rules are tested here one by one.

use crate::ids::RequestId;
use crate::kv::{KvPool, KvSeq, Ready};
use crate::transfer::error::IntegrityError;
use crate::transfer::link::identity::PeerId;
use crate::transfer::link::landing::Destination;
use crate::transfer::protocol::checksum::{RegionHashes, region_hash};
use crate::transfer::protocol::{Nonce, PlannedPage, Receipt};

/// A refusal: why, and the destination (fenced, if there was one) for the
/// caller to scrub and release.
pub(crate) type Refused = Box<(IntegrityError, Option<Destination>)>;

/// What a plan expects of its receipt.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Expected<'a> {
    pub(crate) request: RequestId,
    pub(crate) nonce: Nonce,
    /// The peer the plan was addressed to (its link's authenticated peer).
    pub(crate) peer: Option<PeerId>,
    /// Tokens every layer must have received.
    pub(crate) tokens: u32,
    /// The destination pages, in position order, at their generations.
    pub(crate) pages: &'a [PlannedPage],
}

/// Checks a receipt that arrived from the peer `from` (its link's
/// authenticated peer) against the plan (`live`) and the bytes that landed
/// in its destination (`dest`, taken out of the landing zone: fenced), in
/// order; the first broken rule fails the transfer. The first rule: the
/// receipt comes from the peer the plan was addressed to. The only code that
/// turns received KV into KV decode reads. Pure: it changes nothing but the
/// destination it consumes.
pub(crate) fn verify(
    pool: &KvPool,
    live: Expected<'_>,
    from: Option<PeerId>,
    r: &Receipt,
    dest: Option<Destination>,
) -> Result<KvSeq<Ready>, Refused> {
    let request = live.request;
    let fail = |e: IntegrityError, dest: Option<Destination>| Err(Box::new((e, dest)));
    if from != live.peer {
        return fail(
            IntegrityError::WrongPeer {
                request,
                nonce: live.nonce,
                planned: live.peer,
                got: from,
            },
            dest,
        );
    }
    if r.nonce != live.nonce {
        return fail(
            IntegrityError::NonceMismatch {
                request,
                planned: live.nonce,
                got: r.nonce,
            },
            dest,
        );
    }
    if r.request != request {
        return fail(
            IntegrityError::RequestMismatch {
                planned: request,
                got: r.request,
                nonce: live.nonce,
            },
            dest,
        );
    }
    let n_layers = pool.config().geometry().n_layers;
    if r.layer_tokens.len() != n_layers {
        return fail(
            IntegrityError::LayerCountLen {
                request,
                planned: n_layers,
                got: r.layer_tokens.len(),
            },
            dest,
        );
    }
    if let Some((layer, &claimed)) = r
        .layer_tokens
        .iter()
        .enumerate()
        .find(|&(_, &t)| t != live.tokens)
    {
        return fail(
            IntegrityError::LayerTokens {
                request,
                layer,
                claimed,
                planned: live.tokens,
            },
            dest,
        );
    }
    let n = live.pages.len().max(r.pages.len());
    if let Some(position) = (0..n).find(|&i| live.pages.get(i) != r.pages.get(i)) {
        return fail(
            IntegrityError::PageMismatch {
                request,
                position,
                planned: live.pages.get(position).copied(),
                got: r.pages.get(position).copied(),
            },
            dest,
        );
    }
    let Some(dest) = dest else {
        return fail(
            IntegrityError::Destination {
                request,
                error: crate::kv::KvError::Shape {
                    what: "registered destination (missing)",
                    expected: 1,
                    got: 0,
                },
            },
            None,
        );
    };
    if let Some(reason) = dest.refused.clone() {
        return fail(IntegrityError::WriteRefused { request, reason }, Some(dest));
    }
    let planned = live.tokens as usize;
    if let Some((layer, &landed)) = dest
        .seq
        .written_per_layer()
        .iter()
        .enumerate()
        .find(|&(_, &w)| w != planned)
    {
        return fail(
            IntegrityError::Incomplete {
                request,
                layer,
                landed,
                planned,
            },
            Some(dest),
        );
    }
    if r.page_checksums.len() != live.pages.len() {
        return fail(
            IntegrityError::ChecksumCount {
                request,
                planned: live.pages.len(),
                got: r.page_checksums.len(),
            },
            Some(dest),
        );
    }
    // The checksums recomputed over the bytes that landed: on the device in
    // one pass where the pool's device hashes in place, otherwise region by
    // region as each was completed in the destination pages (LandedHashes).
    let n_pages = live.pages.len();
    let actual = match dest.seq.device_region_xxh3(n_pages) {
        Ok(Some(regions)) => RegionHashes::from_hashes(n_layers, regions)
            .finish()
            .into_iter()
            .map(Some)
            .collect(),
        Ok(None) => dest.landed.finish(),
        Err(error) => return fail(IntegrityError::Destination { request, error }, Some(dest)),
    };
    if let Some(position) =
        (0..n_pages).find(|&i| actual.get(i).copied().flatten() != r.page_checksums.get(i).copied())
    {
        return fail(
            IntegrityError::ChecksumMismatch {
                request,
                position,
                claimed: r.page_checksums.get(position).copied().unwrap_or_default(),
                actual: actual.get(position).copied().flatten().unwrap_or_default(),
            },
            Some(dest),
        );
    }
    // With the audit trail on (debug builds, tests, audited pools), read
    // every landed byte back once more: the pages must still hold what was
    // hashed as it landed.
    if pool.config().audit_enabled() {
        let again = RegionHashes::from_hashes(
            n_layers,
            dest.seq.received_region_hashes(n_pages, region_hash),
        )
        .finish();
        if let Some(position) =
            (0..n_pages).find(|&i| actual.get(i).copied().flatten() != again.get(i).copied())
        {
            return fail(
                IntegrityError::ChecksumMismatch {
                    request,
                    position,
                    claimed: r.page_checksums.get(position).copied().unwrap_or_default(),
                    actual: again.get(position).copied().unwrap_or_default(),
                },
                Some(dest),
            );
        }
    }
    if !writers_cover(r, request, n_layers, live.tokens) {
        return fail(IntegrityError::WriterMismatch { request }, Some(dest));
    }
    for &p in dest.seq.pages() {
        if let Err(error) = pool.check_page(p, false) {
            return fail(IntegrityError::Destination { request, error }, Some(dest));
        }
    }
    Ok(dest.seq.into_verified())
}

/// True when the receipt's writer runs say that `request`, and nobody else,
/// wrote positions `0..tokens` of every layer.
fn writers_cover(r: &Receipt, request: RequestId, n_layers: usize, tokens: u32) -> bool {
    let mut next = vec![0u32; n_layers];
    for w in &r.writers {
        let Some(n) = next.get_mut(w.layer as usize) else {
            return false;
        };
        if w.writer != request || w.start != *n {
            return false;
        }
        let Some(end) = n.checked_add(w.len) else {
            return false;
        };
        *n = end;
    }
    next.iter().all(|&n| n == tokens)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PoolConfig;
    use crate::kv::{KvDtype, KvGeometry};
    use crate::transfer::link::landing::LandingZone;
    use crate::transfer::protocol::{WriteBatch, WriterRun};

    const TOKENS: u32 = 10;
    const LAYERS: u32 = 2;
    const ID: RequestId = RequestId(7);
    const NONCE: Nonce = Nonce(42);
    /// The prefill worker the plan was addressed to.
    const PEER_A: PeerId = PeerId::from_bytes([0xa; 32]);
    /// Another authenticated prefill worker of the same decode worker.
    const PEER_B: PeerId = PeerId::from_bytes([0xb; 32]);

    /// A plan for `TOKENS` tokens of `ID`, and its destination with
    /// `landed` tokens of every layer written (each row a function of its
    /// layer and position), fenced: taken out of its landing zone.
    struct Case {
        pool: KvPool,
        pages: Vec<PlannedPage>,
        dest: Option<Destination>,
    }

    fn case(landed: u32) -> Case {
        let g = KvGeometry {
            n_layers: LAYERS as usize,
            n_kv_heads: 2,
            head_dim: 2,
            dtype: KvDtype::F16,
        };
        let pool = KvPool::new(PoolConfig::new(g, 4, 8)).unwrap();
        let seq = pool.reserve_for_receive(ID, TOKENS as usize).unwrap();
        let n_pages = pool.pages_for(TOKENS as usize);
        let pages = seq.pages()[..n_pages].iter().map(|&p| p.into()).collect();
        let zone = LandingZone::new();
        zone.register(NONCE, Destination::new(ID, TOKENS as usize, seq));
        let row = g.kv_dim() * g.dtype.size_bytes();
        for layer in 0..LAYERS {
            let b = WriteBatch {
                request: ID,
                nonce: NONCE,
                layer,
                start: 0,
                tokens: landed,
            };
            zone.apply(&b, landed as usize * row, None, |kv, done, dst| {
                for (i, x) in dst.iter_mut().enumerate() {
                    *x = (layer as usize * 31 + kv * 17 + done * row + i) as u8;
                }
            });
        }
        Case {
            pool,
            pages,
            dest: zone.take(NONCE),
        }
    }

    /// The receipt an honest prefill sends for `c`: its checksums are read
    /// back from the landed bytes.
    fn honest(c: &Case) -> Receipt {
        let n_pages = c.pages.len();
        let dest = c.dest.as_ref().unwrap();
        let hashes = dest.seq.received_region_hashes(n_pages, region_hash);
        Receipt {
            request: ID,
            nonce: NONCE,
            layer_tokens: vec![TOKENS; LAYERS as usize],
            pages: c.pages.clone(),
            page_checksums: RegionHashes::from_hashes(LAYERS as usize, hashes).finish(),
            writers: (0..LAYERS)
                .map(|layer| WriterRun {
                    layer,
                    start: 0,
                    len: TOKENS,
                    writer: ID,
                })
                .collect(),
            first_token: None,
            first_logprobs: None,
        }
    }

    fn run(c: Case, r: &Receipt) -> Result<KvSeq<Ready>, IntegrityError> {
        run_from(c, Some(PEER_A), r)
    }

    /// Verifies `r` as a receipt that arrived from `from`, for a plan
    /// addressed to `PEER_A`.
    fn run_from(
        c: Case,
        from: Option<PeerId>,
        r: &Receipt,
    ) -> Result<KvSeq<Ready>, IntegrityError> {
        let expected = Expected {
            request: ID,
            nonce: NONCE,
            peer: Some(PEER_A),
            tokens: TOKENS,
            pages: &c.pages,
        };
        verify(&c.pool, expected, from, r, c.dest).map_err(|b| {
            let (e, dest) = *b;
            drop(dest);
            e
        })
    }

    #[test]
    fn a_receipt_that_matches_its_plan_and_the_landed_bytes_verifies() {
        let c = case(TOKENS);
        let r = honest(&c);
        let pool = c.pool.clone();
        let seq = run(c, &r).expect("verifies");
        assert_eq!(seq.complete_len(), Some(TOKENS as usize));
        drop(seq);
        assert!(pool.stats().is_full());
    }

    #[test]
    fn each_broken_rule_is_its_typed_error_and_the_destination_comes_back() {
        type Edit = fn(&mut Receipt);
        type Expect = fn(&IntegrityError) -> bool;
        let cases: [(Edit, Expect); 9] = [
            (
                |r| r.nonce = Nonce(43),
                |e| matches!(e, IntegrityError::NonceMismatch { got: Nonce(43), .. }),
            ),
            (
                |r| r.request = RequestId(8),
                |e| {
                    matches!(
                        e,
                        IntegrityError::RequestMismatch {
                            got: RequestId(8),
                            ..
                        }
                    )
                },
            ),
            (
                |r| r.layer_tokens.push(TOKENS),
                |e| {
                    matches!(
                        e,
                        IntegrityError::LayerCountLen {
                            planned: 2,
                            got: 3,
                            ..
                        }
                    )
                },
            ),
            (
                |r| r.layer_tokens[1] = TOKENS - 1,
                |e| matches!(e, IntegrityError::LayerTokens { layer: 1, .. }),
            ),
            (
                |r| r.pages[0].generation += 1,
                |e| matches!(e, IntegrityError::PageMismatch { position: 0, .. }),
            ),
            (
                |r| {
                    r.pages.pop();
                },
                |e| matches!(e, IntegrityError::PageMismatch { got: None, .. }),
            ),
            (
                |r| {
                    r.page_checksums.pop();
                },
                |e| matches!(e, IntegrityError::ChecksumCount { .. }),
            ),
            (
                |r| r.page_checksums[1] ^= 1,
                |e| matches!(e, IntegrityError::ChecksumMismatch { position: 1, .. }),
            ),
            (
                |r| r.writers[0].writer = RequestId(8),
                |e| matches!(e, IntegrityError::WriterMismatch { .. }),
            ),
        ];
        for (i, (edit, expect)) in cases.into_iter().enumerate() {
            let c = case(TOKENS);
            let pool = c.pool.clone();
            let mut r = honest(&c);
            edit(&mut r);
            let e = run(c, &r).err();
            assert!(e.as_ref().is_some_and(expect), "case {i}: {e:?}");
            assert!(
                pool.stats().is_full(),
                "case {i}: the destination is released"
            );
        }
    }

    #[test]
    fn a_perfect_receipt_from_a_peer_the_plan_was_not_addressed_to_is_refused() {
        // Every byte landed and the receipt is exactly what an honest
        // prefill worker sends: only its sender is wrong.
        for from in [Some(PEER_B), None] {
            let c = case(TOKENS);
            let pool = c.pool.clone();
            let r = honest(&c);
            let e = run_from(c, from, &r).err();
            assert_eq!(
                e,
                Some(IntegrityError::WrongPeer {
                    request: ID,
                    nonce: NONCE,
                    planned: Some(PEER_A),
                    got: from,
                })
            );
            assert!(pool.stats().is_full(), "the destination is released");
        }
        // The same receipt from the addressed peer verifies.
        let c = case(TOKENS);
        let r = honest(&c);
        assert!(run_from(c, Some(PEER_A), &r).is_ok());
    }

    #[test]
    fn a_receipt_for_bytes_that_never_all_landed_is_refused() {
        let c = case(TOKENS - 3);
        let pool = c.pool.clone();
        let r = honest(&c);
        assert!(matches!(
            run(c, &r),
            Err(IntegrityError::Incomplete {
                layer: 0,
                landed: 7,
                planned: 10,
                ..
            })
        ));
        assert!(pool.stats().is_full());
    }

    #[test]
    fn a_receipt_without_a_registered_destination_is_refused() {
        let mut c = case(TOKENS);
        let r = honest(&c);
        drop(c.dest.take());
        assert!(matches!(
            run(c, &r),
            Err(IntegrityError::Destination { request: ID, .. })
        ));
    }
}
