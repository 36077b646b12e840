//! NIXL transport: KV bytes move by NIXL READ (NVIDIA's Inference Xfer
//! Library, over UCX: shared memory on one host, RDMA or TCP across hosts)
//! straight from the held pages of the prefill end's pool into the
//! destination pages of the decode end's pool, with no staging copy; plans,
//! receipts, credits and NIXL's own metadata go over the authenticated TCP
//! link ([`crate::transfer::link::tcp`]), sealed.
//!
//! Why the decode end READs rather than the prefill end WRITEs: every byte
//! that lands in the decode end's pool is then one it asked for, for a
//! write the landing zone let in, from inside the landing zone's fence (the
//! READ starts after the same checks as a framed write and has ended, or
//! been torn down with the agent, before the fence opens). So a write can
//! never land in pages the landing zone has let go of, whatever the peer
//! does or however late it is, and the decode end never hands out an
//! address or remote key of its memory: its agent's metadata never leaves
//! the process. The prefill end's pool arena is what a peer may read, and
//! only the authenticated peer gets its metadata (inside the sealed link).
//!
//! The trust boundary is the link's authenticated peer (a worker on the
//! allowlist), not the registration. A
//! registration bounds what the peer's NIXL agrees to name (a READ outside
//! it fails before it is posted), not what the prefill end serves: over
//! UCX's TCP and shared-memory transports a peer holding metadata from
//! before a deregistration still READs the deregistered memory (seen with
//! nixl-cu12 1.5.1), and with UCX's registration cache an RDMA NIC may keep
//! serving it too. So registering only each transfer's pages, for its
//! duration, would bound an honest decode end, which already reads only
//! what each write announces, and not a hostile one; a decode worker on the
//! prefill end's allowlist is trusted with the prefill end's whole pool.
//! A READ that races the prefill end letting go of its pages (an ack
//! timeout, a dropped link) can only fetch other bytes into a destination
//! whose receipt is then refused by its checksums: the same outcome as any
//! corrupted write.
//!
//! NIXL comes from the `nixl-cu12` wheel (`scripts/install-nixl.sh`): this
//! crate loads `libnixl_capi.so` at run time ([`load`], or the path in
//! `$HANDOFF_NIXL_LIB`), and every entry point answers
//! [`LinkError::NixlUnavailable`] when it cannot, never aborting.
//!
//! ```no_run
//! use handoff::transfer::{Allowlist, Identity, Nixl, NixlConfig, TcpDecodeListener, TransferConfig, WorkerKey};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Each worker loads its own key; both trust the deployment's allowlist.
//! let (pkey, dkey) = (WorkerKey::generate()?, WorkerKey::generate()?);
//! let decode_id = dkey.peer_id();
//! let trusted = Allowlist::of([pkey.peer_id(), decode_id]);
//! let dcfg = TransferConfig::default().with_identity(Identity::new(dkey, trusted.clone()));
//! let pcfg = TransferConfig::default().with_identity(Identity::new(pkey, trusted));
//! // Decode process:
//! let listener = TcpDecodeListener::bind_with("127.0.0.1:24000".parse().unwrap(), &dcfg)?;
//! # let decode = std::thread::spawn(move || {
//! let decode_link = Nixl::accept(&listener, &dcfg, &NixlConfig::default())?;
//! # Ok::<_, handoff::transfer::LinkError>(decode_link) });
//! // Prefill process, dialling the decode worker by address and id:
//! let addr = "127.0.0.1:24000".parse()?;
//! let prefill_link = Nixl::connect(addr, Some(&decode_id), &pcfg, &NixlConfig::default())?;
//! # Ok(()) }
//! ```

mod plane;
mod region;
mod runtime;
mod send_ring;
#[cfg(test)]
mod tests;

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::time::Duration;

pub use runtime::LIB_ENV;

use crate::transfer::config::TransferConfig;
use crate::transfer::error::LinkError;
use crate::transfer::link::Transfer;
use crate::transfer::link::identity::PeerId;
use crate::transfer::link::tcp::{
    PlaneReceiver, PlaneSender, TcpDecode, TcpDecodeListener, TcpPrefill, authenticated_pair,
    join_in_process,
};

/// Loads `libnixl_capi.so` from `path` for this process (its dependencies,
/// UCX and NIXL's plugins, resolve from beside it, as the wheel lays them
/// out). The first load, or the first use of NIXL, decides for the process.
pub fn load(path: &Path) -> Result<(), LinkError> {
    runtime::load(path)
}

/// Whether NIXL can be used in this process (see [`load`]); the error says
/// why not.
pub fn available() -> Result<(), LinkError> {
    runtime::ready()
}

