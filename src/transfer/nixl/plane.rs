//! The two ends of the NIXL data plane (see [`crate::transfer::tcp`]'s
//! data-plane hooks): the decode end registers a staging ring and sends
//! what the prefill end needs to write into it; the prefill end WRITEs each
//! batch's rows from its held pages into the ring with a NIXL notification
//! carrying the write's number, and the decode end waits for that
//! notification before it lands the bytes.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use nixl_sys::{Agent, Backend, NotificationMap, OptArgs, RegistrationHandle, XferDescList};
use nixl_sys::{MemType, XferOp, XferRequest, XferStatus};

use super::region::{Exposure, Region, Span};
use super::ring::Ring;
use super::runtime::{agent, agent_name, failed};
use crate::kv::{Held, KvPool, KvSeq};
use crate::transfer::error::LinkError;
use crate::transfer::link::copy_rows;
use crate::transfer::protocol::WriteBatch;
use crate::transfer::tcp::frame::Staged;
use crate::transfer::tcp::{PlaneReceiver, PlaneSender};

/// Version of the parameters' layout.
const PARAMS_VERSION: u8 = 1;
/// How far past the write being waited for a notification is kept.
const AHEAD: u64 = 1 << 16;

/// What the decode end sends the prefill end.
#[derive(Debug, PartialEq, Eq)]
struct Params {
    ring_addr: u64,
    ring_len: u64,
    /// The name the prefill end's agent must take: the decode end accepts
    /// notifications from that agent only.
    prefill_name: String,
    /// The decode agent's NIXL metadata (its UCX address and the ring's
    /// remote key).
    md: Vec<u8>,
}

impl Params {
    fn encode(&self) -> Vec<u8> {
        let mut out = vec![PARAMS_VERSION];
        out.extend_from_slice(&self.ring_addr.to_le_bytes());
        out.extend_from_slice(&self.ring_len.to_le_bytes());
        for field in [self.prefill_name.as_bytes(), &self.md] {
            out.extend_from_slice(&(field.len() as u32).to_le_bytes());
            out.extend_from_slice(field);
        }
        out
    }

    fn decode(p: &[u8]) -> Result<Params, LinkError> {
        let bad = |why: &str| LinkError::DataPlane {
            what: "malformed NIXL data-plane parameters",
            detail: why.to_string(),
        };
        let (&version, mut rest) = p.split_first().ok_or_else(|| bad("empty"))?;
        if version != PARAMS_VERSION {
            return Err(bad(&format!(
                "version {version}, this build speaks {PARAMS_VERSION}"
            )));
        }
        let mut u64_field = |what: &str| -> Result<u64, LinkError> {
            let (b, r) = rest.split_first_chunk::<8>().ok_or_else(|| bad(what))?;
            rest = r;
            Ok(u64::from_le_bytes(*b))
        };
        let ring_addr = u64_field("ring address")?;
        let ring_len = u64_field("ring length")?;
        let mut fields = Vec::with_capacity(2);
        for what in ["agent name", "metadata"] {
            let (n, r) = rest.split_first_chunk::<4>().ok_or_else(|| bad(what))?;
            let n = u32::from_le_bytes(*n) as usize;
            if r.len() < n {
                return Err(bad(what));
            }
            let (field, r) = r.split_at(n);
            fields.push(field.to_vec());
            rest = r;
        }
        if !rest.is_empty() {
            return Err(bad("trailing bytes"));
        }
        let md = fields.pop().unwrap_or_default();
        let prefill_name =
            String::from_utf8(fields.pop().unwrap_or_default()).map_err(|_| bad("agent name"))?;
        Ok(Params {
            ring_addr,
            ring_len,
            prefill_name,
            md,
        })
    }
}

/// The decode end: a registered staging ring of twice the in-flight cap.
pub(super) struct Receiver {
    // Fields drop in order: the agent goes (with its notifications), then
    // the ring is deregistered, then fenced.
    notes: Notes,
    _backend: Backend,
    _reg: RegistrationHandle,
    ring: Region,
    params: Vec<u8>,
}

/// The notifications of the decode end's agent.
struct Notes {
    agent: Agent,
    /// The prefill end's agent: the only one whose notifications count.
    peer: String,
    /// Numbers of writes whose notification came, not yet landed.
    came: BTreeSet<u64>,
}

impl Receiver {
    pub(super) fn new(in_flight_cap: usize, devices: Option<&str>) -> Result<Self, LinkError> {
        let name = agent_name("decode")?;
        let peer = agent_name("prefill")?;
        let (agent, backend) = agent(&name, devices)?;
        let ring = Region::new(in_flight_cap.saturating_mul(2), Exposure::PeerWritable)?;
        let reg = agent
            .register_memory(&Span::from(&ring), None)
            .map_err(failed("registering the staging ring"))?;
        let md = agent
            .get_local_md()
            .map_err(failed("reading the decode agent's metadata"))?;
        let params = Params {
            ring_addr: ring.addr() as u64,
            ring_len: ring.len() as u64,
            prefill_name: peer.clone(),
            md,
        }
        .encode();
        Ok(Receiver {
            notes: Notes {
                agent,
                peer,
                came: BTreeSet::new(),
            },
            _backend: backend,
            _reg: reg,
            ring,
            params,
        })
    }
}

