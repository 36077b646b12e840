//! Runs `handoff-server` on 127.0.0.1 (an ephemeral port) and talks to it
//! with `curl`, as a newcomer would.

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::support::server_bin;

/// A running server; killed on drop if it is still running.
pub struct Server {
    child: Child,
    stdout: BufReader<ChildStdout>,
    log: PathBuf,
    /// `http://127.0.0.1:PORT`
    pub base: String,
}

fn unique(tag: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    std::env::temp_dir().join(format!(
        "handoff-openai-{tag}-{}-{nanos}",
        std::process::id()
    ))
}

/// Whether `curl` can be run; tests that need it say so when it cannot.
pub fn have_curl() -> bool {
    let ok = Command::new("curl")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("skipped: curl is not installed");
    }
    ok
}

impl Server {
    /// Starts the server with `args` (plus `--port 0`) and waits for its
    /// `listening on` line (the model loaded). `None` when curl is missing
    /// (the reason is on stderr).
    pub fn start(args: &[&str]) -> Option<Server> {
        let mut server = Server::spawn(args)?;
        server.base = server.wait_listening();
        Some(server)
    }

    /// Starts the server with `args` (plus `--port 0`) and returns as soon
    /// as its port is bound, while the model may still be loading (the
    /// `bound` line of its log names the address). `None` when curl is
    /// missing.
    pub fn start_loading(args: &[&str]) -> Option<Server> {
        let mut server = Server::spawn(args)?;
        let until = Instant::now() + Duration::from_secs(60);
        server.base = loop {
            let log = server.log();
            let addr = log
                .lines()
                .find(|l| l.contains("bound: loading the model"))
                .and_then(|l| l.split_whitespace().find_map(|w| w.strip_prefix("addr=")));
            if let Some(addr) = addr {
                break format!("http://{addr}");
            }
            assert!(
                Instant::now() < until,
                "no `bound` line within 60 s; the log:\n{log}"
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        Some(server)
    }

    fn spawn(args: &[&str]) -> Option<Server> {
        if !have_curl() {
            return None;
        }
        let bin = server_bin();
        let log = unique("log");
        let log_file = std::fs::File::create(&log).expect("a log file in the temp dir");
        let mut child = Command::new(&bin)
            .args(args)
            .args(["--port", "0"])
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(log_file)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", bin.display()));
        let stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        Some(Server {
            child,
            stdout,
            log,
            base: String::new(),
        })
    }

    /// Blocks for the `listening on` line (the model is loaded and served)
    /// and returns its base URL.
    pub fn wait_listening(&mut self) -> String {
        let mut line = String::new();
        let n = self.stdout.read_line(&mut line).unwrap_or(0);
        line.trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| {
                panic!(
                    "the server did not start ({n} bytes: {line:?}); its log:\n{}",
                    self.log()
                )
            })
            .to_string()
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// The server's log so far (stderr).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends SIGTERM.
    pub fn sigterm(&self) {
        let ok = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -TERM failed");
    }

    /// Waits (at most `limit`) for the process to exit after a signal: its
    /// status and the rest of its stdout. Panics, with the log, if it does
    /// not exit.
    pub fn wait_exit(&mut self, limit: Duration) -> (ExitStatus, String) {
        let until = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                let mut rest = String::new();
                let _ = self.stdout.read_to_string(&mut rest);
                return (status, rest);
            }
            if Instant::now() > until {
                let _ = self.child.kill();
                panic!(
                    "the server did not exit within {limit:?}; its log:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `/metrics`, as text.
    pub fn metrics(&self) -> String {
        let r = curl(&[&self.url("/metrics")]);
        assert_eq!(r.status, 200, "{}", r.body);
        r.body
    }

    /// Polls `/metrics` until every pool has no page in use or held
    /// (`within`), and returns the last scrape.
    pub fn wait_pools_idle(&self, within: Duration) -> String {
        let until = Instant::now() + within;
        loop {
            let m = self.metrics();
            let busy: f64 = series(&m, "handoff_pool_pages")
                .iter()
                .filter(|(labels, _)| {
                    labels.contains("state=\"in_use\"") || labels.contains("state=\"held\"")
                })
                .map(|(_, v)| v)
                .sum();
            if busy == 0.0 || Instant::now() > until {
                return m;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_file(&self.log);
    }
}

/// One HTTP answer as curl saw it.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    /// Header lines, lowercased names.
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Answer {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
    /// The `data:` payloads of an event stream.
    pub fn events(&self) -> Vec<String> {
        self.body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(str::to_string)
            .collect()
    }
}

/// Runs `curl -sS -i ARGS` and splits its answer.
pub fn curl(args: &[&str]) -> Answer {
    let out = Command::new("curl")
        .args(["-sS", "-i", "--max-time", "120"])
        .args(args)
        .output()
        .expect("curl runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "curl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Answer {
        status,
        headers,
        body: body.to_string(),
    }
}

/// POSTs `body` as JSON to `path`, with a Bearer `key` if given.
pub fn post(server: &Server, path: &str, body: &Value, key: Option<&str>) -> Answer {
    let url = server.url(path);
    let data = body.to_string();
    let auth = key.map(|k| format!("Authorization: Bearer {k}"));
    let mut args = vec![
        url.as_str(),
        "-H",
        "content-type: application/json",
        "--data-binary",
        data.as_str(),
    ];
    if let Some(a) = &auth {
        args.extend(["-H", a.as_str()]);
    }
    curl(&args)
}

/// Every sample of the metric `name`: (its labels, its value).
pub fn series(metrics: &str, name: &str) -> Vec<(String, f64)> {
    metrics
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (key, value) = l.rsplit_once(' ')?;
            let (n, labels) = match key.split_once('{') {
                Some((n, rest)) => (n, rest.trim_end_matches('}')),
                None => (key, ""),
            };
            if n != name {
                return None;
            }
            Some((labels.to_string(), value.parse().ok()?))
        })
        .collect()
}

/// The sum of `name`'s samples whose labels include every one of `with`
/// (`key="value"` strings); 0 when there are none.
pub fn sample(metrics: &str, name: &str, with: &[&str]) -> f64 {
    series(metrics, name)
        .iter()
        .filter(|(labels, _)| with.iter().all(|w| labels.split(',').any(|l| l == *w)))
        .map(|(_, v)| v)
        .sum()
}
