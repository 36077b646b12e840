//! The decode end's accept loop: every connection must prove itself (with an
//! identity: the handshake of [`crate::transfer::auth`] and a sealed hello;
//! without: a valid hello frame) within the auth timeout, while the loop
//! keeps accepting others. The first connection that does becomes the link;
//! a stranger that connects first, stays silent, or floods the port is
//! closed and recorded as a [`Refusal`], and never holds the link.
//!
//! One thread, non-blocking sockets: a connection in progress costs a
//! socket and a few hundred bytes. Under a flood:
//!
//! - Every connection has its own deadline (the auth timeout from its
//!   accept); nothing a newer connection does shortens it.
//! - A connection that has *begun* its handshake (with an identity: its
//!   first message opened, naming a worker key on the allowlist and proving
//!   it holds that key's secret, which no stranger can forge) is never
//!   closed to make room: only its own deadline or its own bytes end it. A
//!   stranger's first message, or one from a worker off the allowlist, is
//!   refused when it is read.
//! - Each source address has a budget of [`MAX_PENDING_PER_SOURCE`]
//!   connections in progress, and all sources together [`MAX_PENDING`].
//!   A newcomer past a budget displaces the oldest connection of the same
//!   source (or, past the total, of the busiest source) that has not begun
//!   its handshake, after one last read of what it sent; it is told
//!   "busy" ([`crate::transfer::auth::AuthError::Busy`]: the real peer,
//!   had it been that one, tries again) and recorded as
//!   [`AuthError::Evicted`]. A flood from elsewhere never touches another
//!   source's connections. When nothing can be displaced, the newcomer is
//!   told busy instead.
//! - New connections are taken a few at a time between passes over those
//!   in progress, so a real peer's first message is read within a few
//!   accepts of its arrival however long the queue of strangers behind it.
//! - Running out of file descriptors pauses accepting; it never ends the
//!   listener.

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::transfer::config::{TransferConfig, deadline};
use crate::transfer::error::{LinkError, WireError};
use crate::transfer::link::auth::{
    AuthError, BUSY_MAGIC, HS_HEADER_LEN, HS_MAGIC, HS_VERSION, Handshake, Session, TAG_LEN,
    hs_header,
};
use crate::transfer::link::identity::Identity;
use crate::transfer::link::tcp::frame::{
    self, FLAG_SEALED, Frame, HEADER_LEN, Kind, MAGIC, Role, decode_header_flagged,
};

/// Connections authenticating at once, at most, from all sources.
pub const MAX_PENDING: usize = 64;
/// Connections authenticating at once, at most, from one source address.
pub const MAX_PENDING_PER_SOURCE: usize = 16;
/// New connections taken per pass over the ones in progress.
const ACCEPT_BURST: usize = 8;
/// Refusals remembered (the oldest are dropped; the count goes on).
const LOG: usize = 64;

/// A connection the listener closed before it could become the link.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// Where it came from.
    pub peer: SocketAddr,
    /// Why it was closed (an [`AuthError`] inside [`LinkError::Auth`], a
    /// [`WireError`], [`LinkError::NotLoopback`], or a disconnect).
    pub error: LinkError,
}

/// The listener's record of refused connections.
#[derive(Debug, Default)]
pub(crate) struct Refusals {
    recent: Mutex<(VecDeque<Refusal>, u64)>,
}

impl Refusals {
    fn push(&self, peer: SocketAddr, error: LinkError) {
        let mut g = self.recent.lock();
        if g.0.len() == LOG {
            g.0.pop_front();
        }
        g.0.push_back(Refusal { peer, error });
        g.1 += 1;
    }
    pub(crate) fn recent(&self) -> Vec<Refusal> {
        self.recent.lock().0.iter().cloned().collect()
    }
    pub(crate) fn total(&self) -> u64 {
        self.recent.lock().1
    }
}

/// A connection that proved itself: its stream (blocking again) and, on an
/// authenticated link, its session (the peer's hello already opened).
pub(crate) struct Accepted {
    pub(crate) stream: TcpStream,
    pub(crate) session: Option<Session>,
}

enum Stage {
    /// Authenticated: the header of the peer's first handshake message.
    Msg1Header(Handshake),
    Msg1Body(Handshake),
    /// The peer's hello frame: header, then payload (and tag).
    HelloHeader(Option<Session>),
    HelloBody(Option<Session>, [u8; HEADER_LEN]),
    /// Proved itself while being admitted: handed out on the next pass.
    Proven(Option<Session>),
    Done,
}

/// A connection still proving itself.
pub(crate) struct Pending {
    stream: TcpStream,
    peer: SocketAddr,
    since: Instant,
    buf: Vec<u8>,
    got: usize,
    stage: Stage,
}

enum Progress {
    Waiting,
    Authenticated(Option<Session>),
}