/// How an end's NIXL agent reaches its peer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NixlConfig {
    /// UCX network devices to use (UCX's `UCX_NET_DEVICES` syntax, e.g.
    /// `"lo"` or `"mlx5_0:1"`); `None` lets UCX choose. Shared-memory
    /// transports between processes on one host are used either way.
    pub ucx_devices: Option<String>,
}

/// NIXL between two ends in this process, over loopback: the control link
/// is authenticated TCP (with the configuration's identity, or two fresh
/// worker keys, one per end), UCX restricted to the loopback device. For two processes
/// use [`Nixl::accept`] and [`Nixl::connect`].
#[derive(Clone, Copy, Debug, Default)]
pub struct Nixl;

impl Nixl {
    /// Accepts one prefill peer on `listener` (as
    /// [`TcpDecodeListener::accept`]: strangers are refused meanwhile) and
    /// sets up the NIXL data plane once it has proved itself.
    pub fn accept(
        listener: &TcpDecodeListener,
        cfg: &TransferConfig,
        nixl: &NixlConfig,
    ) -> Result<TcpDecode, LinkError> {
        Self::accept_until(listener, cfg, nixl, None)
    }

    /// [`Nixl::accept`], or [`LinkError::AcceptTimeout`] once `limit` has
    /// passed without a peer that proved itself.
    pub fn accept_within(
        listener: &TcpDecodeListener,
        cfg: &TransferConfig,
        nixl: &NixlConfig,
        limit: Duration,
    ) -> Result<TcpDecode, LinkError> {
        Self::accept_until(listener, cfg, nixl, Some(limit))
    }

    fn accept_until(
        listener: &TcpDecodeListener,
        cfg: &TransferConfig,
        nixl: &NixlConfig,
        limit: Option<Duration>,
    ) -> Result<TcpDecode, LinkError> {
        runtime::ready()?;
        let cap = cfg.max_in_flight_bytes();
        let devices = nixl.ucx_devices.clone();
        listener.accept_with_plane(cfg, limit, &move || {
            let r = plane::Receiver::new(cap, devices.as_deref())?;
            Ok(Box::new(r) as Box<dyn PlaneReceiver>)
        })
    }

    /// Connects to the decode worker `decode` at `addr` that serves NIXL
    /// ([`Nixl::accept`]), as [`TcpPrefill::connect_to`] (or, with neither
    /// an identity in `cfg` nor `decode`, unauthenticated on loopback, as
    /// [`TcpPrefill::connect`]), then sets up the NIXL data plane from the
    /// parameters it sends.
    pub fn connect(
        addr: SocketAddr,
        decode: Option<&PeerId>,
        cfg: &TransferConfig,
        nixl: &NixlConfig,
    ) -> Result<TcpPrefill, LinkError> {
        runtime::ready()?;
        let cap = cfg.max_in_flight_bytes();
        let devices = nixl.ucx_devices.clone();
        let make = move |params: &[u8]| {
            let s = plane::Sender::new(params, cap, devices.as_deref())?;
            Ok(Box::new(s) as Box<dyn PlaneSender>)
        };
        TcpPrefill::connect_with(addr, decode, cfg, Some(&make))
    }
}

impl Transfer for Nixl {
    type Prefill = TcpPrefill;
    type Decode = TcpDecode;

    fn name(&self) -> &'static str {
        "nixl"
    }

    fn connect(&self, cfg: &TransferConfig) -> Result<(TcpPrefill, TcpDecode), LinkError> {
        runtime::ready()?;
        let (cfg, dcfg) = authenticated_pair(cfg)?;
        let decode_id = dcfg.peer_id().ok_or(LinkError::Config {
            what: "an authenticated pair has identities",
        })?;
        let nixl = NixlConfig {
            ucx_devices: Some("lo".into()),
        };
        let dnixl = nixl.clone();
        join_in_process(
            bind_loopback()?,
            move |l| Nixl::accept(l, &dcfg, &dnixl),
            |addr| Nixl::connect(addr, Some(&decode_id), &cfg, &nixl),
        )
    }
}

/// A decode listener on 127.0.0.1 at a free port below the ephemeral
/// range (32768-60999) where UCX binds its own sockets, so the two never
/// collide (binding port 0 would pick from that range).
pub fn bind_loopback() -> Result<TcpDecodeListener, LinkError> {
    let mut b = [0u8; 2];
    getrandom::fill(&mut b).map_err(|e| LinkError::DataPlane {
        what: "choosing a control port",
        detail: e.to_string(),
    })?;
    let start = 20_000 + u16::from_le_bytes(b) % 10_000;
    let mut last = None;
    for i in 0..64u16 {
        let port = 20_000 + (start - 20_000 + i * 157) % 12_000;
        match TcpDecodeListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, port))) {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or(LinkError::Config {
        what: "no free control port below 32768",
    }))
}
