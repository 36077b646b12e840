//! Shared by the hostile-template stories: the templates, and a server
//! start that must end (refused) rather than hang.

use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// 10^10 iterations (minijinja caps one `range` at 100,000 items), then a
/// plain rendering.
pub const LOOP_1E10: &str = "{% for i in range(100000) %}{% for j in range(100000) %}\
{% endfor %}{% endfor %}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}\
{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}";

/// A string doubled 40 times (a terabyte, were it built), then printed.
pub const DOUBLING: &str = "{% set ns = namespace(s='abcdefgh') %}{% for i in range(40) %}\
{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}";

/// The fixture's own template, unless a message is longer than the
/// loader's probes (100 characters): then 10^10 iterations.
pub const SLEEPER: &str = "{% for m in messages %}{% if m['content'] | length > 100 %}\
{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}\
{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endfor %}\
{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}";

/// Runs the server on a model folder whose chat template is `template`
/// and expects it to refuse to start: its exit status, its stderr and how
/// long it took. Panics if it is still running after a minute.
pub fn refused(template: &str) -> (ExitStatus, String, Duration) {
    let folder = crate::support::served_folder(Some(template));
    let log = folder.path().join("stderr.log");
    let started = Instant::now();
    let mut child = Command::new(crate::support::server_bin())
        .args(["--port", "0", "--model"])
        .arg(folder.path())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let stderr = std::fs::read_to_string(&log).unwrap_or_default();
            return (status, stderr, started.elapsed());
        }
        if started.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "the server still runs a minute after it was started on a hostile template:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// After a refusal, the same model with its own template serves.
pub fn the_fixture_still_serves() {
    use crate::support::openai_client::{Server, post};
    let folder = crate::support::served_folder(None);
    let Some(server) = Server::start(&["--model", folder.path().to_str().unwrap()]) else {
        return;
    };
    let a = post(
        &server,
        "/v1/chat/completions",
        &serde_json::json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        None,
    );
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(
        crate::support::openai_client::curl(&[&server.url("/health")]).status,
        200
    );
}