impl Pending {
    fn new(
        stream: TcpStream,
        peer: SocketAddr,
        identity: Option<&std::sync::Arc<Identity>>,
    ) -> Result<Self, LinkError> {
        let (stage, need) = match identity {
            Some(k) => (Stage::Msg1Header(Handshake::responder(k)?), HS_HEADER_LEN),
            None => (Stage::HelloHeader(None), HEADER_LEN),
        };
        Ok(Pending {
            stream,
            peer,
            since: Instant::now(),
            buf: vec![0; need],
            got: 0,
            stage,
        })
    }

    /// True once the peer has begun its handshake: with an identity, its
    /// first message opened and named a trusted worker; without, its
    /// hello's header was valid.
    fn begun(&self) -> bool {
        matches!(
            self.stage,
            Stage::HelloHeader(Some(_)) | Stage::HelloBody(..) | Stage::Proven(_)
        )
    }

    /// Reads what has arrived, without handing the connection out: one
    /// that proves itself here is kept as proven for the accept loop.
    fn poke(&mut self) -> Result<(), LinkError> {
        if let Progress::Authenticated(session) = self.advance()? {
            self.stage = Stage::Proven(session);
        }
        Ok(())
    }

    /// Closes the connection unread, telling the peer to try again.
    fn turn_away(mut self) {
        let mut busy = [0u8; HS_HEADER_LEN];
        busy[..4].copy_from_slice(&BUSY_MAGIC);
        busy[4..6].copy_from_slice(&HS_VERSION.to_le_bytes());
        // Eight bytes into an empty socket buffer; if they do not fit, the
        // peer sees a plain close.
        let _ = self.stream.write(&busy);
    }

    fn expect(&mut self, need: usize) {
        self.buf.clear();
        self.buf.resize(need, 0);
        self.got = 0;
    }

    /// Reads what has arrived (never past the current piece) and moves on
    /// as pieces complete.
    fn advance(&mut self) -> Result<Progress, LinkError> {
        loop {
            while self.got < self.buf.len() {
                match self.stream.read(&mut self.buf[self.got..]) {
                    Ok(0) => return Err(LinkError::Disconnected),
                    Ok(n) => self.got += n,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(Progress::Waiting),
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => return Err(e.into()),
                }
            }
            match std::mem::replace(&mut self.stage, Stage::Done) {
                Stage::Msg1Header(hs) => {
                    let mut h = [0u8; HS_HEADER_LEN];
                    h.copy_from_slice(&self.buf);
                    let len = hs_header(&h)?;
                    self.expect(len);
                    self.stage = Stage::Msg1Body(hs);
                }
                Stage::Msg1Body(mut hs) => {
                    hs.read(&self.buf)?;
                    let reply = hs.write()?;
                    // 56 bytes into an empty socket buffer: never partial
                    // in practice; if it is, the connection is refused.
                    self.stream.write_all(&reply)?;
                    self.expect(HEADER_LEN);
                    self.stage = Stage::HelloHeader(Some(hs.split()?));
                }
                Stage::HelloHeader(session) => {
                    let mut h = [0u8; HEADER_LEN];
                    h.copy_from_slice(&self.buf);
                    let magic = [h[0], h[1], h[2], h[3]];
                    if session.is_none() && magic == HS_MAGIC {
                        return Err(AuthError::PeerAuthenticated.into());
                    }
                    if session.is_some() && magic != MAGIC {
                        return Err(AuthError::NotConfirmed.into());
                    }
                    let (flags, max) = match session {
                        Some(_) => (FLAG_SEALED, 1 + TAG_LEN),
                        None => (0, 1),
                    };
                    let header = decode_header_flagged(&h, max, flags).map_err(|e| {
                        if session.is_some() {
                            AuthError::NotConfirmed.into()
                        } else {
                            LinkError::Wire(e)
                        }
                    })?;
                    if header.kind != Kind::Hello || header.seq != 0 {
                        return Err(WireError::Unexpected {
                            kind: header.kind.name(),
                            context: "before the hello",
                        }
                        .into());
                    }
                    self.expect(header.len as usize);
                    self.stage = Stage::HelloBody(session, h);
                }
                Stage::HelloBody(mut session, h) => {
                    if let Some(s) = session.as_mut() {
                        s.opener
                            .open(&h, &mut self.buf)
                            .map_err(|_| AuthError::NotConfirmed)?;
                    }
                    match frame::decode_payload(Kind::Hello, &self.buf)? {
                        Frame::Hello(Role::Prefill) => {}
                        _ => {
                            return Err(WireError::Unexpected {
                                kind: "hello",
                                context: "from a peer of the same role",
                            }
                            .into());
                        }
                    }
                    return Ok(Progress::Authenticated(session));
                }
                Stage::Proven(session) => return Ok(Progress::Authenticated(session)),
                Stage::Done => return Err(LinkError::Disconnected),
            }
        }
    }
}

