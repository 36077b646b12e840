//! Story: the disaggregated example is the deployment a reader copies, so
//! its audit must tell the truth.
//!
//! The example serves a mixed multi-tenant workload through a prefill and a
//! decode worker (threads, or two processes over loopback TCP): one prompt
//! longer than the window, one request cancelled while its KV is in flight,
//! and with `--inject-corrupt-receipt` one receipt that fails verification.
//! Each run must exit 0, account for every request exactly once, show each
//! scripted failure with its typed status, show every success equal to
//! colocated serving, and end on the audit line with nothing leaked, held
//! or read across requests.

use crate::support::example_bin;

/// The figures of the example's final audit line.
#[derive(Debug)]
struct Audit {
    requests: usize,
    ok: usize,
    rejected: usize,
    cancelled: usize,
    failed: usize,
    leaked_pages: usize,
    held_pages: usize,
    isolation_violations: usize,
}

const KEYS: [&str; 8] = [
    "requests",
    "ok",
    "rejected",
    "cancelled",
    "failed",
    "leaked_pages",
    "held_pages",
    "isolation_violations",
];

/// Parses `audit: requests=N ok=N ... isolation_violations=N`, exactly
/// those keys in that order, each a decimal number, nothing else.
fn parse_audit(line: &str) -> Audit {
    let rest = line
        .strip_prefix("audit: ")
        .unwrap_or_else(|| panic!("the last line is not the audit: {line:?}"));
    let fields: Vec<&str> = rest.split(' ').collect();
    assert_eq!(fields.len(), KEYS.len(), "audit fields: {line:?}");
    let v: Vec<usize> = fields
        .iter()
        .zip(KEYS)
        .map(|(field, key)| {
            let (k, n) = field
                .split_once('=')
                .unwrap_or_else(|| panic!("{field:?} is not key=value in {line:?}"));
            assert_eq!(k, key, "audit keys out of order in {line:?}");
            assert!(
                !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()),
                "{key}={n:?} is not a count in {line:?}"
            );
            n.parse().unwrap()
        })
        .collect();
    Audit {
        requests: v[0],
        ok: v[1],
        rejected: v[2],
        cancelled: v[3],
        failed: v[4],
        leaked_pages: v[5],
        held_pages: v[6],
        isolation_violations: v[7],
    }
}

/// Runs the example with `args` and checks what every run must show.
/// Returns the audit and the per-request lines; `None` when the example
/// was not built.
fn run_checked(args: &[&str]) -> Option<(Audit, Vec<String>)> {
    run_checked_with(args, &[])
}

/// [`run_checked`] with `env` added to the example's environment.
fn run_checked_with(
    args: &[&str],
    env: &[(&str, &std::ffi::OsStr)],
) -> Option<(Audit, Vec<String>)> {
    let out = example_bin::run_with_env("disaggregated", args, env)?;
    let stdout = String::from_utf8(out.stdout).expect("stdout is UTF-8");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "disaggregated {args:?} failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    let mut lines: Vec<String> = stdout.lines().map(str::to_owned).collect();
    let last = lines.pop().expect("the example printed nothing");
    let a = parse_audit(&last);

    assert_eq!(
        a.requests,
        a.ok + a.rejected + a.cancelled + a.failed,
        "every request is counted exactly once: {a:?}"
    );
    assert_eq!(
        lines.len(),
        a.requests,
        "one line per request before the audit:\n{stdout}"
    );
    assert!(
        lines.iter().all(|l| l.starts_with("req#")),
        "only request lines before the audit:\n{stdout}"
    );
    assert_eq!(a.leaked_pages, 0, "{a:?}");
    assert_eq!(a.held_pages, 0, "{a:?}");
    assert_eq!(a.isolation_violations, 0, "{a:?}");
    assert!(
        !lines.iter().any(|l| l.contains("LOST")),
        "no request may be lost:\n{stdout}"
    );

    // Each request line agrees with the counts.
    let count = |needle: &str| lines.iter().filter(|l| l.contains(needle)).count();
    assert_eq!(count(": ok, "), a.ok, "{stdout}");
    assert_eq!(count(": rejected, HTTP "), a.rejected, "{stdout}");
    assert_eq!(count(": cancelled "), a.cancelled, "{stdout}");
    assert_eq!(count(": failed, HTTP "), a.failed, "{stdout}");

    // Every success is token for token what the colocated engine generates.
    assert!(a.ok >= 1, "{stdout}");
    for l in lines.iter().filter(|l| l.contains(": ok, ")) {
        assert!(
            l.ends_with("(matches colocated)"),
            "a disaggregated output differs from colocated serving: {l}"
        );
    }

    // The prompt longer than the window: a typed 413 before any allocation.
    assert!(a.rejected >= 1, "{a:?}");
    let over = lines
        .iter()
        .find(|l| l.contains(": rejected, HTTP "))
        .unwrap();
    assert!(
        over.contains("rejected, HTTP 413") && over.contains("exceeds the context window"),
        "{over}"
    );

    // The client that went away mid-transfer: fenced, nothing generated.
    assert!(a.cancelled >= 1, "{a:?}");
    let cancelled = lines.iter().find(|l| l.contains(": cancelled ")).unwrap();
    assert!(
        cancelled.contains("mid-transfer: fenced and released, 0 tokens"),
        "{cancelled}"
    );
    Some((a, lines))
}

