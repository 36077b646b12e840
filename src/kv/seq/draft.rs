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
