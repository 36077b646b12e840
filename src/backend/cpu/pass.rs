//! How the CPU backend's passes use its threads: a small model's batch as
//! one whole pass per thread ([`PassPlan::Groups`]), a large one's ops each
//! split over the pool, whose workers poll for the pass's work meanwhile.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;

use crate::backend::PassPlan;
use crate::backend::cpu::CpuBackend;

/// Fewest token rows worth a group of their own.
const MIN_GROUP_ROWS: usize = 4;

thread_local! {
    /// Set while this thread runs a group pass: its ops stay serial.
    static SERIAL_OPS: Cell<bool> = const { Cell::new(false) };
}

/// Longest a worker polls without finding work before it goes back to
/// sleeping until woken: a pass stuck in a long serial stretch (or a
/// machine with more runnable threads than cores) does not keep it busy.
const POLL_IDLE: std::time::Duration = std::time::Duration::from_micros(500);

/// Runs the pool's pending work on this worker as soon as there is any,
/// until `done`: a worker that sleeps when idle takes tens of microseconds
/// to wake, once per op of a pass, which on two cores cost a quarter of a
/// decode step. Between polls it yields its core to any other runnable
/// thread, and it gives up after [`POLL_IDLE`] without work. Returns at
/// once on the thread running the pass itself (which could pick this job
/// up while it waits), so it never waits for its own end.
fn poll_until(done: &AtomicBool, pass_thread: Option<usize>) {
    if rayon::current_thread_index() == pass_thread {
        return;
    }
    let mut idle_since = std::time::Instant::now();
    let mut polls = 0u32;
    while !done.load(Ordering::Acquire) {
        if rayon::yield_now() == Some(rayon::Yield::Executed) {
            polls = 0;
            idle_since = std::time::Instant::now();
            continue;
        }
        polls += 1;
        if polls < 64 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
            if polls.is_multiple_of(64) && idle_since.elapsed() > POLL_IDLE {
                return;
            }
        }
    }
}

/// Sets its flag when dropped, so a pass that unwinds still ends the
/// workers polling for it.
struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Marks this thread as running a group pass until dropped (restoring the
/// previous mark, so nesting and unwinding leave it right).
struct SerialOps(bool);

impl SerialOps {
    fn enter() -> Self {
        SerialOps(SERIAL_OPS.replace(true))
    }
}

impl Drop for SerialOps {
    fn drop(&mut self) {
        SERIAL_OPS.set(self.0);
    }
}

impl CpuBackend {
    /// The pool, when `work` multiply-adds are worth splitting.
    pub(super) fn par_pool(&self, work: usize) -> Option<&rayon::ThreadPool> {
        self.pool
            .as_ref()
            .filter(|_| work >= self.min_parallel_work && !SERIAL_OPS.get())
    }

    /// Whether a pass of `rows` token rows through `weights` weight
    /// elements is large enough for any of its ops to split over threads.
    fn splits(&self, rows: usize, weights: usize) -> bool {
        self.pool.is_some() && rows.saturating_mul(weights) >= 4 * self.min_parallel_work
    }

    /// Whether this thread runs a group pass (whose ops stay serial).
    pub(super) fn in_group() -> bool {
        SERIAL_OPS.get()
    }

    /// `Backend::plan_pass`.
    pub(super) fn plan(&self, rows: usize, weights: usize) -> PassPlan {
        if !self.splits(rows, weights) {
            // Too small for any op to pay for another thread.
            return PassPlan::Here;
        }
        if weights.saturating_mul(4) <= self.group_weight_bytes && rows >= 2 * MIN_GROUP_ROWS {
            PassPlan::Groups(self.threads.min(rows / MIN_GROUP_ROWS))
        } else {
            PassPlan::Here
        }
    }

    /// `Backend::run_pass`.
    pub(super) fn pass<R: Send, F: FnOnce() -> R + Send>(
        &self,
        rows: usize,
        weights: usize,
        f: F,
    ) -> R {
        // A pass no op of which splits (or one inside a group pass) runs
        // here: handing it to the pool would only add a hand-off.
        let Some(pool) =
            (self.pool.as_ref()).filter(|_| !SERIAL_OPS.get() && self.splits(rows, weights))
        else {
            return f();
        };
        // From inside the pool, an op's split pushes its halves on this
        // worker's own queue and the caller works on them too; the other
        // workers poll for them for the whole pass (see `poll_until`)
        // instead of falling asleep between two ops and being woken for
        // each.
        pool.install(|| {
            let done = AtomicBool::new(false);
            let pass_thread = rayon::current_thread_index();
            rayon::scope(|s| {
                for _ in 1..self.threads {
                    s.spawn(|_| poll_until(&done, pass_thread));
                }
                let _end = SetOnDrop(&done);
                f()
            })
        })
    }

    /// `Backend::run_groups`.
    pub(super) fn groups<R: Send, F: FnOnce() -> R + Send>(&self, tasks: Vec<F>) -> Vec<R> {
        match &self.pool {
            // Each group runs with its ops serial (see `par_pool`): a
            // group is one thread's work, and a worker waiting in a join
            // could pick up another group's whole pass meanwhile.
            Some(pool) => pool.install(|| {
                tasks
                    .into_par_iter()
                    .map(|f| {
                        let _serial = SerialOps::enter();
                        f()
                    })
                    .collect()
            }),
            None => tasks.into_iter().map(|f| f()).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use rayon::prelude::*;

    use crate::backend::{Backend, CpuBackend};

    #[test]
    fn ops_inside_a_group_pass_never_split() {
        let b = CpuBackend::with_threads(2).min_parallel_work(1);
        assert!(b.par_pool(1).is_some(), "outside a group, ops split");
        let inside = b.run_groups(vec![|| b.par_pool(1).is_some(); 4]);
        assert_eq!(inside, vec![false; 4], "a group's ops must stay serial");
        assert!(b.par_pool(1).is_some(), "the mark is lifted afterwards");
    }

    #[test]
    fn a_pass_that_unwinds_releases_the_polling_workers() {
        let b = CpuBackend::with_threads(2).min_parallel_work(1);
        // A pass whose split ops run on both threads, then panics.
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            b.run_pass(1, usize::MAX, || {
                let mut v = vec![0u32; 1 << 12];
                if let Some(pool) = b.par_pool(1) {
                    pool.install(|| v.par_iter_mut().for_each(|x| *x += 1));
                }
                assert_eq!(v.iter().sum::<u32>(), 1 << 12);
                panic!("a pass that fails");
            })
        }));
        assert!(unwound.is_err());
        // The pool is free again: a pass needing both threads completes.
        let sum: u64 = b.run_pass(1, usize::MAX, || {
            b.par_pool(1)
                .map(|p| p.install(|| (0..1u64 << 16).into_par_iter().sum()))
                .unwrap_or(0)
        });
        assert_eq!(sum, (1u64 << 16) * ((1u64 << 16) - 1) / 2);
    }
}
