//! CUDA graphs of a pass's launches ([`CudaDevice::set_graphs`]).
//!
//! A decode step launches the same kernels, with the same grids and the
//! same parameter bytes, step after step: only the data behind the
//! pointers changes (positions, page tables and slots are rewritten in
//! place, see `memo.rs`). With graphs on, the launches of a pass are
//! recorded instead of queued, and at a flush the recorded list is:
//! - launched as one graph when a graph was captured from an equal list
//!   (every kernel, grid, overlap flag and parameter byte equal, compared
//!   in full: the cache has no key that could collide);
//! - otherwise queued launch by launch, as with graphs off; a list already
//!   seen in a recent flush is then captured (capturing runs nothing) and
//!   kept for the next time.
//!
//! A replay is the same launches in the same order, so its results are the
//! eager path's bit for bit. What the recording changes is *when* kernels
//! are queued: at the flush, not at the call. So memory a recorded launch
//! uses stays allocated until the flush ([`CudaDevice::retire`]), and
//! anything else that touches device memory from the host (copies into
//! existing buffers, downloads, syncs, the raw stream) flushes first.
//!
//! Only the thread that opened the pass records; other threads' launches
//! are queued at once, as before. Each pass flushes before it returns, so
//! nothing recorded outlives the call that recorded it.

use std::any::Any;
use std::collections::VecDeque;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::ThreadId;

use cudarc::driver::{result, sys};
use parking_lot::Mutex;

use super::kernels::KernelId;
use super::memo::Moment;
use super::plan::Grid;

/// Graphs kept per device: a decode loop alternates between a few lists
/// (one per batch size and split count in use).
const MAX_GRAPHS: usize = 8;
/// Lists remembered (by hash) to decide what is worth capturing: a list is
/// captured the second time it is seen among the last `RECENT` flushes.
const RECENT: usize = 32;

/// One recorded launch.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) struct Op {
    pub(super) kernel: KernelId,
    pub(super) grid: Grid,
    /// Queued with programmatic stream serialization (see
    /// `CudaDevice::launch_with`).
    pub(super) overlap: bool,
    /// The params struct's bytes in 8-byte words (every params struct is
    /// aligned to at most 8), zero-padded; `len` of them are the struct.
    pub(super) params: Box<[u64]>,
    pub(super) len: usize,
}

impl Op {
    pub(super) fn new(kernel: KernelId, grid: Grid, overlap: bool, bytes: &[u8]) -> Self {
        let mut params = vec![0u64; bytes.len().div_ceil(8)].into_boxed_slice();
        bytemuck::cast_slice_mut::<u64, u8>(&mut params)[..bytes.len()].copy_from_slice(bytes);
        Op {
            kernel,
            grid,
            overlap,
            params,
            len: bytes.len(),
        }
    }

    /// The params struct, as `cuLaunchKernel` takes it (its address).
    pub(super) fn params_ptr(&self) -> *mut std::ffi::c_void {
        self.params.as_ptr() as *mut std::ffi::c_void
    }
}

/// The launches a pass has recorded since its last flush, and what they
/// use that the host dropped meanwhile.
struct Recording {
    thread: ThreadId,
    ops: Vec<Op>,
    /// Buffers dropped while a recorded launch may still use them: freed
    /// after the flush has queued those launches.
    graveyard: Vec<Box<dyn Any + Send>>,
}

/// What a flush queues ([`Recorder::take`]): the launches, and what must
/// stay allocated until they are queued.
pub(super) struct Flushed {
    pub(super) ops: Vec<Op>,
    pub(super) keep: Vec<Box<dyn Any + Send>>,
}

/// A device's recording state, with no CUDA in it: which thread's pass
/// records, what it recorded, what it keeps alive, and the flush count
/// the memos read (see `memo.rs`).
///
/// - One pass records at a time, on the thread that opened it; every other
///   thread's launches are queued at once.
/// - A value retired while a pass records is kept until that pass's next
///   flush, whichever thread retires it (a memo may be shared); retired
///   while nothing records, it is dropped at once.
/// - The flush count moves only once a flush has queued its launches
///   ([`Recorder::flushed`]), so a memo never refills memory that a
///   recorded launch still waiting to be queued reads.
#[derive(Default)]
pub(super) struct Recorder {
    state: Mutex<Option<Recording>>,
    /// Whether `state` holds a recording: the launch path's quick check.
    open: AtomicBool,
    segment: AtomicU64,
}

