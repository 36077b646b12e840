//! TCP transport on loopback: length-prefixed binary frames (see
//! [`frame`]), one connection per worker pair, a reader thread per end.
//!
//! Any frame that cannot be accepted (bad magic or version, unknown kind,
//! oversized, malformed, out of sequence, or not valid for its direction)
//! ends the connection at once with a typed [`WireError`]; the offending
//! frame is never applied. The TCP transport has no authentication or
//! encryption, so it only binds and connects to loopback addresses.

pub mod frame;

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use parking_lot::Mutex;

use crate::kv::{Held, KvSeq};
use crate::transfer::config::TransferConfig;
use crate::transfer::credits::{Credits, InFlightStats};
use crate::transfer::error::{LinkError, WireError};
use crate::transfer::gate::{Gate, Step, WriteMsg, receiver_delay};
use crate::transfer::landing::LandingZone;
use crate::transfer::link::{DecodeLink, PrefillLink, Transfer};
use crate::transfer::protocol::{ToDecode, ToPrefill, WriteBatch};
use frame::{Frame, HEADER_LEN, Kind, Role};

/// TCP on 127.0.0.1. As a [`Transfer`], connects both ends in this process
/// (threads); for two processes use [`TcpDecodeListener`] and
/// [`TcpPrefill::connect`].
#[derive(Clone, Copy, Debug, Default)]
pub struct Tcp;

impl Transfer for Tcp {
    type Prefill = TcpPrefill;
    type Decode = TcpDecode;

    fn name(&self) -> &'static str {
        "tcp"
    }

    fn connect(&self, cfg: &TransferConfig) -> Result<(TcpPrefill, TcpDecode), LinkError> {
        let listener = TcpDecodeListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))?;
        let addr = listener.local_addr()?;
        let dcfg = cfg.clone();
        let accept = std::thread::spawn(move || listener.accept(&dcfg));
        let prefill = TcpPrefill::connect(addr, cfg);
        let decode = accept.join().map_err(|_| LinkError::Disconnected)?;
        Ok((prefill?, decode?))
    }
}

fn check_loopback(addr: SocketAddr) -> Result<(), LinkError> {
    if addr.ip().is_loopback() {
        Ok(())
    } else {
        Err(LinkError::NotLoopback {
            addr: addr.to_string(),
        })
    }
}

/// Frames out, numbered.
struct FrameWriter {
    stream: TcpStream,
    seq: u32,
    buf: Vec<u8>,
}

impl FrameWriter {
    fn new(stream: TcpStream) -> Self {
        FrameWriter {
            stream,
            seq: 0,
            buf: Vec::new(),
        }
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
        self.stream.write_all(&self.buf)?;
        Ok(())
    }
}

