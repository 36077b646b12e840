//! Synchronisation primitives, swapped for loom's under `cfg(handoff_loom)` so the
//! shared state of the pool (tests/loom_pool.rs) and of the transfer layer
//! (landing zone, in-flight credits: tests/loom_transfer.rs) can be
//! model-checked. Without `cfg(handoff_loom)` these are parking_lot's and std's
//! types, unchanged.

#[cfg(not(handoff_loom))]
pub(crate) use parking_lot::{Condvar, Mutex};
#[cfg(not(handoff_loom))]
pub(crate) use std::sync::Arc;

/// Atomics (std's, or loom's under `cfg(handoff_loom)`).
pub(crate) mod atomic {
    #[cfg(handoff_loom)]
    pub(crate) use loom::sync::atomic::AtomicU64;
    #[cfg(not(handoff_loom))]
    pub(crate) use std::sync::atomic::AtomicU64;
    pub(crate) use std::sync::atomic::Ordering;
}

#[cfg(handoff_loom)]
pub(crate) use loom::sync::Arc;

#[cfg(handoff_loom)]
mod loom_shim {
    use std::time::Instant;

    /// loom's mutex with parking_lot's panic-free `lock()` signature.
    #[derive(Debug, Default)]
    pub(crate) struct Mutex<T>(loom::sync::Mutex<T>);

    /// A held lock. The inner guard is absent only while a [`Condvar`]
    /// waits with it.
    pub(crate) struct MutexGuard<'a, T>(Option<loom::sync::MutexGuard<'a, T>>);

    impl<T> Mutex<T> {
        pub(crate) fn new(t: T) -> Self {
            Mutex(loom::sync::Mutex::new(t))
        }
        pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
            MutexGuard(Some(self.0.lock().unwrap_or_else(|e| e.into_inner())))
        }
    }

    impl<T> std::ops::Deref for MutexGuard<'_, T> {
        type Target = T;
        fn deref(&self) -> &T {
            self.0
                .as_ref()
                .expect("guard present outside a condvar wait")
        }
    }

    impl<T> std::ops::DerefMut for MutexGuard<'_, T> {
        fn deref_mut(&mut self) -> &mut T {
            self.0
                .as_mut()
                .expect("guard present outside a condvar wait")
        }
    }

    /// loom's condvar with parking_lot's `wait_until(&mut guard, deadline)`.
    /// loom does not model time: a wait ends only when notified, so a
    /// waiter nobody wakes is reported as a deadlock.
    #[derive(Debug, Default)]
    pub(crate) struct Condvar(loom::sync::Condvar);

    /// Whether a wait timed out (never, under loom).
    pub(crate) struct WaitTimeoutResult(bool);

    impl WaitTimeoutResult {
        pub(crate) fn timed_out(&self) -> bool {
            self.0
        }
    }

    impl Condvar {
        pub(crate) fn new() -> Self {
            Condvar(loom::sync::Condvar::new())
        }
        pub(crate) fn wait_until<T>(
            &self,
            guard: &mut MutexGuard<'_, T>,
            _deadline: Instant,
        ) -> WaitTimeoutResult {
            if let Some(g) = guard.0.take() {
                guard.0 = Some(self.0.wait(g).unwrap_or_else(|e| e.into_inner()));
            }
            WaitTimeoutResult(false)
        }
        pub(crate) fn notify_all(&self) {
            self.0.notify_all();
        }
    }
}
#[cfg(handoff_loom)]
pub(crate) use loom_shim::{Condvar, Mutex};