impl Recorder {
    /// Opens a recording for `thread`; false when one is open already.
    pub(super) fn open(&self, thread: ThreadId) -> bool {
        let mut state = self.state.lock();
        if state.is_some() {
            return false;
        }
        *state = Some(Recording {
            thread,
            ops: Vec::new(),
            graveyard: Vec::new(),
        });
        // Whatever was handed out before was queued at once: refillable.
        self.segment.fetch_add(1, Ordering::AcqRel);
        self.open.store(true, Ordering::Release);
        true
    }

    /// Records `op()` when `thread`'s pass is recording (true); false:
    /// nothing recorded, the caller queues the launch now.
    pub(super) fn record(&self, thread: ThreadId, op: impl FnOnce() -> Op) -> bool {
        if !self.open.load(Ordering::Acquire) {
            return false;
        }
        match self.state.lock().as_mut() {
            Some(r) if r.thread == thread => {
                r.ops.push(op());
                true
            }
            _ => false,
        }
    }

    /// Keeps `x` until the open recording's next flush; drops it now when
    /// none is open.
    pub(super) fn retire(&self, x: Box<dyn Any + Send>) {
        if !self.open.load(Ordering::Acquire) {
            return;
        }
        if let Some(r) = self.state.lock().as_mut() {
            r.graveyard.push(x);
        }
    }

    /// What `thread`'s recording holds, taken for a flush (`None`: it has
    /// none open). Call [`Recorder::flushed`] once it is queued.
    pub(super) fn take(&self, thread: ThreadId) -> Option<Flushed> {
        if !self.open.load(Ordering::Acquire) {
            return None;
        }
        match self.state.lock().as_mut() {
            Some(r) if r.thread == thread => Some(Flushed {
                ops: std::mem::take(&mut r.ops),
                keep: std::mem::take(&mut r.graveyard),
            }),
            _ => None,
        }
    }

    /// A taken list has been queued: memory handed out before may be
    /// refilled from now on.
    pub(super) fn flushed(&self) {
        self.segment.fetch_add(1, Ordering::AcqRel);
    }

    /// Closes `thread`'s recording (flushed first by the caller); what was
    /// retired since is dropped (no recorded launch uses it).
    pub(super) fn close(&self, thread: ThreadId) {
        let mut state = self.state.lock();
        if state.as_ref().is_some_and(|r| r.thread == thread) {
            self.open.store(false, Ordering::Release);
            *state = None;
        }
    }

    /// For a memo: the flush count, and whether any pass records.
    pub(super) fn moment(&self) -> Moment {
        Moment {
            segment: self.segment.load(Ordering::Acquire),
            recording: self.open.load(Ordering::Acquire),
        }
    }
}

/// An instantiated graph (owned; destroyed on drop).
pub(super) struct Exec(sys::CUgraphExec);

// SAFETY: a CUgraphExec is a driver handle usable from any thread; the
// device only touches it under the `Graphs` lock, one thread at a time
// (graph objects are not internally synchronised).
unsafe impl Send for Exec {}

impl Exec {
    pub(super) fn new(handle: sys::CUgraphExec) -> Self {
        Exec(handle)
    }
}

impl Drop for Exec {
    fn drop(&mut self) {
        if self.0.is_null() {
            return; // a test's stand-in
        }
        // SAFETY: the handle came from cuGraphInstantiate and is destroyed
        // once, here. A failure (context already gone) leaves nothing to do.
        let _ = unsafe { result::graph::exec_destroy(self.0) };
    }
}

/// A stream made for capturing (owned; destroyed on drop). Capture needs a
/// stream other than the legacy default one the device queues work on.
pub(super) struct CaptureStream(sys::CUstream);

