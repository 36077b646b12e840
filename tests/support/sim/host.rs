//! Building CUDA kernel bodies for the host SIMT emulator (tests/support/sim/simt_host.h),
//! shared by the tests that run them before any GPU does.

use std::path::{Path, PathBuf};
use std::process::Command;

/// `exe` found on `PATH`.
pub fn on_path(exe: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(exe))
            .find(|p| p.is_file())
    })
}

/// A host C++ compiler: c++, g++ or clang++.
pub fn cxx() -> Option<PathBuf> {
    ["c++", "g++", "clang++"].iter().find_map(|c| on_path(c))
}

/// Compiles `tests/support/sim/<main>` with the kernels in `cuda/` against the
/// emulator into `dir`, and returns the program; panics with the
/// compiler's output when it does not compile.
pub fn build_emulated(cxx: &Path, main: &str, dir: &Path) -> PathBuf {
    let root = env!("CARGO_MANIFEST_DIR");
    let exe = dir.join(main.trim_end_matches(".cpp"));
    let out = Command::new(cxx)
        .args([
            "-std=c++20",
            "-O2",
            "-pthread",
            "-fno-strict-aliasing",
            // Each f64 multiply and add rounded on its own, as the kernels
            // ask the GPU for (device sampling's weights are compared bit
            // for bit).
            "-ffp-contract=off",
            "-Wno-unknown-pragmas",
            "-DHANDOFF_SIMT_HOST",
        ])
        .arg(format!("-I{root}/cuda"))
        .arg(format!("-I{root}/tests/support/sim"))
        .arg(format!("{root}/tests/support/sim/{main}"))
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{} could not compile tests/support/sim/{main} for the emulator:\n{}",
        cxx.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}

/// [`build_emulated`] with the host's compiler, or `None` after printing
/// `SKIP <test>` when there is none (the test then passes).
pub fn emulated_or_skip(test: &str, main: &str, dir: &Path) -> Option<PathBuf> {
    let Some(cxx) = cxx() else {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "SKIP {test}: no C++ compiler (c++, g++ or clang++) found"
        );
        return None;
    };
    Some(build_emulated(&cxx, main, dir))
}
