//! Story: `examples/serve.rs` is the smallest serving stack built on
//! `Service`: client threads submit and stream concurrently. Its contract:
//! every request finishes, every client gets the same tokens for the same
//! prompt however the engine batched them, every page comes back, and the
//! last line says so; bad arguments exit 2 with the reason on stderr.
//!
//! Runs the example binary that `cargo test` builds; under a filtered
//! `cargo test --test example_serve` it is not built and each test says so
//! on stderr and returns.

use crate::support::example_bin;

#[test]
fn concurrent_clients_all_finish_agree_and_return_every_page() {
    let Some(out) = example_bin::run(
        "serve",
        &["--clients", "4", "--requests", "3", "--max-new-tokens", "8"],
    ) else {
        return;
    };
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "{stdout}");
    let last = stdout.lines().last().unwrap_or_default();
    for field in [
        "clients=4",
        "requests=12",
        "ok=12",
        "rejected=0",
        "failed=0",
        "mismatched=0",
        "tokens=96",
        "pool_full=true",
    ] {
        assert!(
            last.split_whitespace().any(|w| w == field),
            "{field} missing in: {last}"
        );
    }
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with("client ")).count(),
        4
    );
}

#[test]
fn bad_arguments_exit_2_with_the_reason() {
    for args in [&["--clients", "0"][..], &["--bogus"], &["--requests"]] {
        let Some(out) = example_bin::run("serve", args) else {
            return;
        };
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(out.stdout.is_empty(), "{args:?}");
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(err.starts_with("error: "), "{args:?}: {err}");
    }
}
