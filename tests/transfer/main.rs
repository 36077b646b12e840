//! Disaggregated prefill/decode: the transfer protocol, its verifier, the transports, faults at every step, and the workers.
//!
//! One story per module; the shared rigs are in `tests/support/`.

#[macro_use]
#[path = "../support/mod.rs"]
mod support;

mod cross_peer_receipt;
mod decode_lands_a_burst;
mod decode_worker_shutdown;
mod device_fails_mid_transfer;
mod device_hashes_landed_kv;
mod device_staged_batches;
mod device_to_device_landing;
mod disaggregated;
mod example_disaggregated;
mod fault_interleavings;
mod fault_matrix;
mod host_misconfiguration;
mod pd_logprobs;
mod pd_model_mismatch;
mod pd_prefix_cache;
mod prefill_then_decode;
mod transfer_auth;
mod transfer_faults;
mod transfer_flood;
mod transfer_nixl;
mod transfer_prefill_refusals;
mod transfer_protocol;
mod transfer_retries;
mod transfer_transports;
mod transfer_two_by_two;
mod transfer_unbounded_waits;
mod transfer_wire;
