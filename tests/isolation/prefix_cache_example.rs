//! Story: `examples/prefix_cache.rs` runs issue #20's two workloads through
//! the colocated engine, with and without the prefix cache (and chunked
//! prefill). Its contract, at a small size:
//! no tenant ever leases another tenant's page, the same tenant's later
//! requests do hit, both runs of each workload give the same tokens, every
//! pool comes back, and the last line is the one-line summary; bad
//! arguments exit 2 with the reason on stderr. (Its speed figures are for
//! people to read, not for a timed test.)
//!
//! Runs the example binary that `cargo test` builds; under a filtered
//! `cargo test --test prefix_cache_example` it is not built and each test
//! says so on stderr and returns.

use crate::support::example_bin;

#[test]
fn both_workloads_agree_with_and_without_and_no_tenant_hits_anothers_page() {
    let Some(out) = example_bin::run(
        "prefix_cache",
        &[
            "--system-tokens",
            "96",
            "--tenants",
            "3",
            "--conversations",
            "6",
            "--long-prompt",
            "300",
            "--decodes",
            "4",
            "--step-tokens",
            "64",
        ],
    ) else {
        return;
    };
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains("same tokens with and without the cache: true; pools full: true true"),
        "{stdout}"
    );
    assert!(
        stdout.contains("same tokens chunked and unchunked: true; pools full: true true"),
        "{stdout}"
    );
    let last = stdout.lines().last().unwrap_or_default();
    let field = |name: &str| -> f64 {
        last.split_whitespace()
            .find_map(|w| w.strip_prefix(name)?.strip_prefix('=')?.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing in: {last}"))
    };
    assert!(last.starts_with("prefix_cache: "), "{last}");
    assert_eq!(field("cross_tenant_hits"), 0.0);
    assert!(field("same_tenant_hit_rate") >= 0.5, "{last}");
    assert!(field("ttft_speedup") > 0.0 && field("chunked_itl_p99_ratio") > 0.0);
}

#[test]
fn a_bad_argument_exits_2_with_the_reason() {
    let Some(out) = example_bin::run("prefix_cache", &["--tenants", "0"]) else {
        return;
    };
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.contains("--tenants takes a positive integer"),
        "{stderr}"
    );
}
