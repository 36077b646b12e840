//! The router's choice, pure: which prefill and which decode worker take a
//! request, given the live set and the prefix index.
//!
//! Prefill goes to the worker holding the longest run of the request's
//! cached pages (the tenant's own keys: see [`PrefixIndex`]), then the
//! shortest queue, then the most free pages; a worker is a candidate only if
//! it has room for the pages it would compute. Decode goes by load alone
//! (its KV arrives from prefill): shortest queue, then most free pages, among
//! workers with room for the whole sequence. Ties fall to the smaller id, so
//! the choice is a function of its inputs.
//!
//! A worker that left the live set is not in `live`, so the first watch
//! event that removes it also removes it from every later choice.

mod prefix_index;

use std::cmp::Reverse;

use handoff::kv::PageKey;

pub use prefix_index::{MAX_WORKERS, PrefixIndex};

use crate::{ClusterError, Member, Role, WorkerId};

/// The workers a request goes to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    pub prefill: WorkerId,
    pub decode: WorkerId,
    /// Pages of the request the chosen prefill worker already holds.
    pub cached_pages: usize,
}

/// Chooses a prefill and a decode worker for a request whose reusable pages
/// have the tenant-salted `keys` (`CacheSecret::page_keys`, as the workers'
/// caches derive them) and whose sequence needs `pages_needed` pages.
pub fn choose<'a>(
    live: impl IntoIterator<Item = &'a Member>,
    index: &PrefixIndex,
    keys: &[PageKey],
    pages_needed: u64,
) -> Result<Route, ClusterError> {
    let runs = index.runs(keys);
    let mut prefill: Option<(&Member, u64)> = None;
    let mut decode: Option<&Member> = None;
    for m in live {
        let r = &m.record;
        match r.role {
            Role::Prefill => {
                let run = index.slot_of(&m.id).map_or(0, |s| u64::from(runs[s]));
                if r.pages_free < pages_needed.saturating_sub(run) {
                    continue;
                }
                if prefill.is_none_or(|(best, best_run)| {
                    prefill_rank(m, run) > prefill_rank(best, best_run)
                }) {
                    prefill = Some((m, run));
                }
            }
            Role::Decode => {
                if r.pages_free < pages_needed {
                    continue;
                }
                if decode.is_none_or(|best| decode_rank(m) > decode_rank(best)) {
                    decode = Some(m);
                }
            }
        }
    }
    let (prefill, run) = prefill.ok_or(ClusterError::NoWorker {
        role: Role::Prefill,
        pages_needed,
    })?;
    let decode = decode.ok_or(ClusterError::NoWorker {
        role: Role::Decode,
        pages_needed,
    })?;
    Ok(Route {
        prefill: prefill.id.clone(),
        decode: decode.id.clone(),
        cached_pages: run as usize,
    })
}

/// Prefill's order: the longest cached run, the shortest queue, the most
/// free pages, the smaller id.
fn prefill_rank(m: &Member, run: u64) -> (u64, Reverse<u64>, u64, Reverse<&WorkerId>) {
    (
        run,
        Reverse(m.record.queue_depth),
        m.record.pages_free,
        Reverse(&m.id),
    )
}

/// Decode's order: the shortest queue, the most free pages, the smaller id.
fn decode_rank(m: &Member) -> (Reverse<u64>, u64, Reverse<&WorkerId>) {
    (
        Reverse(m.record.queue_depth),
        m.record.pages_free,
        Reverse(&m.id),
    )
}

#[cfg(test)]
mod tests;
