//! NIXL for the stories that run on every transport: loaded from
//! `$HANDOFF_NIXL_LIB`, or from where `scripts/install-nixl.sh` puts it.
//! Without it (or without the `nixl` feature) a story prints why it skips,
//! unless `HANDOFF_REQUIRE_NIXL=1` (as `.ci/run` sets), which makes that a
//! failure.

/// Fails the story when NIXL is required, else prints why it skips.
fn skip_or_fail(why: &str) {
    if std::env::var_os("HANDOFF_REQUIRE_NIXL").is_some_and(|v| v == "1") {
        panic!("HANDOFF_REQUIRE_NIXL=1 but {why}");
    }
    eprintln!("SKIP: {why}");
}

/// Why NIXL stories skip in a build without the feature.
#[cfg(not(feature = "nixl"))]
pub fn skip() {
    skip_or_fail(
        "built without the nixl feature (scripts/install-nixl.sh, then \
         cargo test --features nixl)",
    );
}

/// Where `libnixl_capi.so` is: `$HANDOFF_NIXL_LIB`, else where
/// `scripts/install-nixl.sh` puts it.
#[cfg(feature = "nixl")]
pub fn lib_path() -> std::path::PathBuf {
    std::env::var_os(handoff::transfer::nixl::LIB_ENV)
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join(".nixl/.nixl_cu12.mesonpy.libs/libnixl_capi.so")
        })
}

/// The NIXL transport, or `None` with a printed reason.
#[cfg(feature = "nixl")]
pub fn nixl() -> Option<handoff::transfer::Nixl> {
    match handoff::transfer::nixl::load(&lib_path()) {
        Ok(()) => Some(handoff::transfer::Nixl),
        Err(e) => {
            skip_or_fail(&e.to_string());
            None
        }
    }
}
