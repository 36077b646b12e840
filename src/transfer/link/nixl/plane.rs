//! The two ends of the NIXL data plane (see [`crate::transfer::link::tcp`]'s
//! data-plane hooks). The prefill end registers its pools' page arenas (and
//! a send buffer) and hands its agent's metadata to the decode end over the
//! sealed link; for each write batch it announces where the batch's rows
//! lie in its held pages. The decode end READs them from there straight
//! into its destination pages, from inside the landing zone's fence, and
//! waits for the READ to end before the fence opens.

use std::time::{Duration, Instant};

use nixl_sys::{Agent, Backend, RegistrationHandle, XferDescList};
use nixl_sys::{MemType, XferOp, XferStatus};

use super::region::{Region, Span};
use super::runtime::{agent, agent_name, failed};
use super::send_ring::SendRing;
use crate::kv::{Held, KvPool, KvSeq};
use crate::transfer::error::LinkError;
use crate::transfer::link::copy_rows;
use crate::transfer::link::landing::{Direct, LandingZone};
use crate::transfer::link::tcp::frame::Staged;
use crate::transfer::link::tcp::{CreditMark, PlaneReceiver, PlaneSender, land};
use crate::transfer::protocol::WriteBatch;

/// Version of the parameters' layout.
const PARAMS_VERSION: u8 = 2;

/// What the decode end sends the prefill end.
#[derive(Debug, PartialEq, Eq)]
struct Params {
    /// The name the prefill end's agent must take: the decode end loads
    /// metadata for that agent only.
    prefill_name: String,
}

impl Params {
    fn encode(&self) -> Vec<u8> {
        let mut out = vec![PARAMS_VERSION];
        out.extend_from_slice(&(self.prefill_name.len() as u32).to_le_bytes());
        out.extend_from_slice(self.prefill_name.as_bytes());
        out
    }

    fn decode(p: &[u8]) -> Result<Params, LinkError> {
        let bad = |why: &str| LinkError::DataPlane {
            what: "malformed NIXL data-plane parameters",
            detail: why.to_string(),
        };
        let (&version, rest) = p.split_first().ok_or_else(|| bad("empty"))?;
        if version != PARAMS_VERSION {
            return Err(bad(&format!(
                "version {version}, this build speaks {PARAMS_VERSION}"
            )));
        }
        let (n, rest) = rest
            .split_first_chunk::<4>()
            .ok_or_else(|| bad("agent name"))?;
        let n = u32::from_le_bytes(*n) as usize;
        if rest.len() != n {
            return Err(bad(if rest.len() < n {
                "agent name"
            } else {
                "trailing bytes"
            }));
        }
        let prefill_name = String::from_utf8(rest.to_vec()).map_err(|_| bad("agent name"))?;
        Ok(Params { prefill_name })
    }
}

/// The decode end. Its agent's metadata never leaves this process: no
/// peer can name its memory, and every byte that lands in it is one this
/// end READ, for a write the landing zone let in.
pub(super) struct Receiver {
    /// `None` once torn down (a READ that failed or did not end in time).
    live: Option<Live>,
    params: Vec<u8>,
    /// The prefill end's agent, the only one whose metadata is taken.
    peer: String,
}

/// A decode end's NIXL state. Dropping it destroys the agent (after its
/// registrations), which ends any READ of its still in flight: nothing
/// lands after that.
struct Live {
    agent: Agent,
    _backend: Backend,
    /// The peer's agent once its metadata is loaded.
    remote: Option<String>,
    /// Destination pools whose page arenas the agent has registered (READs
    /// land in them in place), kept alive while registered.
    pools: Vec<(KvPool, RegistrationHandle)>,
    _buf_reg: RegistrationHandle,
    /// Where the READs for device-resident destination pages land, to be
    /// copied into them by the landing zone.
    buf: Region,
}

impl Receiver {
    pub(super) fn new(in_flight_cap: usize, devices: Option<&str>) -> Result<Self, LinkError> {
        let name = agent_name("decode")?;
        let peer = agent_name("prefill")?;
        let (agent, backend) = agent(&name, devices, false)?;
        let buf = Region::new(in_flight_cap)?;
        let buf_reg = agent
            .register_memory(&Span::from(&buf), None)
            .map_err(failed("registering the landing buffer"))?;
        let params = Params {
            prefill_name: peer.clone(),
        }
        .encode();
        Ok(Receiver {
            live: Some(Live {
                agent,
                _backend: backend,
                remote: None,
                pools: Vec::new(),
                _buf_reg: buf_reg,
                buf,
            }),
            params,
            peer,
        })
    }
}