// SAFETY: a CUstream is a driver handle usable from any thread; it is only
// used under the `Graphs` lock.
unsafe impl Send for CaptureStream {}

impl CaptureStream {
    pub(super) fn new() -> Result<Self, cudarc::driver::DriverError> {
        result::stream::create(result::stream::StreamKind::NonBlocking).map(CaptureStream)
    }

    pub(super) fn handle(&self) -> sys::CUstream {
        self.0
    }
}

impl Drop for CaptureStream {
    fn drop(&mut self) {
        // SAFETY: created by cuStreamCreate and destroyed once, here.
        let _ = unsafe { result::stream::destroy(self.0) };
    }
}

struct Cached {
    ops: Vec<Op>,
    hash: u64,
    exec: Exec,
    used: u64,
}

/// The graphs captured on one device, and the lists seen lately.
#[derive(Default)]
pub(super) struct Graphs {
    cached: Vec<Cached>,
    recent: VecDeque<u64>,
    tick: u64,
    pub(super) capture: Option<CaptureStream>,
    /// Set after the driver refused a capture or a graph launch: from then
    /// on every list is queued launch by launch.
    pub(super) broken: bool,
}

/// What to do with a flushed list.
pub(super) enum Plan {
    /// Launch this graph (captured from an equal list; alive while the
    /// cache is locked).
    Replay(sys::CUgraphExec),
    /// Queue the launches one by one, then capture them (seen before).
    EagerThenCapture,
    /// Queue the launches one by one.
    Eager,
}

pub(super) fn hash_ops(ops: &[Op]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    ops.hash(&mut h);
    h.finish()
}

impl Graphs {
    /// The plan for `ops` (hashed `hash`), and the note that it was seen.
    pub(super) fn plan(&mut self, ops: &[Op], hash: u64) -> Plan {
        self.tick += 1;
        if self.broken {
            return Plan::Eager;
        }
        let tick = self.tick;
        if let Some(i) = self
            .cached
            .iter()
            .position(|c| c.hash == hash && c.ops == ops)
        {
            self.cached[i].used = tick;
            return Plan::Replay(self.cached[i].exec.0);
        }
        if self.recent.contains(&hash) {
            return Plan::EagerThenCapture;
        }
        if self.recent.len() == RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back(hash);
        Plan::Eager
    }

    /// Keeps `exec`, captured from `ops`, in place of the least recently
    /// used graph when the cache is full.
    pub(super) fn keep(&mut self, ops: Vec<Op>, hash: u64, exec: Exec) {
        if self.cached.len() == MAX_GRAPHS
            && let Some(i) = (0..self.cached.len()).min_by_key(|&i| self.cached[i].used)
        {
            self.cached.swap_remove(i);
        }
        self.recent.retain(|&h| h != hash);
        self.cached.push(Cached {
            ops,
            hash,
            exec,
            used: self.tick,
        });
    }

