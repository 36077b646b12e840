//! Synthetic peers: ends of a link that follow the protocol faithfully up
//! to one point and then misbehave in one precise way, for the stories
//! that need exactly that peer.

use std::io::Read;
use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::transfer::error::LinkError;
use crate::transfer::link::auth::{HS_HEADER_LEN, Handshake, hs_header};
use crate::transfer::link::identity::Identity;
use crate::transfer::link::tcp::frame::{self, FLAG_SEALED, Frame, HEADER_LEN, Kind, Role};

/// A decode end with a worker identity that completes the
/// handshake with every prefill end that connects (key exchange and the
/// prefill end's sealed hello, opened), and then never accepts: it keeps
/// the connection open and sends nothing, until dropped. What a decode
/// worker whose link is already taken, or whose owner stopped accepting,
/// looks like from the prefill end.
pub struct NeverAccepts {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    handshakes: Arc<AtomicUsize>,
    thread: Option<JoinHandle<()>>,
}

impl NeverAccepts {
    /// Listens on a loopback port as the worker `identity`.
    pub fn start(identity: &Arc<Identity>) -> Result<Self, LinkError> {
        let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let handshakes = Arc::new(AtomicUsize::new(0));
        let thread = {
            let (stop, handshakes, key) = (stop.clone(), handshakes.clone(), identity.clone());
            std::thread::Builder::new()
                .name("handoff-never-accepts".into())
                .spawn(move || {
                    let mut held = Vec::new();
                    while !stop.load(Ordering::Relaxed) {
                        match listener.accept() {
                            Ok((s, _)) => {
                                if handshake(&s, &key).is_ok() {
                                    handshakes.fetch_add(1, Ordering::Relaxed);
                                    held.push(s);
                                }
                            }
                            Err(_) => std::thread::sleep(Duration::from_millis(2)),
                        }
                    }
                })?
        };
        Ok(NeverAccepts {
            addr,
            stop,
            handshakes,
            thread: Some(thread),
        })
    }

    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections whose handshake it completed (and never accepted).
    pub fn handshakes(&self) -> usize {
        self.handshakes.load(Ordering::Relaxed)
    }
}

impl Drop for NeverAccepts {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The decode end's half of the handshake on `s`, up to and including the
/// prefill end's sealed hello.
fn handshake(s: &TcpStream, key: &Arc<Identity>) -> Result<(), LinkError> {
    let mut s = s;
    s.set_nonblocking(false)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut hs = Handshake::responder(key)?;
    let mut h = [0u8; HS_HEADER_LEN];
    s.read_exact(&mut h)?;
    let mut body = vec![0u8; hs_header(&h)?];
    s.read_exact(&mut body)?;
    hs.read(&body)?;
    s.write_all(&hs.write()?)?;
    let mut session = hs.split()?;
    let mut h = [0u8; HEADER_LEN];
    s.read_exact(&mut h)?;
    let header = frame::decode_header_flagged(&h, 1 << 10, FLAG_SEALED)?;
    let mut sealed = vec![0u8; header.len as usize];
    s.read_exact(&mut sealed)?;
    session.opener.open(&h, &mut sealed)?;
    match frame::decode_payload(Kind::Hello, &sealed)? {
        Frame::Hello(Role::Prefill) => Ok(()),
        _ => Err(LinkError::Disconnected),
    }
}