fn torn_down() -> LinkError {
    LinkError::DataPlane {
        what: "the NIXL data plane was torn down after a failed READ",
        detail: "reconnect".into(),
    }
}

impl Live {
    fn register_pool(&mut self, pool: &KvPool) -> Result<(), LinkError> {
        register_pool(&self.agent, &mut self.pools, pool).map(drop)
    }

    /// READs the peer's spans `src` into this end's spans `dst` (the same
    /// bytes in all, in order) and waits, at most `limit`, for the READ to
    /// end.
    fn read(
        &self,
        dst: &[(usize, usize)],
        src: &[(u64, u64)],
        limit: Duration,
    ) -> Result<(), LinkError> {
        let remote = self.remote.as_deref().ok_or(LinkError::DataPlane {
            what: "a staged write before the prefill end's NIXL metadata",
            detail: "the peer must send its metadata first".into(),
        })?;
        let mut local = XferDescList::new(MemType::Dram).map_err(failed("describing a READ"))?;
        let mut from = XferDescList::new(MemType::Dram).map_err(failed("describing a READ"))?;
        pair_spans(dst, src, |l, r, n| {
            local.add_desc(l, n, 0);
            from.add_desc(r, n, 0);
        })?;
        let req = self
            .agent
            .create_xfer_req(XferOp::Read, &local, &from, remote, None)
            .map_err(failed("creating a NIXL READ"))?;
        let in_progress = self
            .agent
            .post_xfer_req(&req, None)
            .map_err(failed("posting a NIXL READ"))?;
        if !in_progress {
            return Ok(());
        }
        let t0 = Instant::now();
        let mut polls = 0u32;
        loop {
            match self.agent.get_xfer_status(&req) {
                Ok(XferStatus::Success) => return Ok(()),
                Ok(XferStatus::InProgress) if t0.elapsed() <= limit => {}
                Ok(XferStatus::InProgress) => {
                    return Err(LinkError::DataPlane {
                        what: "a NIXL READ did not complete within the write timeout",
                        detail: format!("{} ms", limit.as_millis()),
                    });
                }
                Err(e) => return Err(failed("completing a NIXL READ")(e)),
            }
            polls += 1;
            if polls > 64 {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }
}

/// The registration of `pool`'s page arena with `agent`, made on first use
/// and kept in `pools` (with the pool, so its arena outlives it) for the
/// life of the link; `true` when it is new.
fn register_pool(
    agent: &Agent,
    pools: &mut Vec<(KvPool, RegistrationHandle)>,
    pool: &KvPool,
) -> Result<bool, LinkError> {
    if pools.iter().any(|(p, _)| p.same_pool(pool)) {
        return Ok(false);
    }
    let Some((addr, len)) = pool.arena_span() else {
        return Err(LinkError::DataPlane {
            what: "registering the pool's pages",
            detail: "they live in device memory, which this transport does not register".into(),
        });
    };
    let reg = agent
        .register_memory(&Span { addr, len }, None)
        .map_err(failed("registering the pool's pages"))?;
    pools.push((pool.clone(), reg));
    Ok(true)
}

/// Pairs this end's spans `dst` with the peer's spans `src`, byte for byte
/// in order, calling `pair(local, remote, len)` for each piece where
/// neither crosses a span's end; an error when the two do not hold the same
/// number of bytes.
fn pair_spans(
    dst: &[(usize, usize)],
    src: &[(u64, u64)],
    mut pair: impl FnMut(usize, usize, usize),
) -> Result<(), LinkError> {
    let (mut i, mut j, mut di, mut sj) = (0, 0, 0usize, 0u64);
    while i < dst.len() && j < src.len() {
        let (d, dl) = dst[i];
        let (s, sl) = src[j];
        let n = (dl - di).min(usize::try_from(sl - sj).unwrap_or(usize::MAX));
        let r = usize::try_from(s + sj).map_err(|_| LinkError::DataPlane {
            what: "a staged span outside this platform's address space",
            detail: format!("{s:#x}"),
        })?;
        if n > 0 {
            pair(d + di, r, n);
        }
        di += n;
        sj += n as u64;
        if di == dl {
            (i, di) = (i + 1, 0);
        }
        if sj == sl {
            (j, sj) = (j + 1, 0);
        }
    }
    if i < dst.len() || j < src.len() {
        return Err(LinkError::DataPlane {
            what: "a staged write whose spans do not match its rows",
            detail: format!(
                "{} destination bytes, {} announced",
                dst.iter().map(|d| d.1).sum::<usize>(),
                src.iter().map(|s| s.1).sum::<u64>()
            ),
        });
    }
    Ok(())
}

impl PlaneReceiver for Receiver {
    fn parameters(&self) -> &[u8] {
        &self.params
    }

    fn peer_metadata(&mut self, md: &[u8]) -> Result<(), LinkError> {
        let live = self.live.as_mut().ok_or_else(torn_down)?;
        let name = live
            .agent
            .load_remote_md(md)
            .map_err(failed("loading the prefill agent's metadata"))?;
        if name != self.peer {
            return Err(LinkError::DataPlane {
                what: "NIXL metadata of another agent than the link's prefill end",
                detail: name,
            });
        }
        live.remote = Some(name);
        Ok(())
    }

    fn land(
        &mut self,
        landing: &LandingZone,
        batch: &WriteBatch,
        staged: &Staged,
        limit: Duration,
    ) -> Result<(), LinkError> {
        let mut slot = self.live.take();
        if slot.is_none() {
            return Err(torn_down());
        }
        let half = usize::try_from(staged.len / 2).unwrap_or(usize::MAX);
        // The READ runs inside the fence; one that fails is torn down (the
        // agent destroyed) before the fence opens.
        let out = landing.apply_direct(batch, half, |pool, rows| {
            let Some(live) = slot.as_mut() else {
                return Err(torn_down());
            };
            let dst: Vec<_> = rows
                .iter()
                .map(|r| (r.as_ptr() as usize, r.len()))
                .collect();
            let read = live
                .register_pool(pool)
                .and_then(|()| live.read(&dst, &staged.src, limit));
            if read.is_err() {
                slot = None;
            }
            read
        });
        let result = match out {
            Direct::Landed(_) => Ok(()),
            Direct::Failed(e) => Err(e),
            // Device pages: READ into the buffer, then land from it.
            Direct::Staged => match slot.as_mut() {
                None => Err(torn_down()),
                Some(live) => {
                    let len = usize::try_from(staged.len).unwrap_or(usize::MAX);
                    if len > live.buf.len() {
                        Err(LinkError::Config {
                            what: "a write batch larger than the in-flight cap",
                        })
                    } else {
                        match live.read(&[(live.buf.addr(), len)], &staged.src, limit) {
                            Ok(()) => {
                                if let Some(bytes) = live.buf.get(0, len) {
                                    land(landing, batch, bytes);
                                }
                                Ok(())
                            }
                            Err(e) => {
                                slot = None;
                                Err(e)
                            }
                        }
                    }
                }
            },
        };
        self.live = slot;
        result
    }
}

/// The prefill end: the registrations of the pools it sends from and of a
/// send buffer of the in-flight cap (backed lazily) for the batches that
/// cannot be read in place, used as a ring ([`SendRing`]). A progress
/// thread serves the peer's READs.
pub(super) struct Sender {
    agent: Agent,
    _backend: Backend,
    _reg: RegistrationHandle,
    buf: Region,
    next_id: u64,
    /// The pools whose page arenas this end's agent has registered (rows
    /// are read from the held pages in place), kept alive while registered.
    pools: Vec<(KvPool, RegistrationHandle)>,
    /// The peer has not seen this end's metadata as it is now.
    md_stale: bool,
    /// Which parts of the send buffer the peer may still be reading.
    ring: SendRing,
}

impl Sender {
    pub(super) fn new(
        params: &[u8],
        in_flight_cap: usize,
        devices: Option<&str>,
    ) -> Result<Self, LinkError> {
        let p = Params::decode(params)?;
        let (agent, backend) = agent(&p.prefill_name, devices, true)?;
        let buf = Region::new(in_flight_cap)?;
        let reg = agent
            .register_memory(&Span::from(&buf), None)
            .map_err(failed("registering the send buffer"))?;
        Ok(Sender {
            agent,
            _backend: backend,
            _reg: reg,
            buf,
            next_id: 0,
            pools: Vec::new(),
            md_stale: true,
            ring: SendRing::new(in_flight_cap as u64),
        })
    }

    fn register_pool(&mut self, pool: &KvPool) -> Result<(), LinkError> {
        if register_pool(&self.agent, &mut self.pools, pool)? {
            self.md_stale = true;
        }
        Ok(())
    }

    /// Where the batch's rows lie in `src`'s held pages (one span per run
    /// of slots in a page, K rows then V rows), or `None` when they cannot
    /// be read in place (the caller copies them to the send buffer).
    fn spans_in_place(
        &mut self,
        src: &KvSeq<Held>,
        b: &WriteBatch,
    ) -> Result<Option<Vec<(u64, u64)>>, LinkError> {
        // Device-resident pages have no host address to name: read_rows
        // hands out staged copies that do not outlive the call.
        if src.pool().residence() != crate::kv::Residence::Host {
            return Ok(None);
        }
        self.register_pool(src.pool())?;
        let mut spans = Vec::new();
        for kv in 0..2 {
            let read = src.read_rows(
                b.layer as usize,
                kv,
                b.start as usize,
                b.tokens as usize,
                |_, bytes| spans.push((bytes.as_ptr() as u64, bytes.len() as u64)),
            );
            if read.is_err() {
                return Ok(None);
            }
        }
        Ok(Some(spans))
    }
}

impl PlaneSender for Sender {
    fn send(
        &mut self,
        src: &KvSeq<Held>,
        b: &WriteBatch,
        row: usize,
        corrupt: bool,
        mark: CreditMark<'_>,
    ) -> Result<Staged, LinkError> {
        let half = b.tokens as usize * row;
        let len = 2 * half;
        // The rows are read from the held pages themselves, unless the
        // fault injector must alter them (never the pool's bytes) or they
        // cannot be named: then from a copy in the send buffer.
        let in_place = if corrupt {
            None
        } else {
            self.spans_in_place(src, b)?
        };
        let spans = match in_place {
            Some(spans) => spans,
            None => {
                let at = self.ring.alloc(len as u64, &mark)?;
                let dst = self
                    .buf
                    .range_mut(at as usize, len)
                    .ok_or(LinkError::Config {
                        what: "a write batch larger than the in-flight cap",
                    })?;
                for kv in 0..2 {
                    let part = &mut dst[kv * half..(kv + 1) * half];
                    copy_rows(src, b.layer as usize, kv, b.start as usize, row, part);
                }
                if corrupt && let Some(x) = dst.first_mut() {
                    *x ^= 1;
                }
                vec![(self.buf.addr() as u64 + at, len as u64)]
            }
        };
        let id = self.next_id;
        self.next_id += 1;
        Ok(Staged {
            id,
            len: len as u64,
            src: spans,
        })
    }

    fn metadata(&mut self) -> Result<Option<Vec<u8>>, LinkError> {
        if !self.md_stale {
            return Ok(None);
        }
        let md = self
            .agent
            .get_local_md()
            .map_err(failed("reading the prefill agent's metadata"))?;
        self.md_stale = false;
        Ok(Some(md))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_round_trip_and_malformed_ones_are_refused() {
        let p = Params {
            prefill_name: "handoff-prefill-00ff".into(),
        };
        let bytes = p.encode();
        assert_eq!(Params::decode(&bytes).ok(), Some(p));
        for cut in 0..bytes.len() {
            assert!(
                matches!(
                    Params::decode(&bytes[..cut]),
                    Err(LinkError::DataPlane { .. })
                ),
                "truncated at {cut}"
            );
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(Params::decode(&longer).is_err());
        let mut newer = bytes;
        newer[0] = PARAMS_VERSION + 1;
        assert!(Params::decode(&newer).is_err());
    }

    /// Spans pair byte for byte whatever their cuts; a mismatch in total
    /// is refused.
    #[test]
    fn spans_pair_byte_for_byte_and_unequal_totals_are_refused() {
        let dst = [(1000usize, 10usize), (2000, 6)];
        let src = [(50u64, 4u64), (60, 12)];
        let mut got = Vec::new();
        pair_spans(&dst, &src, |l, r, n| got.push((l, r, n))).unwrap();
        assert_eq!(got, vec![(1000, 50, 4), (1004, 60, 6), (2000, 66, 6)]);
        assert!(pair_spans(&dst, &[(50, 15)], |_, _, _| {}).is_err());
        assert!(pair_spans(&dst, &[(50, 17)], |_, _, _| {}).is_err());
    }
}