impl Notes {
    /// Waits, at most `limit`, for the notification of write `id` (writes
    /// are waited for in order: earlier numbers have landed).
    fn wait(&mut self, id: u64, limit: Duration) -> Result<(), LinkError> {
        let t0 = Instant::now();
        let mut polls = 0u32;
        while !self.came.remove(&id) {
            if t0.elapsed() > limit {
                return Err(LinkError::DataPlane {
                    what: "no NIXL notification for a staged write within the write timeout",
                    detail: format!("write {id} after {} ms", limit.as_millis()),
                });
            }
            self.poll(id)?;
            // The bytes are still being written by the peer, which on a
            // small host needs the core this thread would spin on.
            polls += 1;
            if polls > 4 && !self.came.contains(&id) {
                std::thread::sleep(Duration::from_micros(10));
            }
        }
        Ok(())
    }

    /// Takes the notifications that came (driving the agent's progress),
    /// keeping those for writes `[first, first + AHEAD)`.
    fn poll(&mut self, first: u64) -> Result<(), LinkError> {
        let mut map = NotificationMap::new().map_err(failed("reading NIXL notifications"))?;
        self.agent
            .get_notifications(&mut map, None)
            .map_err(failed("reading NIXL notifications"))?;
        let notes = map
            .take_notifs()
            .map_err(failed("reading NIXL notifications"))?;
        for (from, msgs) in notes {
            // Only the link's own peer names writes; anything else is
            // dropped.
            if from != self.peer {
                continue;
            }
            for m in msgs {
                if let Ok(id) = m.parse::<u64>()
                    && (first..first.saturating_add(AHEAD)).contains(&id)
                {
                    self.came.insert(id);
                }
            }
        }
        Ok(())
    }
}

impl PlaneReceiver for Receiver {
    fn parameters(&self) -> &[u8] {
        &self.params
    }

    fn arrived(&mut self, staged: &Staged, limit: Duration) -> Result<&[u8], LinkError> {
        let (at, len) = (
            usize::try_from(staged.offset).unwrap_or(usize::MAX),
            usize::try_from(staged.len).unwrap_or(usize::MAX),
        );
        let bytes = self.ring.get(at, len).ok_or(LinkError::DataPlane {
            what: "a staged write outside the staging ring",
            detail: format!("{len} bytes at {at} of {}", self.ring.len()),
        })?;
        self.notes.wait(staged.id, limit)?;
        Ok(bytes)
    }
}

/// The prefill end: the registrations of the pools it sends from, the
/// bookkeeping of the peer's ring, and a registered send buffer of the
/// in-flight cap (backed lazily) for the batches that cannot go in place.
///
/// Fields drop in order: a write still in flight is released first, while
/// the memory it reads is registered and mapped.
pub(super) struct Sender {
    /// The write sent last, until it has left this end.
    pending: Option<XferRequest>,
    agent: Agent,
    _backend: Backend,
    _reg: RegistrationHandle,
    buf: Region,
    remote: String,
    ring_addr: u64,
    ring: Ring,
    next_id: u64,
    /// The pools whose page arenas this end's agent has registered (rows
    /// are sent from the held pages in place), kept alive while registered.
    pools: Vec<(KvPool, RegistrationHandle)>,
}

impl Sender {
    pub(super) fn new(
        params: &[u8],
        in_flight_cap: usize,
        devices: Option<&str>,
    ) -> Result<Self, LinkError> {
        let p = Params::decode(params)?;
        let (agent, backend) = agent(&p.prefill_name, devices)?;
        let buf = Region::new(in_flight_cap, Exposure::Private)?;
        let reg = agent
            .register_memory(&Span::from(&buf), None)
            .map_err(failed("registering the send buffer"))?;
        let remote = agent
            .load_remote_md(&p.md)
            .map_err(failed("loading the decode agent's metadata"))?;
        Ok(Sender {
            pending: None,
            agent,
            _backend: backend,
            _reg: reg,
            buf,
            remote,
            ring_addr: p.ring_addr,
            ring: Ring::new(p.ring_len),
            next_id: 0,
            pools: Vec::new(),
        })
    }

    /// The registration of `pool`'s page arena with this end's agent, made
    /// on first use and kept (with the pool) for the life of the link.
    fn register_pool(&mut self, pool: &KvPool) -> Result<(), LinkError> {
        if self.pools.iter().any(|(p, _)| p.same_pool(pool)) {
            return Ok(());
        }
        let Some((addr, len)) = pool.arena_span() else {
            return Err(LinkError::DataPlane {
                what: "registering the pool's pages",
                detail: "they live in device memory, which this transport does not register".into(),
            });
        };
        let reg = self
            .agent
            .register_memory(&Span { addr, len }, None)
            .map_err(failed("registering the pool's pages"))?;
        self.pools.push((pool.clone(), reg));
        Ok(())
    }

