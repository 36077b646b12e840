//! `handoff-server` driven as its clients drive it: curl, the official
//! `openai` Python client, many streams at once, a client that goes away,
//! and a shutdown under load.
//!
//! One story per module; the shared rigs are in `support/`. The binary is
//! the one Cargo builds for these tests (`CARGO_BIN_EXE_handoff-server`).

mod support;

mod openai_server_auth;
mod openai_server_backpressure;
mod openai_server_disaggregated;
mod openai_server_disconnect;
mod openai_server_gpu;
mod openai_server_greedy;
mod openai_server_http;
mod openai_server_logprobs;
mod openai_server_python;
mod openai_server_shutdown;
mod openai_server_smollm2;
