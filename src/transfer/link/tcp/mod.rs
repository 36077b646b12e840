//! TCP transport: length-prefixed binary frames (see [`frame`]), one
//! connection per worker pair, a reader thread per end.
//!
//! With a worker identity ([`TransferConfig::with_identity`]) both ends
//! prove, before any frame, that they are the workers they claim to be and
//! that each is on the other's allowlist, and every frame is sealed under
//! the session's keys (see [`crate::transfer::link::auth`]); such a link
//! may use any address, and each end knows its peer's [`PeerId`].
//! Without one the link is unauthenticated and unencrypted, and binds and
//! connects to loopback addresses only: for tests, demos and single-user
//! hosts, where any local process could connect as the peer.
//!
//! The decode end's listener waits for a connection that proves itself
//! (authenticates, or without a key sends a valid hello) within the auth
//! timeout, and keeps accepting others meanwhile: a silent or lying
//! stranger is closed and recorded as a [`Refusal`], never made the link.
//!
//! Any frame that cannot be accepted (bad magic or version, unknown kind,
//! oversized, malformed, out of sequence, not valid for its direction, or
//! failing authentication) ends the connection at once with a typed
//! [`WireError`] or [`AuthError`]; the
//! offending frame is never applied. A frame begun must be complete within
//! the write timeout, counted for the whole frame; between frames a link
//! may idle.

mod accept;
mod dial;
pub mod frame;
mod plane;

pub use accept::{MAX_PENDING, MAX_PENDING_PER_SOURCE, Refusal};
pub(crate) use plane::{CreditMark, PlaneReceiver, PlaneSender, SenderFactory};

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use parking_lot::Mutex;

use crate::kv::{Held, KvSeq};
use crate::transfer::config::{TransferConfig, deadline};
use crate::transfer::error::{LinkError, WireError};
use crate::transfer::link::auth::{AuthError, Opener, Sealer, Session, TAG_LEN};
use crate::transfer::link::credits::{Credits, InFlightStats};
use crate::transfer::link::identity::{Allowlist, Identity, PeerId, WorkerKey};
use crate::transfer::link::landing::LandingZone;
use crate::transfer::link::{DecodeLink, PrefillLink, Transfer, recv_within};
use crate::transfer::protocol::{ToDecode, ToPrefill, WriteBatch};
use crate::transfer::testing::gate::{Gate, Step, WriteMsg, receiver_delay};
use dial::{dial, read_until};
use frame::{FLAG_SEALED, Frame, HEADER_LEN, Kind, Role};

/// TCP on 127.0.0.1, authenticated when the configuration carries an
/// identity (both ends in this process are then that one worker, which
/// must trust itself). As a [`Transfer`], connects both ends in this
/// process (threads); for two processes use [`TcpDecodeListener`] and
/// [`TcpPrefill::connect_to`] (or, unauthenticated, [`TcpPrefill::connect`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct Tcp;

/// TCP on 127.0.0.1, always authenticated: with the configuration's
/// identity, or with two fresh worker keys, one per end, each trusting the
/// other (they are in this process). The same transport as [`Tcp`] with
/// identities, as a [`Transfer`] of its own for suites that run every
/// transport.
#[derive(Clone, Copy, Debug, Default)]
pub struct TcpAuth;

impl Transfer for TcpAuth {
    type Prefill = TcpPrefill;
    type Decode = TcpDecode;

    fn name(&self) -> &'static str {
        "tcp+auth"
    }

    fn connect(&self, cfg: &TransferConfig) -> Result<(TcpPrefill, TcpDecode), LinkError> {
        let (pcfg, dcfg) = authenticated_pair(cfg)?;
        connect_pair(&pcfg, &dcfg)
    }
}

impl Transfer for Tcp {
    type Prefill = TcpPrefill;
    type Decode = TcpDecode;

    fn name(&self) -> &'static str {
        "tcp"
    }

    fn connect(&self, cfg: &TransferConfig) -> Result<(TcpPrefill, TcpDecode), LinkError> {
        connect_pair(cfg, cfg)
    }
}

/// Connects a prefill end configured with `pcfg` to a decode end
/// configured with `dcfg`, in this process, on loopback.
fn connect_pair(
    pcfg: &TransferConfig,
    dcfg: &TransferConfig,
) -> Result<(TcpPrefill, TcpDecode), LinkError> {
    let listener = TcpDecodeListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))?;
    let decode_id = dcfg.peer_id();
    let dcfg = dcfg.clone();
    join_in_process(
        listener,
        move |l| l.accept(&dcfg),
        |addr| TcpPrefill::connect_with(addr, decode_id.as_ref(), pcfg, None),
    )
}