    /// Graphs held now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.cached.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(kernel: KernelId, word: u8) -> Op {
        Op::new(kernel, (1, 1, 1), false, &[word; 12])
    }

    fn some_kernel() -> KernelId {
        KernelId::ALL[0]
    }

    #[test]
    fn params_bytes_are_kept_whole_and_compared_whole() {
        let a = Op::new(
            some_kernel(),
            (2, 1, 1),
            false,
            &[1, 2, 3, 4, 5, 6, 7, 8, 9],
        );
        assert_eq!(a.len, 9);
        assert_eq!(a.params.len(), 2, "9 bytes in two words, zero-padded");
        let bytes: &[u8] = bytemuck::cast_slice(&a.params);
        assert_eq!(&bytes[..9], &[1, 2, 3, 4, 5, 6, 7, 8, 9]);
        assert!(bytes[9..].iter().all(|&b| b == 0));
        let b = Op::new(
            some_kernel(),
            (2, 1, 1),
            false,
            &[1, 2, 3, 4, 5, 6, 7, 8, 10],
        );
        assert_ne!(a, b, "one byte differs");
        let c = Op::new(
            some_kernel(),
            (3, 1, 1),
            false,
            &[1, 2, 3, 4, 5, 6, 7, 8, 9],
        );
        assert_ne!(a, c, "the grid differs");
        let d = Op::new(some_kernel(), (2, 1, 1), true, &[1, 2, 3, 4, 5, 6, 7, 8, 9]);
        assert_ne!(a, d, "the overlap differs");
    }

    /// A list is queued eagerly the first time, captured the second time it
    /// is seen, replayed from then on; a list differing in one launch is
    /// another list.
    #[test]
    fn a_list_is_captured_when_seen_again_and_replayed_after() {
        let mut g = Graphs::default();
        let a = vec![op(some_kernel(), 1), op(some_kernel(), 2)];
        let b = vec![op(some_kernel(), 1), op(some_kernel(), 3)];
        let (ha, hb) = (hash_ops(&a), hash_ops(&b));
        assert!(matches!(g.plan(&a, ha), Plan::Eager));
        assert!(matches!(g.plan(&b, hb), Plan::Eager));
        assert!(matches!(g.plan(&a, ha), Plan::EagerThenCapture));
        assert_eq!(g.len(), 0, "nothing kept until a capture succeeds");
    }

    /// A stand-in for a captured graph (nothing to destroy).
    fn no_graph() -> Exec {
        Exec(std::ptr::null_mut())
    }

    #[test]
    fn a_kept_graph_is_replayed_for_an_equal_list_only() {
        let mut g = Graphs::default();
        let a = vec![op(some_kernel(), 1), op(some_kernel(), 2)];
        let ha = hash_ops(&a);
        g.keep(a.clone(), ha, no_graph());
        assert!(matches!(g.plan(&a, ha), Plan::Replay(_)));
        let mut longer = a.clone();
        longer.push(op(some_kernel(), 3));
        let h = hash_ops(&longer);
        assert!(matches!(g.plan(&longer, h), Plan::Eager), "one launch more");
        assert!(matches!(g.plan(&a[..1], hash_ops(&a[..1])), Plan::Eager));
    }

    /// A hash match alone never replays: the whole list must be equal.
    #[test]
    fn a_colliding_hash_does_not_replay_another_list() {
        let mut g = Graphs::default();
        let a = vec![op(some_kernel(), 1)];
        let b = vec![op(some_kernel(), 2)];
        let h = hash_ops(&a);
        g.keep(a, h, no_graph());
        // b presented under a's hash (a forced collision): not a's graph.
        assert!(matches!(g.plan(&b, h), Plan::Eager));
    }

    #[test]
    fn the_least_recently_used_graph_makes_room() {
        let mut g = Graphs::default();
        let lists: Vec<Vec<Op>> = (0..=MAX_GRAPHS as u8)
            .map(|w| vec![op(some_kernel(), w)])
            .collect();
        for l in &lists[..MAX_GRAPHS] {
            g.keep(l.clone(), hash_ops(l), no_graph());
        }
        // Use every graph but the second.
        for (i, l) in lists[..MAX_GRAPHS].iter().enumerate() {
            if i != 1 {
                assert!(matches!(g.plan(l, hash_ops(l)), Plan::Replay(_)));
            }
        }
        let last = &lists[MAX_GRAPHS];
        g.keep(last.clone(), hash_ops(last), no_graph());
        assert_eq!(g.len(), MAX_GRAPHS);
        assert!(matches!(g.plan(last, hash_ops(last)), Plan::Replay(_)));
        assert!(matches!(
            g.plan(&lists[0], hash_ops(&lists[0])),
            Plan::Replay(_)
        ));
        let evicted = &lists[1];
        assert!(!matches!(
            g.plan(evicted, hash_ops(evicted)),
            Plan::Replay(_)
        ));
    }

    #[test]
    fn a_broken_cache_queues_everything_eagerly() {
        let mut g = Graphs {
            broken: true,
            ..Graphs::default()
        };
        let a = vec![op(some_kernel(), 1)];
        let h = hash_ops(&a);
        for _ in 0..3 {
            assert!(matches!(g.plan(&a, h), Plan::Eager));
        }
    }

    /// Counts its drops.
    struct Tracked(std::sync::Arc<std::sync::atomic::AtomicUsize>);

    impl Drop for Tracked {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn tracked() -> (
        Box<dyn Any + Send>,
        std::sync::Arc<std::sync::atomic::AtomicUsize>,
    ) {
        let n = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        (Box::new(Tracked(n.clone())), n)
    }

    fn other_thread() -> ThreadId {
        std::thread::spawn(|| std::thread::current().id())
            .join()
            .unwrap()
    }

    #[test]
    fn only_the_opening_thread_s_launches_are_recorded() {
        let r = Recorder::default();
        let (me, them) = (std::thread::current().id(), other_thread());
        assert!(!r.record(me, || op(some_kernel(), 1)), "nothing open");
        assert!(r.open(me));
        assert!(!r.open(them), "one recording at a time");
        assert!(r.record(me, || op(some_kernel(), 1)));
        assert!(!r.record(them, || op(some_kernel(), 2)), "queued at once");
        assert!(r.take(them).is_none(), "another thread flushes nothing");
        let f = r.take(me).unwrap();
        assert_eq!(f.ops, vec![op(some_kernel(), 1)]);
        assert!(r.take(me).unwrap().ops.is_empty(), "taken once");
        r.close(them);
        assert!(r.moment().recording, "only its opener closes it");
        r.close(me);
        assert!(
            !r.moment().recording && r.open(them),
            "closed: open to others"
        );
    }

    /// A retired value outlives the launches recorded before the flush,
    /// whichever thread retired it; with nothing open it goes at once, and
    /// what was retired after the last flush goes at the close.
    #[test]
    fn retired_memory_lives_until_the_flush_that_queues_its_launches() {
        let r = std::sync::Arc::new(Recorder::default());
        let me = std::thread::current().id();
        let (x, dropped) = tracked();
        r.retire(x);
        assert_eq!(
            dropped.load(Ordering::SeqCst),
            1,
            "nothing open: dropped now"
        );
        assert!(r.open(me));
        let (x, dropped) = tracked();
        r.retire(x);
        let (y, dropped_y) = tracked();
        let r2 = r.clone();
        std::thread::spawn(move || r2.retire(y)).join().unwrap();
        assert_eq!(dropped.load(Ordering::SeqCst), 0);
        assert_eq!(dropped_y.load(Ordering::SeqCst), 0, "kept for this pass");
        let flushed = r.take(me).unwrap();
        assert_eq!(flushed.keep.len(), 2);
        drop(flushed);
        assert_eq!(
            dropped.load(Ordering::SeqCst) + dropped_y.load(Ordering::SeqCst),
            2
        );
        let (z, dropped_z) = tracked();
        r.retire(z);
        r.close(me);
        assert_eq!(dropped_z.load(Ordering::SeqCst), 1, "dropped at the close");
    }

    /// The count a memo reads moves at an open and after a flush was
    /// queued, never when the list is merely taken.
    #[test]
    fn the_flush_count_moves_only_once_the_launches_are_queued() {
        let r = Recorder::default();
        let me = std::thread::current().id();
        let start = r.moment().segment;
        assert!(r.open(me));
        let opened = r.moment().segment;
        assert!(opened > start);
        assert!(r.record(me, || op(some_kernel(), 1)));
        let taken = r.take(me).unwrap();
        assert_eq!(r.moment().segment, opened, "taken, not yet queued");
        drop(taken);
        r.flushed();
        assert!(r.moment().segment > opened);
    }

    #[test]
    fn recent_lists_are_bounded() {
        let mut g = Graphs::default();
        for w in 0..(RECENT as u8 + 8) {
            let l = vec![op(some_kernel(), w)];
            let _ = g.plan(&l, hash_ops(&l));
        }
        assert_eq!(g.recent.len(), RECENT);
        // The oldest fell out: seen again, it is only remembered.
        let first = vec![op(some_kernel(), 0)];
        assert!(matches!(g.plan(&first, hash_ops(&first)), Plan::Eager));
    }
}
