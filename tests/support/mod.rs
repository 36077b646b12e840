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

pub mod damaged;
pub mod device_pages;
pub mod example_bin;
pub mod gguf_llama;
pub mod hf_fixture;
pub mod naive_llama;
pub mod nixl;
pub mod pd;
pub mod serving_path;
#[path = "sim/host.rs"]
pub mod sim_host;
pub mod text_support;
pub mod transfer_rig;

#[allow(unused_imports)]
pub use transfer_rig::*;

/// Submits `requests` to `engine`, runs it until idle, and returns each
/// request's tokens in order, requiring every request to finish and the
/// pool to be full again.
pub fn finished_tokens<B: handoff::backend::Backend>(
    engine: &mut handoff::Engine<B>,
    requests: impl IntoIterator<Item = handoff::Request>,
) -> Vec<Vec<u32>> {
    let handles: Vec<_> = requests
        .into_iter()
        .map(|r| engine.submit(r).unwrap())
        .collect();
    engine.run_until_idle();
    assert!(engine.pool_stats().is_full());
    handles
        .into_iter()
        .map(|h| {
            let (tokens, outcome) = h.try_collect();
            assert!(
                matches!(outcome, Some(handoff::Outcome::Finished(_))),
                "{outcome:?}"
            );
            tokens
        })
        .collect()
}

/// One request of tenant 1 per prompt, ids 0, 1, ..., each for `new` tokens.
pub fn prompt_requests(prompts: &[Vec<u32>], new: usize) -> Vec<handoff::Request> {
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            handoff::Request::new(
                handoff::RequestId(i as u64),
                handoff::TenantId(1),
                p.clone(),
                new,
            )
        })
        .collect()
}

/// The real model `file` that `scripts/fetch-models.sh` puts in `models/`,
/// or `None` (with a printed SKIP saying how to get it) when it is absent.
pub fn fetched_model(file: &str) -> Option<std::path::PathBuf> {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models")
        .join(file);
    if p.exists() {
        Some(p)
    } else {
        eprintln!(
            "SKIP: {} is absent; run scripts/fetch-models.sh",
            p.display()
        );
        None
    }
}
