//! In-process transport: threads, crossbeam channels, one memory copy.
//!
//! A write batch travels as a reference to the held source sequence; the
//! decode end's lander thread copies its rows straight from the source pool
//! into the destination pages (one copy, like a one-sided RDMA write), in
//! order with receipts and aborts. The copy takes no lock on either pool's
//! bytes: the held source handle and the destination handle are the proof
//! of access (see `kv/storage.rs`).

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, select};

use crate::kv::{Held, KvSeq};
use crate::transfer::config::TransferConfig;
use crate::transfer::error::LinkError;
use crate::transfer::link::credits::{Credits, InFlightStats};
use crate::transfer::link::identity::PeerId;
use crate::transfer::link::landing::LandingZone;
use crate::transfer::link::{DecodeLink, PrefillLink, Transfer, recv_within};
use crate::transfer::protocol::{ToDecode, ToPrefill, WriteBatch};
use crate::transfer::testing::gate::{Gate, Step, WriteMsg, receiver_delay};

/// The in-process transport.
#[derive(Clone, Copy, Debug, Default)]
pub struct InProcess;

enum Item {
    Write(WriteMsg, Arc<KvSeq<Held>>),
    Control(ToDecode),
}

/// Prefill end of an in-process link.
pub struct InProcessPrefill {
    to_decode: Option<Sender<Item>>,
    from_decode: Receiver<ToPrefill>,
    credits: Arc<Credits>,
    writes: Gate<WriteMsg>,
    control: Gate<ToDecode>,
    cfg: TransferConfig,
    /// A label naming the decode end (nothing to authenticate in one
    /// process).
    peer: PeerId,
}

/// Decode end of an in-process link.
pub struct InProcessDecode {
    to_prefill: Option<Sender<ToPrefill>>,
    events: Receiver<Result<ToDecode, LinkError>>,
    landing: Arc<LandingZone>,
    gate: Gate<ToPrefill>,
    stop: Option<Sender<()>>,
    lander: Option<JoinHandle<()>>,
    /// A label naming the prefill end.
    peer: PeerId,
}

impl Transfer for InProcess {
    type Prefill = InProcessPrefill;
    type Decode = InProcessDecode;

    fn name(&self) -> &'static str {
        "in-process"
    }

    fn connect(
        &self,
        cfg: &TransferConfig,
    ) -> Result<(InProcessPrefill, InProcessDecode), LinkError> {
        cfg.validate()?;
        // Labels naming the two ends (a worker's own id when it has one,
        // so plans addressed to it pass its check).
        let prefill_label = match cfg.peer_id() {
            Some(id) => id,
            None => PeerId::random_label()?,
        };
        let decode_label = PeerId::random_label()?;
        let (item_tx, item_rx) = crossbeam_channel::unbounded();
        let (ctl_tx, ctl_rx) = crossbeam_channel::unbounded();
        let (ev_tx, ev_rx) = crossbeam_channel::unbounded();
        let (stop_tx, stop_rx) = crossbeam_channel::bounded(0);
        let credits = Arc::new(Credits::new(cfg.max_in_flight_bytes()));
        let landing = Arc::new(LandingZone::new());
        let lander = {
            let landing = landing.clone();
            let credits = credits.clone();
            let delay = receiver_delay(cfg);
            std::thread::Builder::new()
                .name("handoff-inproc-lander".into())
                .spawn(move || lander(item_rx, stop_rx, ev_tx, &landing, &credits, delay))
                .map_err(LinkError::from)?
        };
        Ok((
            InProcessPrefill {
                to_decode: Some(item_tx),
                from_decode: ctl_rx,
                credits,
                writes: Gate::new(cfg),
                control: Gate::new(cfg),
                cfg: cfg.clone(),
                peer: decode_label,
            },
            InProcessDecode {
                to_prefill: Some(ctl_tx),
                events: ev_rx,
                landing,
                gate: Gate::new(cfg),
                stop: Some(stop_tx),
                lander: Some(lander),
                peer: prefill_label,
            },
        ))
    }
}

/// The decode end's thread: lands writes, forwards control messages in
/// order, gives credit back.
fn lander(
    items: Receiver<Item>,
    stop: Receiver<()>,
    events: Sender<Result<ToDecode, LinkError>>,
    landing: &LandingZone,
    credits: &Credits,
    delay: Option<Duration>,
) {
    loop {
        let item = select! {
            recv(items) -> m => m,
            recv(stop) -> _ => break,
        };
        match item {
            Ok(Item::Write(w, src)) => {
                if let Some(d) = delay {
                    std::thread::sleep(d);
                }
                let bytes = land(landing, &w, &src);
                credits.release(bytes * 2);
            }
            Ok(Item::Control(m)) => {
                if events.send(Ok(m)).is_err() {
                    break;
                }
            }
            Err(_) => {
                let _ = events.send(Err(LinkError::Disconnected));
                break;
            }
        }
    }
    credits.close();
}

