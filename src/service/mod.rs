//! A serving thread for hosts whose clients arrive on many threads.
//!
//! [`Engine`](crate::Engine) and [`DecodeWorker`](crate::DecodeWorker)
//! are stepped by their owner through `&mut self`. A server whose
//! connections live on many threads would otherwise write the same loop
//! around them: a command channel, a reply per submission, a step when
//! something is live, a blocking wait when nothing is. [`Service::spawn`]
//! is that loop, on its own thread, and [`Submitter`] (cheap to clone, `Send`
//! and `Sync`) submits to it from anywhere:
//!
//! - [`Submitter::submit`] answers as the server's own `submit` does: a
//!   [`RequestHandle`] or a typed [`Rejection`] (nothing allocated). The
//!   thread takes submissions between steps, so the answer comes within one
//!   step. [`Submitter::submit_async`] never blocks: it queues the request
//!   and returns an [`Answer`] to await (or to [`Answer::wait`] for), so an
//!   async host admits without a blocking thread.
//! - Idle, the thread sleeps on its channel: no spinning. An engine's
//!   thread polls nothing; a decode worker's reads its link every 50 ms
//!   (late receipts are taken and counted rather than left to fill the
//!   link's buffers).
//! - [`Service::shutdown`] stops taking requests (later submissions get
//!   [`Rejection::ShuttingDown`], 503), lets live ones run for a grace
//!   period, ends the rest as the server's `shutdown` does, and hands the
//!   server back (its pool, its counters). Dropping the service does the
//!   same with no grace.
//!
//! ```
//! use handoff::model::{Model, ModelConfig, random_weights};
//! use handoff::service::Service;
//! use handoff::{Engine, EngineConfig, KvDtype, Outcome, Request, RequestId, Role, TenantId};
//! use std::time::Duration;
//!
//! let model_cfg = ModelConfig::tiny_gqa();
//! let cfg = EngineConfig::colocated(model_cfg.kv_geometry(KvDtype::F32))
//!     .max_context(64).pool_tokens(128).build()?;
//! let engine = Engine::new(Model::cpu(random_weights(&model_cfg, 1))?, cfg)?;
//! let service = Service::spawn(engine)?;
//!
//! // Any thread: submit and read the stream.
//! let submitter = service.submitter();
//! let client = std::thread::spawn(move || {
//!     let handle = submitter.submit(Request::new(RequestId(1), TenantId(3), vec![1, 2, 3], 5))?;
//!     Ok::<_, handoff::Rejection>(handle.wait())
//! });
//! let (tokens, outcome) = client.join().unwrap()?;
//! assert_eq!(tokens.len(), 5);
//! assert!(matches!(outcome, Outcome::Finished(_)));
//!
//! let engine = service.shutdown(Duration::from_secs(1))?;
//! assert!(engine.pool_stats().is_full());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod answer;
mod error;
mod serve;

use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use std::sync::Arc;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use parking_lot::Mutex;

pub use answer::Answer;
pub use error::ServiceError;
pub use serve::Serve;

use crate::engine::{RequestHandle, Tally};
use crate::kv::{KvPool, PoolStats};
use crate::request::Request;
use crate::sched::Rejection;

/// How long one step may wait on a peer before the thread takes
/// submissions again (a decode worker with nothing generating).
const STEP_WAIT: Duration = Duration::from_millis(5);
/// How often an idle decode worker reads its link.
const IDLE_POLL: Duration = Duration::from_millis(50);

enum Command {
    Submit(Request, answer::Replier),
    Shutdown { grace: Duration },
}

/// Submits requests to a [`Service`] from any thread. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Submitter {
    tx: Sender<Command>,
    stats: Arc<Mutex<ServiceStats>>,
}

/// What the service thread last reported of its server, after its latest
/// step or submission: for metrics, read without stopping the thread.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceStats {
    /// The server's counters (preemptions, prefilled and reused tokens,
    /// outcomes).
    pub tally: Tally,
    /// Requests admitted and waiting for pages.
    pub waiting: usize,
}

impl Submitter {
    /// Admits `req` or rejects it with the server's typed [`Rejection`],
    /// allocating nothing. Blocks until the service thread takes it: within
    /// one step. Once the service is shutting down or gone, every request is
    /// turned away with [`Rejection::ShuttingDown`] (503: retry elsewhere).
    pub fn submit(&self, req: Request) -> Result<RequestHandle, Rejection> {
        self.submit_async(req).wait()
    }

    /// Queues `req` for the service thread and returns at once (the queue
    /// is unbounded: the engine's own admission limits answer with a
    /// [`Rejection`]). Await the [`Answer`] in a task, or block on
    /// [`Answer::wait`]: the same answer [`Submitter::submit`] gives, within
    /// one step. Dropping the answer unread cancels an admitted request.
    pub fn submit_async(&self, req: Request) -> Answer {
        let (reply, answer) = answer::answer(req.id);
        // A thread that stopped drops the command, and the replier in it:
        // the answer is then ShuttingDown. The thread answers every
        // submission it takes; one it never takes (it stopped first) drops
        // its replier too.
        let _ = self.tx.send(Command::Submit(req, reply));
        answer
    }

    /// The server's counters and queue length as of its latest step.
    pub fn stats(&self) -> ServiceStats {
        *self.stats.lock()
    }
}

/// A server ([`Engine`](crate::Engine) or
/// [`DecodeWorker`](crate::DecodeWorker)) stepped by a thread of
/// its own. See the [module documentation](self).
#[must_use = "dropping the service shuts it down at once, ending its live requests"]
#[derive(Debug)]
pub struct Service<S: Serve> {
    submitter: Submitter,
    pool: KvPool,
    thread: Option<JoinHandle<S>>,
}

