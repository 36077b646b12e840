//! `handoff-server` driven as its clients drive it: curl, the official
//! `openai` Python client, many streams at once, a client that goes away,
//! a shutdown under load, and the hostile cases (templates, header floods,
//! forged roles, mass disconnects).
//!
//! One story per module; the shared rigs are in `support/`. The binary is
//! the one Cargo builds for these tests (`CARGO_BIN_EXE_handoff-server`).

mod support;

mod hostile_templates;

mod access_log;

mod header_flood;
mod hostile_template_doubling;
mod hostile_template_loop;
mod hostile_template_sleeper;
mod many_streams;
mod mass_disconnect;
mod metrics_key;

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
mod ready_while_loading;
mod role_forging;
mod split_special_tokens;