/// Lands one write from `src`, copying straight from its pages into the
/// destination's; returns the bytes per K (or V) it carried.
fn land(landing: &LandingZone, w: &WriteMsg, src: &KvSeq<Held>) -> usize {
    let g = src.pool().config().geometry();
    let row = g.kv_dim() * g.dtype.size_bytes();
    let b = w.batch;
    // One bit flipped in the first K run when the fault plan says so.
    let mut flip = |kv: usize, done: usize, dst: &mut [u8]| {
        if kv == 0
            && done == 0
            && let Some(x) = dst.first_mut()
        {
            *x ^= 1;
        }
    };
    let tamper: Option<crate::kv::Tamper<'_>> = if w.corrupt { Some(&mut flip) } else { None };
    landing.apply_from(&b, src, tamper);
    b.tokens as usize * row
}

impl InProcessPrefill {
    fn item(&self, item: Item) -> Result<(), LinkError> {
        match &self.to_decode {
            Some(tx) => tx.send(item).map_err(|_| LinkError::Disconnected),
            None => Err(LinkError::Disconnected),
        }
    }
}

impl PrefillLink for InProcessPrefill {
    fn recv(&mut self, timeout: Duration) -> Result<Option<ToPrefill>, LinkError> {
        if self.to_decode.is_none() {
            return Err(LinkError::Disconnected);
        }
        match recv_within(&self.from_decode, timeout) {
            Ok(m) => Ok(Some(m)),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err(LinkError::Disconnected),
        }
    }

    fn write_kv(&mut self, batch: WriteBatch, src: &Arc<KvSeq<Held>>) -> Result<(), LinkError> {
        let g = src.pool().config().geometry();
        let row = g.kv_dim() * g.dtype.size_bytes();
        let emit = self.writes.pass(
            Step::KvWriting,
            WriteMsg {
                batch,
                corrupt: false,
            },
        );
        for w in emit.msgs {
            let bytes = 2 * w.batch.tokens as usize * row;
            self.credits.acquire(bytes, self.cfg.write_timeout())?;
            if let Err(e) = self.item(Item::Write(w, src.clone())) {
                self.credits.release(bytes);
                return Err(e);
            }
        }
        if emit.disconnect {
            self.close();
            return Err(LinkError::Disconnected);
        }
        Ok(())
    }

    fn send(&mut self, msg: ToDecode) -> Result<(), LinkError> {
        let emit = self.control.pass(Step::ReceiptSent, msg);
        for m in emit.msgs {
            self.item(Item::Control(m))?;
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

    fn peer(&self) -> Option<PeerId> {
        Some(self.peer)
    }

    fn close(&mut self) {
        self.to_decode = None;
        self.credits.close();
    }
}

impl DecodeLink for InProcessDecode {
    fn landing(&self) -> &Arc<LandingZone> {
        &self.landing
    }

    fn peer(&self) -> Option<PeerId> {
        Some(self.peer)
    }

    fn send(&mut self, msg: ToPrefill) -> Result<(), LinkError> {
        let step = match msg {
            ToPrefill::Plan(_) => Step::PlanSent,
            ToPrefill::Answer(_) => Step::AckSent,
        };
        let emit = self.gate.pass(step, msg);
        for m in emit.msgs {
            match &self.to_prefill {
                Some(tx) => tx.send(m).map_err(|_| LinkError::Disconnected)?,
                None => return Err(LinkError::Disconnected),
            }
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
            Err(RecvTimeoutError::Timeout) => {
                if self.to_prefill.is_none() {
                    Err(LinkError::Disconnected)
                } else {
                    Ok(None)
                }
            }
            Err(RecvTimeoutError::Disconnected) => Err(LinkError::Disconnected),
        }
    }

    fn arrived(&self) -> usize {
        self.events.len()
    }

    fn close(&mut self) {
        self.to_prefill = None;
        self.stop = None;
        if let Some(h) = self.lander.take() {
            let _ = h.join();
        }
    }
}

impl Drop for InProcessDecode {
    fn drop(&mut self) {
        self.close();
    }
}

impl Drop for InProcessPrefill {
    fn drop(&mut self) {
        self.close();
    }
}
