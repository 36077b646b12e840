//! Loading NIXL and making agents. nixl-sys (built with `stub-api`) looks
//! for `libnixl_capi.so` on first use and aborts the process when it is
//! missing, so every entry point here checks first and answers
//! [`LinkError::NixlUnavailable`] instead.

use std::path::Path;
use std::sync::OnceLock;

use nixl_sys::{Agent, AgentConfig, Backend, NixlError};

use crate::transfer::error::LinkError;

/// The environment variable naming `libnixl_capi.so`'s path.
pub const LIB_ENV: &str = "HANDOFF_NIXL_LIB";

static LOADED: OnceLock<Result<(), String>> = OnceLock::new();

/// Makes NIXL usable in this process: loads `libnixl_capi.so` from `path`
/// (its own dependencies resolve from beside it), then checks that nixl-sys
/// finds it. The first call decides for the whole process.
pub fn load(path: &Path) -> Result<(), LinkError> {
    check(LOADED.get_or_init(|| load_from(Some(path))))
}

/// Checks that NIXL is usable: loaded by [`load`] already, loadable from
/// `$HANDOFF_NIXL_LIB`, or on the dynamic loader's path.
pub fn ready() -> Result<(), LinkError> {
    check(LOADED.get_or_init(|| {
        let path = std::env::var_os(LIB_ENV);
        load_from(path.as_deref().map(Path::new))
    }))
}

fn check(r: &Result<(), String>) -> Result<(), LinkError> {
    r.clone()
        .map_err(|reason| LinkError::NixlUnavailable { reason })
}

fn load_from(path: Option<&Path>) -> Result<(), String> {
    if let Some(path) = path {
        // SAFETY: libnixl_capi.so's initialisers are NIXL's own and run
        // once; the library stays loaded for the life of the process (the
        // handle is leaked), so nothing it hands out outlives it.
        let lib = unsafe {
            libloading::os::unix::Library::open(
                Some(path),
                libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
            )
        }
        .map_err(|e| format!("cannot load {}: {e}", path.display()))?;
        std::mem::forget(lib);
    }
    if nixl_sys::is_stub() {
        return Err(match path {
            Some(p) => format!("{} loaded, but nixl-sys does not see it", p.display()),
            None => format!("libnixl_capi.so is not on the library path and {LIB_ENV} is unset"),
        });
    }
    Ok(())
}

/// A NIXL error, as a data-plane failure while doing `what`.
pub(super) fn failed(what: &'static str) -> impl Fn(NixlError) -> LinkError {
    move |e| LinkError::DataPlane {
        what,
        detail: e.to_string(),
    }
}

/// How often an agent's progress thread runs when it has one.
const PROGRESS_DELAY_US: u64 = 100;

/// An agent named `name` with a UCX backend, restricted to the UCX network
/// devices `devices` when given (e.g. "lo"). No listener thread (metadata
/// goes over the authenticated link). With `progress`, a progress thread
/// serves the peer's READs (transports that emulate them need the target's
/// progress); without, the agent's owner drives progress while it waits.
pub(super) fn agent(
    name: &str,
    devices: Option<&str>,
    progress: bool,
) -> Result<(Agent, Backend), LinkError> {
    ready()?;
    let cfg = AgentConfig {
        enable_listen_thread: false,
        enable_prog_thread: progress,
        pthr_delay_us: PROGRESS_DELAY_US,
        ..AgentConfig::default()
    };
    let agent = Agent::new_configured(name, &cfg).map_err(failed("creating a NIXL agent"))?;
    let (_mems, mut params) = agent
        .get_plugin_params("UCX")
        .map_err(failed("finding NIXL's UCX plugin"))?;
    if let Some(d) = devices {
        params
            .set("ucx_devices", d)
            .map_err(failed("setting UCX devices"))?;
    }
    let backend = agent
        .create_backend("UCX", &params)
        .map_err(failed("creating NIXL's UCX backend"))?;
    Ok((agent, backend))
}

/// A fresh agent name: `handoff-<role>-<16 random hex digits>`.
pub(super) fn agent_name(role: &str) -> Result<String, LinkError> {
    let mut b = [0u8; 8];
    getrandom::fill(&mut b).map_err(|e| LinkError::DataPlane {
        what: "naming a NIXL agent",
        detail: e.to_string(),
    })?;
    Ok(format!("handoff-{role}-{:016x}", u64::from_le_bytes(b)))
}