    /// Describes the batch's rows where they lie in `src`'s held pages
    /// (one descriptor per run of slots in a page), paired with where they
    /// go in the peer's ring; `false` when the rows cannot be read (the
    /// caller stages them instead).
    fn describe_in_place(
        &mut self,
        src: &KvSeq<Held>,
        b: &WriteBatch,
        row: usize,
        at: u64,
        local: &mut XferDescList<'_>,
        remote: &mut XferDescList<'_>,
    ) -> Result<bool, LinkError> {
        // Device-resident pages have no host address to describe: read_rows
        // hands out staged copies that do not outlive the call.
        if src.pool().residence() != crate::kv::Residence::Host {
            return Ok(false);
        }
        self.register_pool(src.pool())?;
        let half = b.tokens as usize * row;
        let base = self.ring_addr + at;
        for kv in 0..2 {
            let read = src.read_rows(
                b.layer as usize,
                kv,
                b.start as usize,
                b.tokens as usize,
                |done, bytes| {
                    local.add_desc(bytes.as_ptr() as usize, bytes.len(), 0);
                    let to = base + (kv * half + done * row) as u64;
                    remote.add_desc(to as usize, bytes.len(), 0);
                },
            );
            if read.is_err() {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

impl PlaneSender for Sender {
    fn send(
        &mut self,
        src: &KvSeq<Held>,
        b: &WriteBatch,
        row: usize,
        credited: u64,
        corrupt: bool,
    ) -> Result<Staged, LinkError> {
        if self.pending.is_some() {
            return Err(LinkError::DataPlane {
                what: "a NIXL WRITE never settled",
                detail: "the link failed mid-write; reconnect".into(),
            });
        }
        let half = b.tokens as usize * row;
        let len = 2 * half;
        self.ring.free_through(credited);
        let at = self.ring.alloc(len as u64).ok_or(LinkError::DataPlane {
            what: "the decode end's staging ring is full",
            detail: "the peer credited back fewer bytes than it landed".into(),
        })?;
        let mut local = XferDescList::new(MemType::Dram).map_err(failed("describing a write"))?;
        let mut remote = XferDescList::new(MemType::Dram).map_err(failed("describing a write"))?;
        // The rows go from the held pages themselves, unless the fault
        // injector must alter them (never the pool's bytes) or they cannot
        // be read: then from a copy in the send buffer.
        let in_place =
            !corrupt && self.describe_in_place(src, b, row, at, &mut local, &mut remote)?;
        if !in_place {
            local.clear();
            remote.clear();
            let dst = self.buf.head_mut(len).ok_or(LinkError::Config {
                what: "a write batch larger than the in-flight cap",
            })?;
            for kv in 0..2 {
                let part = &mut dst[kv * half..(kv + 1) * half];
                copy_rows(src, b.layer as usize, kv, b.start as usize, row, part);
            }
            if corrupt && let Some(x) = dst.first_mut() {
                *x ^= 1;
            }
            local.add_desc(self.buf.addr(), len, 0);
            remote.add_desc((self.ring_addr + at) as usize, len, 0);
        }
        let id = self.next_id;
        self.next_id += 1;
        let mut args = OptArgs::new().map_err(failed("describing a write"))?;
        args.set_has_notification(true)
            .and_then(|()| args.set_notification_message(id.to_string().as_bytes()))
            .map_err(failed("describing a write"))?;
        let req = self
            .agent
            .create_xfer_req(XferOp::Write, &local, &remote, &self.remote, Some(&args))
            .map_err(failed("creating a NIXL WRITE"))?;
        let in_progress = self
            .agent
            .post_xfer_req(&req, Some(&args))
            .map_err(failed("posting a NIXL WRITE"))?;
        self.pending = in_progress.then_some(req);
        Ok(Staged {
            id,
            offset: at,
            len: len as u64,
        })
    }

    fn settle(&mut self, limit: Duration) -> Result<(), LinkError> {
        let Some(req) = self.pending.take() else {
            return Ok(());
        };
        let t0 = Instant::now();
        let mut polls = 0u32;
        loop {
            match self.agent.get_xfer_status(&req) {
                Ok(XferStatus::Success) => return Ok(()),
                Ok(XferStatus::InProgress) if t0.elapsed() <= limit => {}
                Ok(XferStatus::InProgress) => {
                    return Err(LinkError::DataPlane {
                        what: "a NIXL WRITE did not complete within the write timeout",
                        detail: format!("{} ms", limit.as_millis()),
                    });
                }
                Err(e) => return Err(failed("completing a NIXL WRITE")(e)),
            }
            polls += 1;
            if polls > 64 {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_round_trip_and_malformed_ones_are_refused() {
        let p = Params {
            ring_addr: 0x7f00_0000_1000,
            ring_len: 1 << 27,
            prefill_name: "handoff-prefill-00ff".into(),
            md: vec![1, 2, 3, 250],
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
}
