//! Rolling back the KV of rejected drafts: the rows a verify pass wrote for
//! drafted tokens the target did not keep stop counting as written (so no
//! view reads them and the next write lands on them), their audit records
//! are cleared (so a read that got past the count would fail its audit),
//! and the pages the draft grew into and no longer needs go back to the
//! pool, scrubbed.
//!
//! Only the verifier moves a sequence's count back: the operations are the
//! crate's, and [`DraftMark`] is made only by [`KvSeq::begin_draft`] and
//! spent by [`KvSeq::settle_draft`].

use crate::ids::RequestId;
use crate::kv::page::PageState;
use crate::kv::{KvError, KvSeq, Ready, pages_for};

/// Where a sequence stood before a verify pass appended drafted rows.
/// Spent by [`KvSeq::settle_draft`]; not `Clone`, so one mark settles once.
#[derive(Debug)]
#[must_use = "settle the draft, or its rows stay written"]
pub(crate) struct DraftMark {
    owner: RequestId,
    len: usize,
    pages: usize,
}

/// What settling a draft did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settled {
    /// Rows kept past the mark (the last accepted token and the accepted
    /// drafts).
    pub kept: usize,
    /// Rows rolled back (written, now unreadable).
    pub rolled_back: usize,
    /// Pages returned to the pool.
    pub pages_returned: usize,
}

impl KvSeq<Ready> {
    /// Marks the sequence before a verify pass appends the last accepted
    /// token and the drafts after it. Refused when the layers disagree
    /// (the KV is incomplete).
    pub(crate) fn begin_draft(&self) -> Result<DraftMark, KvError> {
        let len = self.complete_len().ok_or_else(|| self.incomplete(0))?;
        Ok(DraftMark {
            owner: self.owner,
            len,
            pages: self.pages.len(),
        })
    }

    /// Keeps `keep` rows written after `mark` in every layer and rolls back
    /// the rest (a failed pass, which may have written some layers only,
    /// settles with `keep == 0`); returns the pages the draft grew into
    /// that hold nothing now. Refused (nothing changed) for another
    /// sequence's mark or when a layer holds fewer than `keep` rows past it.
    pub(crate) fn settle_draft(
        &mut self,
        mark: DraftMark,
        keep: usize,
    ) -> Result<Settled, KvError> {
        let len = mark.len.saturating_add(keep);
        if mark.owner != self.owner || mark.pages > self.pages.len() {
            return Err(KvError::Shape {
                what: "draft mark (of this sequence)",
                expected: self.pages.len(),
                got: mark.pages,
            });
        }
        if let Some(layer) = self.written.iter().position(|&w| w < len) {
            return Err(self.incomplete_at(layer, len));
        }
        let ps = self.pool.page_size();
        let high = self.written.iter().copied().max().unwrap_or(len);
        // Audit records of the rolled-back slots, cleared layer by layer.
        {
            let written_now = self.written.clone();
            let w = self.pages_write();
            for (layer, &written) in written_now.iter().enumerate() {
                let mut pos = len;
                while pos < written {
                    let run = (ps - pos % ps).min(written - pos);
                    w.clear_writers_rows(pos / ps, layer, pos % ps, run);
                    pos += run;
                }
            }
        }
        for w in &mut self.written {
            *w = len;
        }
        // Pages the draft grew into past the kept rows: scrubbed, freed.
        let keep_pages = pages_for(len, ps).max(mark.pages).max(self.prefix.len());
        let freed = self.pages.len().saturating_sub(keep_pages);
        if freed > 0 {
            let fill = self.pool.scrub_fill();
            self.pages_write_from(keep_pages).scrub(fill);
            let tail = self.pages.split_off(keep_pages);
            self.pool.free_pages(&tail, PageState::InUse);
        }
        Ok(Settled {
            kept: keep,
            rolled_back: high - len,
            pages_returned: freed,
        })
    }

    fn incomplete(&self, layer: usize) -> KvError {
        KvError::Incomplete {
            layer,
            written: self.written(layer),
            expected: self.written.iter().copied().max().unwrap_or(0),
        }
    }

    fn incomplete_at(&self, layer: usize, expected: usize) -> KvError {
        KvError::Incomplete {
            layer,
            written: self.written(layer),
            expected,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{KvGeometry, KvPool, PoolConfig};

    fn pool() -> KvPool {
        let g = KvGeometry::tiny(2, 2);
        KvPool::new(PoolConfig::new(g, 2, 16).audit(true)).unwrap()
    }

    /// A sealed sequence of `len` tokens owned by `id`.
    fn ready(pool: &KvPool, id: u64, len: usize) -> KvSeq<Ready> {
        let mut s = pool.reserve(RequestId(id), len).unwrap();
        let rows = vec![1.0; len * 2];
        for layer in 0..2 {
            s.append(layer, &rows, &rows).unwrap();
        }
        s.seal(len).unwrap()
    }

    fn write(seq: &mut KvSeq<Ready>, n: usize) {
        let len = seq.complete_len().unwrap();
        seq.ensure_capacity(len + n).unwrap();
        let rows = vec![2.0; n * 2];
        for layer in 0..2 {
            seq.append(layer, &rows, &rows).unwrap();
        }
    }

    #[test]
    fn a_draft_settles_to_its_kept_rows_and_frees_the_pages_it_grew_into() {
        let pool = pool();
        let mut seq = ready(&pool, 1, 3);
        let mark = seq.begin_draft().unwrap();
        write(&mut seq, 5); // positions 3..8: pages 2 to 3 are new
        assert_eq!(seq.pages().len(), 4);
        let s = seq.settle_draft(mark, 2).unwrap();
        assert_eq!((s.kept, s.rolled_back, s.pages_returned), (2, 3, 1));
        assert_eq!(seq.complete_len(), Some(5));
        assert_eq!(seq.pages().len(), 3);
        assert_eq!(pool.stats().in_use, 3);
        // A later write lands where the rolled-back rows were, and reads
        // pass their audit.
        write(&mut seq, 1);
        let reader = pool.reader();
        let view = reader.seq(&seq).unwrap();
        assert_eq!(view.layer(1).unwrap().len(), 6);
        assert_eq!(pool.stats().isolation_violations, 0);
    }

    #[test]
    fn another_sequences_mark_or_rows_never_written_are_refused_and_change_nothing() {
        let pool = pool();
        let mut a = ready(&pool, 1, 2);
        let b = ready(&pool, 2, 2);
        let foreign = b.begin_draft().unwrap();
        write(&mut a, 2);
        assert!(a.settle_draft(foreign, 0).is_err());
        assert_eq!(a.complete_len(), Some(4));
        let mark = DraftMark {
            owner: a.owner(),
            len: 2,
            pages: 1,
        };
        assert!(matches!(
            a.settle_draft(mark, 3),
            Err(KvError::Incomplete { .. })
        ));
        assert_eq!(a.complete_len(), Some(4));
        assert_eq!(a.pages().len(), 2);
    }
}
