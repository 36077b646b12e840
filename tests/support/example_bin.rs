//! Runs this package's example binaries, as `cargo test` builds them (into
//! `target/<profile>/examples/`, next to the test binaries' `deps/`).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The built example `name`, or `None` (with the reason on stderr) when
/// this test run did not build examples (a filtered `cargo test --test`).
pub fn path(name: &str) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?.parent()?.join("examples");
    let bin = dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    if bin.is_file() {
        assert_fresh(name, &bin);
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

/// Fails, saying how to rebuild, when the example binary is older than its
/// source or any library source: a filtered `cargo test --test` does not
/// rebuild examples, and a stale binary would test old code.
fn assert_fresh(name: &str, bin: &Path) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let built = mtime(bin);
    // A one-file example, or a folder of modules (`examples/<name>/main.rs`).
    let mut newest = mtime(&root.join("examples").join(format!("{name}.rs")));
    let mut dirs = vec![root.join("src"), root.join("examples").join(name)];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                newest = newest.max(mtime(&path));
            }
        }
    }
    assert!(
        built >= newest,
        "example `{name}` at {} is older than its sources: run `cargo test` (or `cargo build --examples`) first",
        bin.display()
    );
}

fn mtime(path: &Path) -> std::time::SystemTime {
    std::fs::metadata(path)
        .and_then(|m| m.modified())
        .unwrap_or(std::time::SystemTime::UNIX_EPOCH)
}

/// Runs the example with `args`; `None` when it is not built.
pub fn run(name: &str, args: &[&str]) -> Option<Output> {
    run_with_env(name, args, &[])
}

/// [`run`] with `env` added to the example's environment.
pub fn run_with_env(name: &str, args: &[&str], env: &[(&str, &std::ffi::OsStr)]) -> Option<Output> {
    let bin = path(name)?;
    let out = Command::new(&bin)
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", bin.display()));
    Some(out)
}

/// Asserts that an example asked for `--backend cuda` where it cannot have
/// a GPU refused as the build says it must: exit `code`, nothing on
/// stdout, and the reason on stderr (`no usable GPU` in a `cuda` build,
/// the missing build flag otherwise); never under `HANDOFF_REQUIRE_GPU=1`.
pub fn assert_gpu_refused(out: &Output, code: i32) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        std::env::var("HANDOFF_REQUIRE_GPU").as_deref() != Ok("1"),
        "HANDOFF_REQUIRE_GPU=1 but the example could not use the GPU: {stderr}"
    );
    assert_eq!(out.status.code(), Some(code), "{stderr}");
    assert!(out.stdout.is_empty(), "nothing on stdout: {stderr}");
    let why = if cfg!(feature = "cuda") {
        "no usable GPU"
    } else {
        "needs a build with the cuda feature"
    };
    assert!(
        stderr.contains("--backend cuda") && stderr.contains(why),
        "{stderr}"
    );
}
