//! The handoff protocol, independent of the transport: the messages, the
//! state machines of the two sides, and the pure check of a receipt.
//!
//! - [`messages`](self#types): the messages (plan, write batch, receipt,
//!   abort, answer), re-exported here.
//! - `decode`: [`DecodeSide`], the decode end's state machine.
//! - `prefill`: [`PrefillSide`], the prefill end's state machine.
//! - `verify`: checks one receipt against its plan and the bytes that
//!   landed, and alone turns landed bytes into a readable sequence.
//! - [`checksum`]: the per-page checksums both ends compute.

pub mod checksum;
pub(crate) mod decode;
pub(crate) mod ended;
mod messages;
pub(crate) mod prefill;
pub(crate) mod verify;

pub use decode::{CancelOutcome, DecodeOutcome, DecodeSide, DecodeStats, POLL_BURST, VerifiedKv};
pub use messages::*;
pub use prefill::{PrefillJob, PrefillSide, PrefillStats};