/// Joins two ends in this process: `accept` on `listener` on a thread of
/// its own while `connect` dials its address.
pub(crate) fn join_in_process(
    listener: TcpDecodeListener,
    accept: impl FnOnce(&TcpDecodeListener) -> Result<TcpDecode, LinkError> + Send + 'static,
    connect: impl FnOnce(SocketAddr) -> Result<TcpPrefill, LinkError>,
) -> Result<(TcpPrefill, TcpDecode), LinkError> {
    let addr = listener.local_addr()?;
    let accept = std::thread::spawn(move || accept(&listener));
    let prefill = connect(addr);
    let decode = accept.join().map_err(|_| LinkError::Disconnected)?;
    Ok((prefill?, decode?))
}

/// The prefill end's and the decode end's configurations for transports
/// that connect both ends in this process, always authenticated: `cfg`
/// for both when it has an identity, else `cfg` with two fresh worker
/// keys, one per end, each trusting the other.
pub(crate) fn authenticated_pair(
    cfg: &TransferConfig,
) -> Result<(TransferConfig, TransferConfig), LinkError> {
    if cfg.identity().is_some() {
        return Ok((cfg.clone(), cfg.clone()));
    }
    let (p, d) = (WorkerKey::generate()?, WorkerKey::generate()?);
    let both = Allowlist::of([p.peer_id(), d.peer_id()]);
    Ok((
        cfg.clone().with_identity(Identity::new(p, both.clone())),
        cfg.clone().with_identity(Identity::new(d, both)),
    ))
}

/// Refuses a non-loopback address unless links authenticate.
fn check_address(addr: SocketAddr, cfg: Option<&TransferConfig>) -> Result<(), LinkError> {
    if addr.ip().is_loopback() || cfg.is_some_and(|c| c.identity().is_some()) {
        Ok(())
    } else {
        Err(LinkError::NotLoopback {
            addr: addr.to_string(),
        })
    }
}

/// Frames out, numbered (and sealed on an authenticated link).
struct FrameWriter {
    stream: TcpStream,
    seq: u32,
    buf: Vec<u8>,
    sealer: Option<Sealer>,
}

impl FrameWriter {
    fn new(stream: TcpStream, sealer: Option<Sealer>) -> Self {
        FrameWriter {
            stream,
            seq: 0,
            buf: Vec::new(),
            sealer,
        }
    }
    /// Seals the frame in `buf` (header and payload) in place: sets the
    /// sealed flag and length, encrypts the payload under the header, and
    /// appends the tag. Without a session, leaves it as it is.
    fn seal(&mut self) -> Result<(), LinkError> {
        let Some(sealer) = self.sealer.as_mut() else {
            return Ok(());
        };
        let body = self.buf.len().saturating_sub(HEADER_LEN);
        let len = u32::try_from(body + TAG_LEN).map_err(|_| LinkError::Config {
            what: "frame larger than 4 GiB",
        })?;
        let (h, payload) = self.buf.split_at_mut(HEADER_LEN);
        h[7] = FLAG_SEALED;
        h[12..16].copy_from_slice(&len.to_le_bytes());
        let tag = sealer.seal(h, payload)?;
        self.buf.extend_from_slice(&tag);
        Ok(())
    }
    fn next_seq(&mut self) -> u32 {
        let s = self.seq;
        self.seq = self.seq.wrapping_add(1);
        s
    }
    fn send(&mut self, frame: &Frame<'_>) -> Result<(), LinkError> {
        self.buf.clear();
        let seq = self.next_seq();
        frame::encode_frame(&mut self.buf, seq, frame);
        self.seal()?;
        self.stream.write_all(&self.buf)?;
        Ok(())
    }
}