/// The corrupted receipt fails verification: HTTP 500, zero tokens.
fn assert_corrupt_receipt_failed(a: &Audit, lines: &[String]) {
    assert_eq!(
        a.failed, 1,
        "the corrupted receipt fails its request only: {a:?}"
    );
    let failed = lines
        .iter()
        .find(|l| l.contains(": failed, HTTP "))
        .unwrap();
    assert!(
        failed.contains("failed, HTTP 500, 0 tokens generated")
            && failed.contains("checksum of page"),
        "{failed}"
    );
}

#[test]
fn threads_serve_the_workload_with_a_clean_audit() {
    let Some((a, _)) = run_checked(&[]) else {
        return;
    };
    assert_eq!(a.failed, 0, "nothing fails without an injected fault");
}

#[test]
fn two_processes_over_tcp_serve_the_workload_on_bf16_kv_with_a_clean_audit() {
    // Both processes' pools and the colocated reference keep bf16 KV.
    let Some((a, _)) = run_checked(&["--transport", "tcp", "--kv-dtype", "bf16"]) else {
        return;
    };
    assert_eq!(a.failed, 0, "nothing fails without an injected fault");
}

#[test]
fn two_processes_over_tcp_serve_the_workload_with_a_clean_audit() {
    let Some((a, _)) = run_checked(&["--transport", "tcp"]) else {
        return;
    };
    assert_eq!(a.failed, 0, "nothing fails without an injected fault");
}

#[test]
fn two_processes_over_unauthenticated_loopback_tcp_serve_the_workload_too() {
    // `--transport tcp` authenticates by default; `--no-auth` is the
    // loopback link without a key, which stays available for demos.
    let Some((a, _)) = run_checked(&["--transport", "tcp", "--no-auth"]) else {
        return;
    };
    assert_eq!(a.failed, 0, "nothing fails without an injected fault");
}

/// `--transport nixl`: the KV bytes cross between the two processes by
/// NIXL READ, the plans and receipts over authenticated TCP; the audit is
/// the same, and so is a corrupted receipt's fate.
#[test]
fn two_processes_over_nixl_serve_the_workload_with_a_clean_audit() {
    on_nixl!(|_| {
        let lib = crate::support::nixl::lib_path();
        let env = [(handoff::transfer::nixl::LIB_ENV, lib.as_os_str())];
        let Some((a, _)) = run_checked_with(&["--transport", "nixl"], &env) else {
            return;
        };
        assert_eq!(a.failed, 0, "nothing fails without an injected fault");
        let Some((a, lines)) =
            run_checked_with(&["--transport", "nixl", "--inject-corrupt-receipt"], &env)
        else {
            return;
        };
        assert_corrupt_receipt_failed(&a, &lines);
    });
}

/// Without its library, `--transport nixl` is a typed refusal naming the
/// fix, and the process exits with an error status, not nixl-sys's abort.
#[test]
fn nixl_without_its_library_is_a_typed_refusal_not_an_abort() {
    on_nixl!(|_| {
        let env = [(
            handoff::transfer::nixl::LIB_ENV,
            std::ffi::OsStr::new("/nonexistent/libnixl_capi.so"),
        )];
        let Some(out) = example_bin::run_with_env("disaggregated", &["--transport", "nixl"], &env)
        else {
            return;
        };
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(1),
            "an error exit, not a signal: {stderr}"
        );
        assert!(
            stderr.contains("NIXL is not available") && stderr.contains("install-nixl.sh"),
            "{stderr}"
        );
    });
}

