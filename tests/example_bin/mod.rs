//! Runs this package's example binaries, as `cargo test` builds them (into
//! `target/<profile>/examples/`, next to the test binaries' `deps/`).
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

/// The built example `name`, or `None` (with the reason on stderr) when
/// this test run did not build examples (a filtered `cargo test --test`).
pub fn path(name: &str) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?.parent()?.join("examples");
    let bin = dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    if bin.is_file() {
        Some(bin)
    } else {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "skipped: example `{name}` not built at {} (run `cargo test`, which builds examples)",
            bin.display()
        );
        None
    }
}

/// Runs the example with `args`; `None` when it is not built.
pub fn run(name: &str, args: &[&str]) -> Option<Output> {
    let bin = path(name)?;
    let out = Command::new(&bin)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", bin.display()));
    Some(out)
}