/// Fills `buf` from `stream`, whose read timeout is `stall`. Between frames
/// (`begun` false and nothing read yet) the link may idle for any time;
/// once a frame has begun, a pause of `stall` without a byte ends the link
/// with a typed error (the peer is stuck or gone), so a half-sent frame
/// cannot hold the link forever.
fn fill(
    stream: &mut TcpStream,
    stall: Duration,
    buf: &mut [u8],
    begun: bool,
) -> Result<(), LinkError> {
    use std::io::ErrorKind::{Interrupted, TimedOut, WouldBlock};
    let mut got = 0;
    while got < buf.len() {
        match stream.read(&mut buf[got..]) {
            Ok(0) => return Err(LinkError::Disconnected),
            Ok(n) => got += n,
            Err(e) if matches!(e.kind(), WouldBlock | TimedOut) => {
                if begun || got > 0 {
                    return Err(WireError::Stalled {
                        waited_ms: stall.as_millis(),
                    }
                    .into());
                }
            }
            Err(e) if e.kind() == Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Frames in, checked for sequence and direction.
struct FrameReader {
    /// Reads time out after `stall` (the socket's read timeout; see [`fill`]).
    stream: TcpStream,
    /// How long a frame, once begun, may wait for its next byte: the peer's
    /// own write timeout (it would have given up by then).
    stall: Duration,
    expect: u32,
    max: usize,
    buf: Vec<u8>,
    hello: bool,
    peer: Role,
}

impl FrameReader {
    /// The next frame's header and payload (in `self.buf`).
    fn next(&mut self) -> Result<frame::Header, LinkError> {
        let mut h = [0u8; HEADER_LEN];
        fill(&mut self.stream, self.stall, &mut h, false)?;
        let header = frame::decode_header(&h, self.max)?;
        if header.seq != self.expect {
            return Err(WireError::OutOfOrder {
                expected: self.expect,
                got: header.seq,
            }
            .into());
        }
        self.expect = self.expect.wrapping_add(1);
        self.buf.resize(header.len as usize, 0);
        fill(&mut self.stream, self.stall, &mut self.buf, true)?;
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
    // See `FrameReader::fill`: only a frame already begun may not stall.
    stream.set_read_timeout(Some(cfg.write_timeout()))?;
    Ok((stream.try_clone()?, stream.try_clone()?))
}

/// A listening decode end (binds loopback only).
pub struct TcpDecodeListener {
    listener: TcpListener,
}

impl TcpDecodeListener {
    /// Binds `addr`, which must be a loopback address.
    pub fn bind(addr: SocketAddr) -> Result<Self, LinkError> {
        check_loopback(addr)?;
        Ok(TcpDecodeListener {
            listener: TcpListener::bind(addr)?,
        })
    }
    /// The bound address (with the port the OS chose for port 0).
    pub fn local_addr(&self) -> Result<SocketAddr, LinkError> {
        Ok(self.listener.local_addr()?)
    }
    /// Accepts one prefill peer, waiting as long as it takes (a server's
    /// accept loop); see [`TcpDecodeListener::accept_within`] for a bound.
    pub fn accept(&self, cfg: &TransferConfig) -> Result<TcpDecode, LinkError> {
        cfg.validate()?;
        let (stream, peer) = self.listener.accept()?;
        check_loopback(peer)?;
        TcpDecode::start(stream, cfg)
    }

    /// Accepts one prefill peer, or fails with
    /// [`LinkError::AcceptTimeout`] once `limit` has passed without one
    /// (a prefill process that died before connecting).
    /// Takes `&mut self`: it switches the listening socket to non-blocking
    /// while it waits, which a concurrent accept must not see.
    pub fn accept_within(
        &mut self,
        cfg: &TransferConfig,
        limit: std::time::Duration,
    ) -> Result<TcpDecode, LinkError> {
        cfg.validate()?;
        let start = std::time::Instant::now();
        self.listener.set_nonblocking(true)?;
        let accepted = loop {
            match self.listener.accept() {
                Ok(conn) => break Ok(conn),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if start.elapsed() >= limit {
                        break Err(LinkError::AcceptTimeout {
                            waited_ms: start.elapsed().as_millis(),
                        });
                    }
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                Err(e) => break Err(e.into()),
            }
        };
        self.listener.set_nonblocking(false)?;
        let (stream, peer) = accepted?;
        // An accepted socket may inherit non-blocking mode on some systems.
        stream.set_nonblocking(false)?;
        check_loopback(peer)?;
        TcpDecode::start(stream, cfg)
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
}

impl TcpDecode {
    fn start(stream: TcpStream, cfg: &TransferConfig) -> Result<Self, LinkError> {
        let (w, r) = stream_pair(&stream, cfg)?;
        let writer = Arc::new(Mutex::new(FrameWriter::new(w)));
        writer.lock().send(&Frame::Hello(Role::Decode))?;
        let landing = Arc::new(LandingZone::new());
        let (tx, events) = crossbeam_channel::unbounded();
        let reader = FrameReader {
            stream: r,
            stall: cfg.write_timeout(),
            expect: 0,
            max: cfg.max_frame_bytes(),
            buf: Vec::new(),
            hello: false,
            peer: Role::Prefill,
        };
        let handle = {
            let (landing, writer) = (landing.clone(), writer.clone());
            let delay = receiver_delay(cfg);
            std::thread::Builder::new()
                .name("handoff-tcp-decode-reader".into())
                .spawn(move || {
                    let e = decode_reader(reader, &landing, &writer, &tx, delay);
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
        })
    }
}

/// Reads frames until the connection ends; returns why it ended.
fn decode_reader(
    mut rd: FrameReader,
    landing: &LandingZone,
    writer: &Mutex<FrameWriter>,
    events: &Sender<Result<ToDecode, LinkError>>,
    delay: Option<Duration>,
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
        match frame {
            Frame::Hello(_) => {}
            Frame::Write(batch, bytes) => {
                if let Some(d) = delay {
                    std::thread::sleep(d);
                }
                let half = bytes.len() / 2;
                let row = half.checked_div(batch.tokens as usize).unwrap_or(0);
                landing.apply(&batch, half, None, |kv, done, dst| {
                    let at = kv * half + done * row;
                    if let Some(src) = bytes.get(at..at + dst.len()) {
                        dst.copy_from_slice(src);
                    }
                });
                if let Err(e) = writer.lock().send(&Frame::Credit(bytes.len() as u64)) {
                    return e;
                }
            }
            Frame::ToDecode(m) => {
                if events.send(Ok(m)).is_err() {
                    return LinkError::Disconnected;
                }
            }
            Frame::ToPrefill(_) | Frame::Credit(_) => {
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
        match self.events.recv_timeout(timeout) {
            Ok(Ok(m)) => Ok(Some(m)),
            Ok(Err(e)) => Err(e),
            Err(RecvTimeoutError::Timeout) if !self.closed => Ok(None),
            Err(_) => Err(LinkError::Disconnected),
        }
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
}

impl TcpPrefill {
    /// Connects to a decode end at `addr` (a loopback address).
    pub fn connect(addr: SocketAddr, cfg: &TransferConfig) -> Result<Self, LinkError> {
        cfg.validate()?;
        check_loopback(addr)?;
        let stream = TcpStream::connect_timeout(&addr, cfg.plan_timeout())?;
        let (w, r) = stream_pair(&stream, cfg)?;
        let mut writer = FrameWriter::new(w);
        writer.send(&Frame::Hello(Role::Prefill))?;
        let credits = Arc::new(Credits::new(cfg.max_in_flight_bytes()));
        let (tx, incoming) = crossbeam_channel::unbounded();
        let reader = FrameReader {
            stream: r,
            stall: cfg.write_timeout(),
            expect: 0,
            max: cfg.max_frame_bytes(),
            buf: Vec::new(),
            hello: false,
            peer: Role::Decode,
        };
        let handle = {
            let credits = credits.clone();
            // A bad frame closes the connection at once, as at the decode
            // end: the peer sees it end, whatever this side does next.
            let closer = stream.try_clone()?;
            std::thread::Builder::new()
                .name("handoff-tcp-prefill-reader".into())
                .spawn(move || {
                    let e = prefill_reader(reader, &credits, &tx);
                    let _ = closer.shutdown(Shutdown::Both);
                    credits.close();
                    let _ = tx.send(Err(e));
                })?
        };
        Ok(TcpPrefill {
            stream,
            writer,
            incoming,
            credits,
            writes: Gate::new(cfg),
            control: Gate::new(cfg),
            cfg: cfg.clone(),
            reader: Some(handle),
            closed: false,
        })
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
        let fw = &mut self.writer;
        fw.buf.clear();
        let seq = fw.next_seq();
        frame::put_write_prefix(&mut fw.buf, seq, &b, kv_bytes);
        let base = fw.buf.len();
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
        fw.stream.write_all(&fw.buf)?;
        Ok(())
    }
}

/// Reads frames from decode until the connection ends; returns why.
fn prefill_reader(
    mut rd: FrameReader,
    credits: &Credits,
    out: &Sender<Result<ToPrefill, LinkError>>,
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
        match frame {
            Frame::Hello(_) => {}
            Frame::Credit(n) => credits.release(usize::try_from(n).unwrap_or(usize::MAX)),
            Frame::ToPrefill(m) => {
                if out.send(Ok(m)).is_err() {
                    return LinkError::Disconnected;
                }
            }
            Frame::Write(..) | Frame::ToDecode(_) => {
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
    fn recv(&mut self, timeout: Duration) -> Result<Option<ToPrefill>, LinkError> {
        match self.incoming.recv_timeout(timeout) {
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