/// `--backend cuda`: on a GPU (a build with the `cuda` feature), the same
/// workload and audit with every model on the device and KV pages in
/// device memory; without one, or without the feature, a refusal that says
/// why, with an error status, not a panic.
#[test]
fn the_gpu_backend_serves_the_workload_or_says_why_it_cannot() {
    let Some(out) = example_bin::run("disaggregated", &["--backend", "cuda"]) else {
        return;
    };
    if out.status.success() {
        let Some((a, _)) = run_checked(&["--backend", "cuda"]) else {
            return;
        };
        assert_eq!(a.failed, 0, "nothing fails without an injected fault");
        return;
    }
    example_bin::assert_gpu_refused(&out, 1);
}

#[test]
fn a_corrupted_receipt_fails_only_its_request_in_threads() {
    let Some((a, lines)) = run_checked(&["--inject-corrupt-receipt"]) else {
        return;
    };
    assert_corrupt_receipt_failed(&a, &lines);
}

#[test]
fn a_corrupted_receipt_fails_only_its_request_over_tcp() {
    let Some((a, lines)) = run_checked(&["--transport", "tcp", "--inject-corrupt-receipt"]) else {
        return;
    };
    assert_corrupt_receipt_failed(&a, &lines);
}

/// The pid of the prefill process `parent` started, once it exists and
/// holds its TCP connection to the decode process.
fn connected_prefill_child_of(parent: u32) -> Option<u32> {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while std::time::Instant::now() < until {
        for entry in std::fs::read_dir("/proc").ok()?.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
            // Field 4 of /proc/PID/stat (after the parenthesised name) is the parent.
            let ppid = stat
                .rsplit_once(") ")
                .and_then(|(_, rest)| rest.split(' ').nth(1))
                .and_then(|p| p.parse::<u32>().ok());
            let has_socket = || {
                std::fs::read_dir(entry.path().join("fd"))
                    .into_iter()
                    .flatten()
                    .flatten()
                    .any(|fd| {
                        std::fs::read_link(fd.path())
                            .is_ok_and(|l| l.to_string_lossy().starts_with("socket:"))
                    })
            };
            if ppid == Some(parent)
                && String::from_utf8_lossy(&cmdline).contains("--role-prefill-of")
                && has_socket()
            {
                return Some(pid);
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    None
}

/// The example's process, killed and reaped if a check fails first.
struct Running(Option<std::process::Child>);

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn a_prefill_process_killed_mid_run_fails_requests_typed_and_the_run_fails() {
    // A real SIGKILL of the prefill process, not the in-process simulation,
    // while every request is in flight (the process stalls after connecting):
    // each request still gets a typed outcome (never lost), the failures are
    // 502s, decode's pool is clean, and the run exits 1 saying the prefill
    // pool went unaudited.
    if !cfg!(target_os = "linux") {
        return;
    }
    let Some(bin) = example_bin::path("disaggregated") else {
        return;
    };
    let mut running = Running(Some(
        std::process::Command::new(&bin)
            .args(["--transport", "tcp", "--prefill-stall-ms", "5000"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    ));
    let parent = running.0.as_ref().unwrap().id();
    let prefill = connected_prefill_child_of(parent).expect("the prefill process connected");
    // Its socket is open; let the link's handshake finish (milliseconds)
    // well inside the 5 s stall, so the kill lands with requests in flight.
    std::thread::sleep(std::time::Duration::from_secs(1));
    match std::process::Command::new("kill")
        .args(["-9", &prefill.to_string()])
        .status()
    {
        Ok(s) => assert!(s.success(), "kill -9 {prefill}"),
        Err(e) => {
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "skipped: no `kill` command ({e})");
            return;
        }
    }
    let out = running.0.take().unwrap().wait_with_output().unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(stderr.contains("could not be audited"), "{stderr}");
    let mut lines: Vec<String> = stdout.lines().map(str::to_owned).collect();
    let a = parse_audit(&lines.pop().expect("an audit line"));
    assert_eq!(lines.len(), a.requests, "{stdout}");
    assert_eq!(a.requests, a.ok + a.rejected + a.cancelled + a.failed);
    assert!(!stdout.contains("LOST"), "{stdout}");
    assert_eq!(a.ok, 0, "nothing can finish without prefill: {stdout}");
    assert!(a.failed >= 1, "{stdout}");
    assert_eq!(
        (a.leaked_pages, a.held_pages, a.isolation_violations),
        (0, 0, 0)
    );
    for l in lines.iter().filter(|l| l.contains(": failed, HTTP ")) {
        assert!(l.contains("HTTP 502"), "a dead peer is a bad gateway: {l}");
    }
}
