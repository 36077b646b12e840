//! The seams tests reach through, kept apart from the protocol and the
//! links.
//!
//! - `gate`: where the links apply injected faults and the sides take the
//!   worker faults. Without the `fault-injection` feature (and outside
//!   tests) it holds nothing and passes every message through unchanged.
//! - `fault` (tests and the `fault-injection` feature): the `FaultPlan`.
//! - `peers` (tests and the `fault-injection` feature): synthetic peers
//!   that follow the protocol up to one point, such as a decode end that
//!   completes the handshake and never accepts.
//! - [`synthetic`]: deterministic KV for transfers without a model.

#[cfg(any(test, feature = "fault-injection"))]
pub mod fault;
pub(crate) mod gate;
#[cfg(any(test, feature = "fault-injection"))]
pub mod peers;
pub mod synthetic;

pub use gate::Step;