/// Accepts connections on `listener` (non-blocking) until one proves
/// itself, or `limit` (if any) passes. `pending` holds the connections
/// still proving themselves, and keeps them across calls: a handshake that
/// spans the end of one bounded wait finishes in the next.
pub(crate) fn accept_loop(
    listener: &TcpListener,
    cfg: &TransferConfig,
    limit: Option<Duration>,
    pending: &mut VecDeque<Pending>,
    refusals: &Refusals,
) -> Result<Accepted, LinkError> {
    let key = cfg.identity();
    let start = Instant::now();
    let give_up = limit.map(|l| deadline(start, l));
    loop {
        let mut busy = false;
        for _ in 0..ACCEPT_BURST {
            match listener.accept() {
                Ok((stream, peer)) => {
                    busy = true;
                    if key.is_none() && !peer.ip().is_loopback() {
                        refusals.push(
                            peer,
                            LinkError::NotLoopback {
                                addr: peer.to_string(),
                            },
                        );
                        continue;
                    }
                    let started = stream
                        .set_nonblocking(true)
                        .map_err(LinkError::from)
                        .and_then(|()| Pending::new(stream, peer, key));
                    match started {
                        Ok(p) => admit(pending, p, refusals),
                        Err(e) => refusals.push(peer, e),
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::Interrupted
                            | ErrorKind::ConnectionAborted
                            | ErrorKind::ConnectionReset
                    ) => {}
                // Out of file descriptors (EMFILE, ENFILE): the connections
                // in progress end at their deadlines and free some; the
                // queue waits in the kernel meanwhile.
                Err(e) if matches!(e.raw_os_error(), Some(23 | 24)) => break,
                Err(e) => return Err(e.into()),
            }
        }
        let now = Instant::now();
        let mut i = 0;
        while i < pending.len() {
            let Some(p) = pending.get_mut(i) else { break };
            match p.advance() {
                Ok(Progress::Waiting) if now < deadline(p.since, cfg.auth_timeout()) => i += 1,
                Ok(Progress::Waiting) => {
                    let waited_ms = now.duration_since(p.since).as_millis();
                    refusals.push(p.peer, AuthError::Deadline { waited_ms }.into());
                    pending.remove(i);
                }
                Ok(Progress::Authenticated(session)) => {
                    let Some(p) = pending.remove(i) else { break };
                    p.stream.set_nonblocking(false)?;
                    return Ok(Accepted {
                        stream: p.stream,
                        session,
                    });
                }
                Err(e) => {
                    busy = true;
                    refusals.push(p.peer, e);
                    pending.remove(i);
                }
            }
        }
        if give_up.is_some_and(|g| Instant::now() >= g) {
            return Err(LinkError::AcceptTimeout {
                waited_ms: start.elapsed().as_millis(),
            });
        }
        if !busy {
            let nap = if pending.is_empty() { 5 } else { 1 };
            std::thread::sleep(Duration::from_millis(nap));
        }
    }
}

/// Adds `p` to the connections in progress within the budgets: past its
/// source's budget, or the total, the oldest connection that has not begun
/// its handshake (of `p`'s source, or of the busiest source) makes room,
/// after a last read of what it sent; when none can, `p` is turned away.
/// A connection that has begun its handshake is never displaced.
fn admit(pending: &mut VecDeque<Pending>, mut p: Pending, refusals: &Refusals) {
    // What the newcomer already sent (the real peer's first message is
    // usually there by now).
    if let Err(e) = p.poke() {
        return refusals.push(p.peer, e);
    }
    loop {
        let source = p.peer.ip();
        let from_source = pending.iter().filter(|q| q.peer.ip() == source).count();
        let over = if from_source >= MAX_PENDING_PER_SOURCE {
            Some(source)
        } else if pending.len() >= MAX_PENDING {
            busiest(pending)
        } else {
            None
        };
        let Some(victims) = over else {
            pending.push_back(p);
            return;
        };
        let evicted = || -> LinkError {
            AuthError::Evicted {
                pending: MAX_PENDING_PER_SOURCE,
            }
            .into()
        };
        let Some(at) = pending
            .iter()
            .position(|q| q.peer.ip() == victims && !q.begun())
        else {
            refusals.push(p.peer, evicted());
            return p.turn_away();
        };
        let Some(mut old) = pending.remove(at) else {
            return p.turn_away();
        };
        // One last read: a handshake that began meanwhile keeps its place.
        match old.poke() {
            Ok(()) if old.begun() => pending.insert(at, old),
            Ok(()) => {
                refusals.push(old.peer, evicted());
                old.turn_away();
            }
            Err(e) => refusals.push(old.peer, e),
        }
    }
}

/// The source with the most connections in progress.
fn busiest(pending: &VecDeque<Pending>) -> Option<std::net::IpAddr> {
    let mut counts: Vec<(std::net::IpAddr, usize)> = Vec::new();
    for q in pending {
        match counts.iter_mut().find(|(ip, _)| *ip == q.peer.ip()) {
            Some((_, n)) => *n += 1,
            None => counts.push((q.peer.ip(), 1)),
        }
    }
    counts.into_iter().max_by_key(|&(_, n)| n).map(|(ip, _)| ip)
}