impl<S: Serve> Service<S> {
    /// Moves `server` to a new thread that serves submissions until
    /// [`Service::shutdown`].
    pub fn spawn(server: S) -> Result<Self, ServiceError> {
        let (tx, rx) = crossbeam_channel::unbounded();
        let pool = server.pool().clone();
        let stats = Arc::new(Mutex::new(ServiceStats::of(&server)));
        let shared = stats.clone();
        let thread = std::thread::Builder::new()
            .name("handoff-service".into())
            .spawn(move || serve(server, rx, &shared))?;
        Ok(Service {
            submitter: Submitter { tx, stats },
            pool,
            thread: Some(thread),
        })
    }

    /// A submitter to hand to other threads.
    pub fn submitter(&self) -> Submitter {
        self.submitter.clone()
    }

    /// [`Submitter::submit`] on this service.
    pub fn submit(&self, req: Request) -> Result<RequestHandle, Rejection> {
        self.submitter.submit(req)
    }

    /// The server's pool accounting, read without stopping the thread.
    pub fn pool_stats(&self) -> PoolStats {
        self.pool.stats()
    }

    /// [`Submitter::stats`] on this service.
    pub fn stats(&self) -> ServiceStats {
        self.submitter.stats()
    }

    /// Stops taking requests (later ones get [`Rejection::ShuttingDown`]),
    /// serves the live ones for up to `grace`, then ends the rest as the
    /// server's own `shutdown` does and returns the server.
    /// `Duration::ZERO` ends them at once.
    pub fn shutdown(mut self, grace: Duration) -> Result<S, ServiceError> {
        self.stop(grace)
    }

    fn stop(&mut self, grace: Duration) -> Result<S, ServiceError> {
        let Some(thread) = self.thread.take() else {
            return Err(ServiceError::Panicked(
                "the service was already stopped".into(),
            ));
        };
        // A thread that already ended (it panicked) no longer reads: the
        // join below tells.
        let _ = self.submitter.tx.send(Command::Shutdown { grace });
        thread.join().map_err(|p| {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".into());
            ServiceError::Panicked(msg)
        })
    }
}

impl<S: Serve> Drop for Service<S> {
    fn drop(&mut self) {
        if self.thread.is_some() {
            let _ = self.stop(Duration::ZERO);
        }
    }
}

/// The service thread's state: its server, and whether it still takes
/// requests.
struct Turn<S> {
    server: S,
    /// `Some` once shutting down: until when live requests may run
    /// (`None` inside: a grace too long for the clock, no deadline).
    draining: Option<Option<Instant>>,
}

impl<S: Serve> Turn<S> {
    fn take(&mut self, cmd: Command) {
        match cmd {
            Command::Submit(req, reply) => {
                let answer = if self.draining.is_some() {
                    Err(Rejection::ShuttingDown { id: req.id })
                } else {
                    self.server.submit(req)
                };
                // A submitter that stopped waiting drops the handle, which
                // cancels the request.
                reply.send(answer);
            }
            Command::Shutdown { grace } => {
                self.draining = Some(Instant::now().checked_add(grace));
            }
        }
    }

    fn done(&self) -> bool {
        match self.draining {
            None => false,
            Some(until) => self.server.is_idle() || until.is_some_and(|u| Instant::now() >= u),
        }
    }
}

impl ServiceStats {
    fn of<S: Serve>(server: &S) -> Self {
        ServiceStats {
            tally: server.tally(),
            waiting: server.waiting(),
        }
    }
}

/// Publishes `server`'s counters for [`Submitter::stats`].
fn publish<S: Serve>(stats: &Mutex<ServiceStats>, server: &S) {
    *stats.lock() = ServiceStats::of(server);
}

/// The service thread: takes commands between steps, steps while anything
/// is live, sleeps on the channel when nothing is.
fn serve<S: Serve>(server: S, rx: Receiver<Command>, stats: &Mutex<ServiceStats>) -> S {
    let mut t = Turn {
        server,
        draining: None,
    };
    while !t.done() {
        publish(stats, &t.server);
        if t.server.is_idle() {
            // Nothing to step: sleep until a command comes.
            let cmd = if t.server.polls_when_idle() {
                rx.recv_timeout(IDLE_POLL)
            } else {
                rx.recv().map_err(|_| RecvTimeoutError::Disconnected)
            };
            match cmd {
                Ok(c) => t.take(c),
                Err(RecvTimeoutError::Timeout) => {
                    t.server.step(Duration::ZERO);
                }
                // The service is gone without a shutdown (it cannot be:
                // its drop sends one); end as if it had sent one.
                Err(RecvTimeoutError::Disconnected) => break,
            }
            continue;
        }
        // Take what has arrived, then step once.
        loop {
            match rx.try_recv() {
                Ok(c) => t.take(c),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    t.draining.get_or_insert(None);
                    break;
                }
            }
        }
        if t.done() {
            break;
        }
        if !t.server.step(STEP_WAIT) {
            // Live but unable to progress (admission makes this a bug):
            // wait for a command rather than spin.
            if let Ok(c) = rx.recv_timeout(STEP_WAIT) {
                t.take(c);
            }
        }
    }
    let mut server = t.server;
    server.shutdown();
    publish(stats, &server);
    // Turn away what arrived after the last turn; senders that come later
    // find the channel closed when this thread's receiver drops.
    while let Ok(cmd) = rx.try_recv() {
        if let Command::Submit(req, reply) = cmd {
            reply.send(Err(Rejection::ShuttingDown { id: req.id }));
        }
    }
    server
}
