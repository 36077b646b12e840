//! What the stories share: one module per rig. Each test binary (one per
//! area: engine, transfer, model, isolation, cuda) declares
//! `#[macro_use] mod support;` and its stories `use crate::support::...`.
#![allow(dead_code)]

/// Runs each story `name => fn` against every transport, as the tests
/// `in_process::name`, `tcp::name`, `tcp_auth::name` (authenticated TCP)
/// and `nixl::name` (NIXL READs beside authenticated TCP; printed SKIP
/// where NIXL is not installed or the feature is off) (the generic
/// conformance pattern); each test binary declares `#[macro_use] mod
/// support;` first.
#[allow(unused_macros)]
macro_rules! on_both_transports {
    ($($name:ident => $body:expr;)*) => {
        mod in_process {
            use super::*;
            $(#[test] fn $name() { ($body)(handoff::transfer::InProcess) })*
        }
        mod tcp {
            use super::*;
            $(#[test] fn $name() { ($body)(handoff::transfer::Tcp) })*
        }
        mod tcp_auth {
            use super::*;
            $(#[test] fn $name() { ($body)(handoff::transfer::TcpAuth) })*
        }
        mod nixl {
            #[allow(unused_imports)]
            use super::*;
            $(#[test] fn $name() { on_nixl!($body) })*
        }
    };
}

/// Runs `body` (a closure taking a transport) on NIXL, or prints why it
/// skips.
#[allow(unused_macros)]
macro_rules! on_nixl {
    ($body:expr) => {{
        #[cfg(feature = "nixl")]
        if let Some(t) = crate::support::nixl::nixl() {
            ($body)(t)
        }
        #[cfg(not(feature = "nixl"))]
        crate::support::nixl::skip();
    }};
}

pub mod device_pages;
pub mod example_bin;
pub mod hf_fixture;
pub mod naive_llama;
pub mod nixl;
pub mod openai_client;
pub mod pd;
pub mod serving_path;
#[path = "sim/host.rs"]
pub mod sim_host;
pub mod text_support;
pub mod transfer_rig;

#[allow(unused_imports)]
pub use transfer_rig::*;