/// Fills `buf` from `stream`. Before a frame's first byte (`begun` is
/// `None`) the link may idle for any time; once a byte of a frame has been
/// read, the whole frame must be complete within `limit` of it (the
/// peer's own write timeout: it would have given up by then), however the
/// bytes trickle in, else the link ends with [`WireError::Stalled`].
fn fill(
    stream: &mut TcpStream,
    limit: Duration,
    buf: &mut [u8],
    begun: &mut Option<Instant>,
) -> Result<(), LinkError> {
    use std::io::ErrorKind::{Interrupted, TimedOut, WouldBlock};
    let mut got = 0;
    while got < buf.len() {
        let wait = match *begun {
            None => limit,
            Some(t0) => {
                let left = deadline(t0, limit).saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(WireError::Stalled {
                        waited_ms: limit.as_millis(),
                    }
                    .into());
                }
                left
            }
        };
        stream.set_read_timeout(Some(wait.max(Duration::from_millis(1))))?;
        match stream.read(&mut buf[got..]) {
            Ok(0) => return Err(LinkError::Disconnected),
            Ok(n) => {
                got += n;
                begun.get_or_insert_with(Instant::now);
            }
            Err(e) if matches!(e.kind(), WouldBlock | TimedOut | Interrupted) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Frames in, checked for sequence and direction.
struct FrameReader {
    stream: TcpStream,
    /// How long a frame, once begun, may take as a whole: the peer's own
    /// write timeout (see [`fill`]).
    limit: Duration,
    expect: u32,
    max: usize,
    buf: Vec<u8>,
    hello: bool,
    peer: Role,
    /// Opens the peer's sealed frames on an authenticated link.
    opener: Option<Opener>,
}

impl FrameReader {
    fn new(stream: TcpStream, cfg: &TransferConfig, peer: Role, opener: Option<Opener>) -> Self {
        FrameReader {
            stream,
            limit: cfg.write_timeout(),
            expect: 0,
            max: cfg.max_frame_bytes(),
            buf: Vec::new(),
            hello: false,
            peer,
            opener,
        }
    }

    /// The next frame's header and payload (in `self.buf`, opened).
    fn next(&mut self) -> Result<frame::Header, LinkError> {
        let mut h = [0u8; HEADER_LEN];
        let mut begun = None;
        fill(&mut self.stream, self.limit, &mut h, &mut begun)?;
        let flags = if self.opener.is_some() {
            FLAG_SEALED
        } else {
            0
        };
        let header = frame::decode_header_flagged(&h, self.max, flags)?;
        if header.seq != self.expect {
            return Err(WireError::OutOfOrder {
                expected: self.expect,
                got: header.seq,
            }
            .into());
        }
        self.expect = self.expect.wrapping_add(1);
        self.buf.resize(header.len as usize, 0);
        fill(&mut self.stream, self.limit, &mut self.buf, &mut begun)?;
        if let Some(opener) = self.opener.as_mut() {
            if self.buf.len() < TAG_LEN {
                return Err(WireError::Truncated { what: "frame tag" }.into());
            }
            opener.open(&h, &mut self.buf)?;
        }
        let first = !self.hello;
        self.hello = true;
        match (first, header.kind == Kind::Hello) {
            (true, true) | (false, false) => Ok(header),
            (true, false) => Err(WireError::Unexpected {
                kind: header.kind.name(),
                context: "before the hello",
            }
            .into()),
            (false, true) => Err(WireError::Unexpected {
                kind: "hello",
                context: "after the first frame",
            }
            .into()),
        }
    }

    /// Waits, by `until`, for the decode end's acceptance on an
    /// authenticated link: its first frame, a hello sealed under this
    /// session, which it sends only once its accept loop has handed this
    /// connection out as its link. A decode end that completed the
    /// handshake but never takes the link is [`AuthError::NotAccepted`].
    fn accepted(&mut self, until: Instant, limit: Duration) -> Result<(), LinkError> {
        let not_accepted = |e: LinkError| match e {
            LinkError::Auth(AuthError::Deadline { waited_ms }) => {
                AuthError::NotAccepted { waited_ms }.into()
            }
            e => e,
        };
        let mut h = [0u8; HEADER_LEN];
        read_until(&self.stream, &mut h, until, limit).map_err(not_accepted)?;
        let header = frame::decode_header_flagged(&h, self.max, FLAG_SEALED)?;
        if header.kind != Kind::Hello || header.seq != self.expect {
            return Err(WireError::Unexpected {
                kind: header.kind.name(),
                context: "before the decode end's acceptance",
            }
            .into());
        }
        self.buf.resize(header.len as usize, 0);
        read_until(&self.stream, &mut self.buf, until, limit).map_err(not_accepted)?;
        if let Some(opener) = self.opener.as_mut() {
            opener.open(&h, &mut self.buf)?;
        }
        let hello = frame::decode_payload(Kind::Hello, &self.buf)?;
        self.check_hello(&hello)?;
        self.expect = self.expect.wrapping_add(1);
        self.hello = true;
        Ok(())
    }

    fn check_hello(&self, f: &Frame<'_>) -> Result<(), LinkError> {
        match f {
            Frame::Hello(role) if *role == self.peer => Ok(()),
            Frame::Hello(_) => Err(WireError::Unexpected {
                kind: "hello",
                context: "from a peer of the same role",
            }
            .into()),
            _ => Ok(()),
        }
    }
}

fn stream_pair(
    stream: &TcpStream,
    cfg: &TransferConfig,
) -> Result<(TcpStream, TcpStream), LinkError> {
    stream.set_nodelay(true)?;
    stream.set_write_timeout(Some(cfg.write_timeout()))?;
    Ok((stream.try_clone()?, stream.try_clone()?))
}

/// A listening decode end. Loopback only, unless the configuration it
/// accepts with carries an identity ([`TcpDecodeListener::bind_with`]).
pub struct TcpDecodeListener {
    listener: TcpListener,
    /// Connections still proving themselves, kept between accepts.
    pending: Mutex<std::collections::VecDeque<accept::Pending>>,
    refusals: accept::Refusals,
}

impl TcpDecodeListener {
    /// Binds `addr`, which must be a loopback address.
    pub fn bind(addr: SocketAddr) -> Result<Self, LinkError> {
        Self::bind_as(addr, None)
    }

    /// Binds `addr`, which may be any address if `cfg` carries an identity
    /// (links then authenticate), else must be a loopback address.
    pub fn bind_with(addr: SocketAddr, cfg: &TransferConfig) -> Result<Self, LinkError> {
        cfg.validate()?;
        Self::bind_as(addr, Some(cfg))
    }

    fn bind_as(addr: SocketAddr, cfg: Option<&TransferConfig>) -> Result<Self, LinkError> {
        check_address(addr, cfg)?;
        let listener = TcpListener::bind(addr)?;
        // The accept loop polls: connections in progress are served while
        // it waits for more.
        listener.set_nonblocking(true)?;
        Ok(TcpDecodeListener {
            listener,
            pending: Mutex::new(std::collections::VecDeque::new()),
            refusals: accept::Refusals::default(),
        })
    }

    /// The bound address (with the port the OS chose for port 0).
    pub fn local_addr(&self) -> Result<SocketAddr, LinkError> {
        Ok(self.listener.local_addr()?)
    }

    /// Accepts one prefill peer, waiting as long as it takes (a server's
    /// accept loop); see [`TcpDecodeListener::accept_within`] for a bound.
    /// Connections that do not prove themselves within
    /// [`TransferConfig::auth_timeout`] (with an identity: the handshake,
    /// from a worker on the allowlist; without: a valid hello) are closed
    /// and recorded ([`TcpDecodeListener::refusals`]) while the wait goes
    /// on. A listener bound to a non-loopback address refuses to accept
    /// without an identity.
    pub fn accept(&self, cfg: &TransferConfig) -> Result<TcpDecode, LinkError> {
        self.accept_until(cfg, None, None)
    }

    /// [`TcpDecodeListener::accept`], or [`LinkError::AcceptTimeout`] once
    /// `limit` has passed without a peer that proved itself (a prefill
    /// process that died before connecting, or only strangers). Connections
    /// still authenticating stay with the listener for the next accept.
    pub fn accept_within(
        &mut self,
        cfg: &TransferConfig,
        limit: std::time::Duration,
    ) -> Result<TcpDecode, LinkError> {
        self.accept_until(cfg, Some(limit), None)
    }

    /// Accepts one prefill peer (as [`TcpDecodeListener::accept_within`])
    /// for a link whose KV bytes come by a data plane that `plane` sets up
    /// once the peer has proved itself.
    #[cfg(feature = "nixl")]
    pub(crate) fn accept_with_plane(
        &self,
        cfg: &TransferConfig,
        limit: Option<Duration>,
        plane: &dyn Fn() -> Result<Box<dyn PlaneReceiver>, LinkError>,
    ) -> Result<TcpDecode, LinkError> {
        self.accept_until(cfg, limit, Some(plane))
    }

    fn accept_until(
        &self,
        cfg: &TransferConfig,
        limit: Option<Duration>,
        plane: Option<&dyn Fn() -> Result<Box<dyn PlaneReceiver>, LinkError>>,
    ) -> Result<TcpDecode, LinkError> {
        cfg.validate()?;
        check_address(self.local_addr()?, Some(cfg))?;
        // Concurrent accepts on one listener take turns.
        let mut pending = self.pending.lock();
        let won = accept::accept_loop(&self.listener, cfg, limit, &mut pending, &self.refusals)?;
        let plane = plane.map(|make| make()).transpose()?;
        TcpDecode::start(won.stream, cfg, won.session, plane)
    }

    /// The connections refused most recently (up to 64), oldest first.
    pub fn refusals(&self) -> Vec<Refusal> {
        self.refusals.recent()
    }

    /// How many connections this listener has refused in all.
    pub fn refused_total(&self) -> u64 {
        self.refusals.total()
    }
}

/// Decode end of a TCP link.
pub struct TcpDecode {
    stream: TcpStream,
    writer: Arc<Mutex<FrameWriter>>,
    events: Receiver<Result<ToDecode, LinkError>>,
    landing: Arc<LandingZone>,
    gate: Gate<ToPrefill>,
    reader: Option<JoinHandle<()>>,
    closed: bool,
    /// The prefill worker's id, proved by the handshake.
    peer: Option<PeerId>,
}

impl TcpDecode {
    /// Starts the link on a connection whose hello the accept loop has read
    /// (and, with a session, opened); with a data plane, sends its
    /// parameters right after the hello.
    fn start(
        stream: TcpStream,
        cfg: &TransferConfig,
        session: Option<Session>,
        plane: Option<Box<dyn PlaneReceiver>>,
    ) -> Result<Self, LinkError> {
        let (w, r) = stream_pair(&stream, cfg)?;
        let peer = session.as_ref().map(|s| s.peer);
        let (sealer, opener) = match session {
            Some(s) => (Some(s.sealer), Some(s.opener)),
            None => (None, None),
        };
        let writer = Arc::new(Mutex::new(FrameWriter::new(w, sealer)));
        writer.lock().send(&Frame::Hello(Role::Decode))?;
        if let Some(p) = &plane {
            writer.lock().send(&Frame::DataPlane(p.parameters()))?;
        }
        let landing = Arc::new(LandingZone::new());
        let (tx, events) = crossbeam_channel::unbounded();
        let mut reader = FrameReader::new(r, cfg, Role::Prefill, opener);
        reader.expect = 1;
        reader.hello = true;
        let handle = {
            let (landing, writer) = (landing.clone(), writer.clone());
            let delay = receiver_delay(cfg);
            std::thread::Builder::new()
                .name("handoff-tcp-decode-reader".into())
                .spawn(move || {
                    let e = decode_reader(reader, &landing, &writer, &tx, delay, plane);
                    let _ = writer.lock().stream.shutdown(Shutdown::Both);
                    let _ = tx.send(Err(e));
                })?
        };
        Ok(TcpDecode {
            stream,
            writer,
            events,
            landing,
            gate: Gate::new(cfg),
            reader: Some(handle),
            closed: false,
            peer,
        })
    }

    /// True when the peer proved it is a worker on this end's allowlist.
    pub fn is_authenticated(&self) -> bool {
        self.peer.is_some()
    }
}

/// Lands one write batch whose K and V rows are `bytes` (equal halves).
pub(crate) fn land(landing: &LandingZone, batch: &WriteBatch, bytes: &[u8]) {
    let half = bytes.len() / 2;
    let row = half.checked_div(batch.tokens as usize).unwrap_or(0);
    landing.apply(batch, half, None, |kv, done, dst| {
        let at = kv * half + done * row;
        if let Some(src) = bytes.get(at..at + dst.len()) {
            dst.copy_from_slice(src);
        }
    });
}

/// Reads frames until the connection ends; returns why it ended.
fn decode_reader(
    mut rd: FrameReader,
    landing: &LandingZone,
    writer: &Mutex<FrameWriter>,
    events: &Sender<Result<ToDecode, LinkError>>,
    delay: Option<Duration>,
    mut plane: Option<Box<dyn PlaneReceiver>>,
) -> LinkError {
    // The number the next staged write must carry.
    let mut next_staged = 0u64;
    loop {
        let header = match rd.next() {
            Ok(h) => h,
            Err(e) => return e,
        };
        let frame = match frame::decode_payload(header.kind, &rd.buf) {
            Ok(f) => f,
            Err(e) => return e.into(),
        };
        if let Err(e) = rd.check_hello(&frame) {
            return e;
        }
        match frame {
            Frame::Hello(_) => {}
            Frame::Write(batch, bytes) => {
                if let Some(d) = delay {
                    std::thread::sleep(d);
                }
                land(landing, &batch, bytes);
                if let Err(e) = writer.lock().send(&Frame::Credit(bytes.len() as u64)) {
                    return e;
                }
            }
            Frame::Staged(batch, staged) => {
                let Some(p) = plane.as_mut() else {
                    return WireError::Unexpected {
                        kind: header.kind.name(),
                        context: "on a link without a data plane",
                    }
                    .into();
                };
                if staged.id != next_staged {
                    return WireError::Invalid {
                        what: "staged write number (out of order)",
                    }
                    .into();
                }
                next_staged += 1;
                if let Some(d) = delay {
                    std::thread::sleep(d);
                }
                if let Err(e) = p.land(landing, &batch, &staged, rd.limit) {
                    return e;
                }
                if let Err(e) = writer.lock().send(&Frame::Credit(staged.len)) {
                    return e;
                }
            }
            Frame::DataPlane(md) if plane.is_some() => {
                if let Some(Err(e)) = plane.as_mut().map(|p| p.peer_metadata(md)) {
                    return e;
                }
            }
            Frame::ToDecode(m) => {
                if events.send(Ok(m)).is_err() {
                    return LinkError::Disconnected;
                }
            }
            Frame::ToPrefill(_) | Frame::Credit(_) | Frame::DataPlane(_) => {
                return WireError::Unexpected {
                    kind: header.kind.name(),
                    context: "from a prefill worker",
                }
                .into();
            }
        }
    }
}

impl DecodeLink for TcpDecode {
    fn landing(&self) -> &Arc<LandingZone> {
        &self.landing
    }

    fn peer(&self) -> Option<PeerId> {
        self.peer
    }

    fn send(&mut self, msg: ToPrefill) -> Result<(), LinkError> {
        if self.closed {
            return Err(LinkError::Disconnected);
        }
        let step = match msg {
            ToPrefill::Plan(_) => Step::PlanSent,
            ToPrefill::Answer(_) => Step::AckSent,
        };
        let emit = self.gate.pass(step, msg);
        for m in emit.msgs {
            self.writer.lock().send(&Frame::ToPrefill(m))?;
        }
        if emit.disconnect {
            self.close();
            return Err(LinkError::Disconnected);
        }
        Ok(())
    }

    fn recv(&mut self, timeout: Duration) -> Result<Option<ToDecode>, LinkError> {
        match recv_within(&self.events, timeout) {
            Ok(Ok(m)) => Ok(Some(m)),
            Ok(Err(e)) => Err(e),
            Err(RecvTimeoutError::Timeout) if !self.closed => Ok(None),
            Err(_) => Err(LinkError::Disconnected),
        }
    }

    fn arrived(&self) -> usize {
        self.events.len()
    }

    fn close(&mut self) {
        self.closed = true;
        let _ = self.stream.shutdown(Shutdown::Both);
        if let Some(h) = self.reader.take() {
            let _ = h.join();
        }
    }
}

impl Drop for TcpDecode {
    fn drop(&mut self) {
        self.close();
    }
}

/// Prefill end of a TCP link.
pub struct TcpPrefill {
    stream: TcpStream,
    writer: FrameWriter,
    incoming: Receiver<Result<ToPrefill, LinkError>>,
    credits: Arc<Credits>,
    writes: Gate<WriteMsg>,
    control: Gate<ToDecode>,
    cfg: TransferConfig,
    reader: Option<JoinHandle<()>>,
    closed: bool,
    /// Moves KV bytes outside the frames, on a link with a data plane.
    plane: Option<Box<dyn PlaneSender>>,
    /// Bytes of the writes sent by the data plane so far (the credit total
    /// at which the last one is back: writes are credited in order).
    staged_bytes: u64,
    /// The decode worker's id, proved by the handshake.
    peer: Option<PeerId>,
}

impl TcpPrefill {
    /// Connects to a decode end at `addr`, a loopback address, without
    /// authentication (`cfg` without an identity; with one this is a
    /// [`LinkError::Config`]: name the decode worker with
    /// [`TcpPrefill::connect_to`]).
    pub fn connect(addr: SocketAddr, cfg: &TransferConfig) -> Result<Self, LinkError> {
        Self::connect_with(addr, None, cfg, None)
    }

    /// Connects to the decode worker `decode` at `addr` (any address) with
    /// `cfg`'s identity: `decode` must be on this worker's allowlist, the
    /// end at `addr` must prove it holds `decode`'s secret key, find this
    /// worker on its own allowlist, and accept this connection as its link
    /// (within [`TransferConfig::auth_timeout`]) before this returns: a
    /// decode end that never does is a typed [`AuthError`]
    /// ([`AuthError::Deadline`] before the key exchange completed,
    /// [`AuthError::NotAccepted`] after it). One that turns the connection
    /// away unread while strangers flood it ([`AuthError::Busy`]) is
    /// dialled again within the same deadline.
    pub fn connect_to(
        addr: SocketAddr,
        decode: &PeerId,
        cfg: &TransferConfig,
    ) -> Result<Self, LinkError> {
        Self::connect_with(addr, Some(decode), cfg, None)
    }

    /// The decode worker's id, proved by the handshake (`None` on an
    /// unauthenticated link).
    pub fn peer_id(&self) -> Option<PeerId> {
        self.peer
    }

    /// [`TcpPrefill::connect_to`] (or, with neither an identity nor
    /// `decode`, [`TcpPrefill::connect`]); with `plane`, the decode end must
    /// offer a data plane (its parameters, right after its hello, within
    /// the auth timeout), from which `plane` makes this end's.
    pub(crate) fn connect_with(
        addr: SocketAddr,
        decode: Option<&PeerId>,
        cfg: &TransferConfig,
        plane: Option<SenderFactory<'_>>,
    ) -> Result<Self, LinkError> {
        cfg.validate()?;
        check_address(addr, Some(cfg))?;
        let (stream, session, until) = dial(addr, decode, cfg)?;
        let peer = session.as_ref().map(|s| s.peer);
        let (sealer, opener) = match session {
            Some(s) => (Some(s.sealer), Some(s.opener)),
            None => (None, None),
        };
        let authenticated = opener.is_some();
        let (w, r) = stream_pair(&stream, cfg)?;
        let mut writer = FrameWriter::new(w, sealer);
        writer.send(&Frame::Hello(Role::Prefill))?;
        let credits = Arc::new(Credits::new(cfg.max_in_flight_bytes()));
        let (tx, incoming) = crossbeam_channel::unbounded();
        let mut reader = FrameReader::new(r, cfg, Role::Decode, opener);
        if authenticated {
            reader.accepted(until, cfg.auth_timeout())?;
        }
        let (params_tx, params_rx) = crossbeam_channel::bounded(1);
        let params_tx = plane.is_some().then_some(params_tx);
        let handle = {
            let credits = credits.clone();
            // A bad frame closes the connection at once, as at the decode
            // end: the peer sees it end, whatever this side does next.
            let closer = stream.try_clone()?;
            std::thread::Builder::new()
                .name("handoff-tcp-prefill-reader".into())
                .spawn(move || {
                    let e = prefill_reader(reader, &credits, &tx, params_tx);
                    let _ = closer.shutdown(Shutdown::Both);
                    credits.close();
                    let _ = tx.send(Err(e));
                })?
        };
        let mut link = TcpPrefill {
            stream,
            writer,
            incoming,
            credits,
            writes: Gate::new(cfg),
            control: Gate::new(cfg),
            cfg: cfg.clone(),
            reader: Some(handle),
            closed: false,
            plane: None,
            staged_bytes: 0,
            peer,
        };
        if let Some(make) = plane {
            let params = match params_rx.recv_timeout(cfg.auth_timeout()) {
                Ok(p) => p,
                // The reader ended first: why it ended.
                Err(_) => {
                    return Err(match link.incoming.try_recv() {
                        Ok(Err(e)) => e,
                        _ => LinkError::DataPlane {
                            what: "the decode end offered no data plane within the auth timeout",
                            detail: "is it serving this transport?".into(),
                        },
                    });
                }
            };
            link.plane = Some(make(&params)?);
        }
        Ok(link)
    }

    fn send_write(&mut self, w: WriteMsg, src: &KvSeq<Held>) -> Result<(), LinkError> {
        let g = src.pool().config().geometry();
        let row = g.kv_dim() * g.dtype.size_bytes();
        let b = w.batch;
        let each = b.tokens as usize * row;
        let kv_bytes = u32::try_from(2 * each).map_err(|_| LinkError::Config {
            what: "write batch larger than 4 GiB",
        })?;
        self.credits.acquire(2 * each, self.cfg.write_timeout())?;
        if let Some(plane) = self.plane.as_mut() {
            self.staged_bytes += 2 * each as u64;
            let mark = CreditMark {
                credits: &self.credits,
                until: self.staged_bytes,
                limit: self.cfg.write_timeout(),
            };
            let staged = plane.send(src, &b, row, w.corrupt, mark)?;
            if let Some(md) = plane.metadata()? {
                self.writer.send(&Frame::DataPlane(&md))?;
            }
            return self.writer.send(&Frame::Staged(b, staged));
        }
        let fw = &mut self.writer;
        fw.buf.clear();
        let seq = fw.next_seq();
        frame::put_write_prefix(&mut fw.buf, seq, &b, kv_bytes);
        let base = fw.buf.len();
        // Room for the tag too: sealing never reallocates the frame.
        fw.buf.reserve(2 * each + TAG_LEN);
        fw.buf.resize(base + 2 * each, 0);
        for kv in 0..2 {
            let dst = &mut fw.buf[base + kv * each..base + (kv + 1) * each];
            crate::transfer::link::copy_rows(src, b.layer as usize, kv, b.start as usize, row, dst);
        }
        if w.corrupt
            && let Some(x) = fw.buf.get_mut(base)
        {
            *x ^= 1;
        }
        fw.seal()?;
        fw.stream.write_all(&fw.buf)?;
        Ok(())
    }
}

/// Reads frames from decode until the connection ends; returns why. With
/// `params`, the first frame after the hello must be the decode end's
/// data-plane parameters, handed over on it.
fn prefill_reader(
    mut rd: FrameReader,
    credits: &Credits,
    out: &Sender<Result<ToPrefill, LinkError>>,
    mut params: Option<Sender<Vec<u8>>>,
) -> LinkError {
    loop {
        let header = match rd.next() {
            Ok(h) => h,
            Err(e) => return e,
        };
        let frame = match frame::decode_payload(header.kind, &rd.buf) {
            Ok(f) => f,
            Err(e) => return e.into(),
        };
        if let Err(e) = rd.check_hello(&frame) {
            return e;
        }
        let want_params = params.is_some() && !matches!(frame, Frame::Hello(_));
        match frame {
            Frame::Hello(_) => {}
            Frame::DataPlane(p) if want_params => {
                if let Some(tx) = params.take() {
                    let _ = tx.send(p.to_vec());
                }
            }
            _ if want_params => {
                return WireError::Unexpected {
                    kind: header.kind.name(),
                    context: "before the data plane's parameters",
                }
                .into();
            }
            Frame::Credit(n) => credits.release(usize::try_from(n).unwrap_or(usize::MAX)),
            Frame::ToPrefill(m) => {
                if out.send(Ok(m)).is_err() {
                    return LinkError::Disconnected;
                }
            }
            Frame::Write(..) | Frame::Staged(..) | Frame::ToDecode(_) | Frame::DataPlane(_) => {
                return WireError::Unexpected {
                    kind: header.kind.name(),
                    context: "from a decode worker",
                }
                .into();
            }
        }
    }
}

impl PrefillLink for TcpPrefill {
    fn peer(&self) -> Option<PeerId> {
        self.peer
    }

    fn recv(&mut self, timeout: Duration) -> Result<Option<ToPrefill>, LinkError> {
        match recv_within(&self.incoming, timeout) {
            Ok(Ok(m)) => Ok(Some(m)),
            Ok(Err(e)) => Err(e),
            Err(RecvTimeoutError::Timeout) if !self.closed => Ok(None),
            Err(_) => Err(LinkError::Disconnected),
        }
    }

    fn write_kv(&mut self, batch: WriteBatch, src: &Arc<KvSeq<Held>>) -> Result<(), LinkError> {
        if self.closed {
            return Err(LinkError::Disconnected);
        }
        let emit = self.writes.pass(
            Step::KvWriting,
            WriteMsg {
                batch,
                corrupt: false,
            },
        );
        for w in emit.msgs {
            self.send_write(w, src)?;
        }
        if emit.disconnect {
            self.close();
            return Err(LinkError::Disconnected);
        }
        Ok(())
    }

    fn send(&mut self, msg: ToDecode) -> Result<(), LinkError> {
        if self.closed {
            return Err(LinkError::Disconnected);
        }
        let emit = self.control.pass(Step::ReceiptSent, msg);
        for m in emit.msgs {
            self.writer.send(&Frame::ToDecode(m))?;
        }
        if emit.disconnect {
            self.close();
            return Err(LinkError::Disconnected);
        }
        Ok(())
    }

    fn in_flight(&self) -> InFlightStats {
        self.credits.stats()
    }

    fn close(&mut self) {
        self.closed = true;
        self.credits.close();
        let _ = self.stream.shutdown(Shutdown::Both);
        if let Some(h) = self.reader.take() {
            let _ = h.join();
        }
    }
}

impl Drop for TcpPrefill {
    fn drop(&mut self) {
        self.close();
    }
}
