//! The prefill end's dial: connect, run the handshake with a worker identity, and
//! dial again (backing off) while the decode end turns connections away as
//! busy, all within the handshake's deadline.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use crate::transfer::config::{TransferConfig, deadline};
use crate::transfer::error::LinkError;
use crate::transfer::link::auth::{AuthError, HS_HEADER_LEN, Handshake, Session, hs_header};
use crate::transfer::link::identity::{Identity, PeerId};

/// Connects to `addr` and, with an identity, runs the handshake with the
/// decode worker `peer` (which the caller must name then); returns the
/// connection, its session, and the handshake's deadline (which also bounds
/// the wait for the decode end's acceptance). A decode end that turns the
/// connection away unread ([`AuthError::Busy`]: full of strangers) is
/// dialled again, backing off, until that deadline.
pub(super) fn dial(
    addr: SocketAddr,
    peer: Option<&PeerId>,
    cfg: &TransferConfig,
) -> Result<(TcpStream, Option<Session>, Instant), LinkError> {
    let limit = cfg.auth_timeout();
    let until = deadline(Instant::now(), limit);
    let Some(identity) = cfg.identity() else {
        let stream = TcpStream::connect_timeout(&addr, cfg.plan_timeout())?;
        return Ok((stream, None, until));
    };
    let Some(peer) = peer else {
        return Err(LinkError::Config {
            what: "an authenticated link names the decode worker it dials: use \
                   TcpPrefill::connect_to(addr, decode_id, cfg)",
        });
    };
    let mut backoff = Duration::from_millis(1);
    loop {
        let stream = TcpStream::connect_timeout(&addr, cfg.plan_timeout())?;
        match initiate(&stream, identity, peer, until, limit) {
            Err(LinkError::Auth(AuthError::Busy)) if Instant::now() + backoff < until => {
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_millis(50));
            }
            r => return r.map(|session| (stream, Some(session), until)),
        }
    }
}

/// The prefill end's handshake on a fresh connection: sends its message,
/// checks decode's answer (proof that decode holds `peer`'s secret key) by `until`, and
/// returns the session. The peer then gets this end's sealed hello as its
/// proof.
fn initiate(
    stream: &TcpStream,
    identity: &std::sync::Arc<Identity>,
    peer: &PeerId,
    until: Instant,
    limit: Duration,
) -> Result<Session, LinkError> {
    let mut s = stream;
    let mut hs = Handshake::initiator(identity, peer)?;
    stream.set_write_timeout(Some(limit))?;
    s.write_all(&hs.write()?)?;
    let mut h = [0u8; HS_HEADER_LEN];
    read_until(stream, &mut h, until, limit)?;
    let len = hs_header(&h)?;
    let mut body = vec![0u8; len];
    read_until(stream, &mut body, until, limit)?;
    hs.read(&body)?;
    Ok(hs.split()?)
}

/// Fills `buf` from `stream` by `until`; the peer closing first is
/// [`AuthError::Closed`], the deadline [`AuthError::Deadline`].
pub(super) fn read_until(
    stream: &TcpStream,
    buf: &mut [u8],
    until: Instant,
    limit: Duration,
) -> Result<(), LinkError> {
    use std::io::ErrorKind::{Interrupted, TimedOut, WouldBlock};
    let mut s = stream;
    let mut got = 0;
    while got < buf.len() {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(AuthError::Deadline {
                waited_ms: limit.as_millis(),
            }
            .into());
        }
        stream.set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(AuthError::Closed.into()),
            Ok(n) => got += n,
            Err(e) if matches!(e.kind(), WouldBlock | TimedOut | Interrupted) => {}
            Err(e) => match LinkError::from(e) {
                LinkError::Disconnected => return Err(AuthError::Closed.into()),
                other => return Err(other),
            },
        }
    }
    Ok(())
}
