//! The etcd the stories share, and the workers they register.

use std::process::Command;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};
use handoff::KvDtype;
use handoff::fingerprint::ModelFingerprint;
use handoff_cluster::{
    Deployment, Epoch, Membership, MembershipWatch, Registration, RegistrationConfig, Role,
    Transport, TrustedKeys, WorkerId, WorkerKey, WorkerRecord,
};

pub const MODEL: u64 = 0x5eed_0fa1;

/// The endpoint, or `None` (after printing `SKIP:`) where etcd cannot run.
pub fn endpoint() -> Option<String> {
    static ENDPOINT: OnceLock<Result<String, String>> = OnceLock::new();
    let got = ENDPOINT.get_or_init(|| match std::env::var("HANDOFF_ETCD") {
        Ok(e) if !e.is_empty() => Ok(e),
        _ => start_own(),
    });
    match got {
        Ok(e) => Some(e.clone()),
        Err(why) if std::env::var_os("HANDOFF_REQUIRE_ETCD").is_some_and(|v| v == "1") => {
            panic!("HANDOFF_REQUIRE_ETCD=1 but {why}")
        }
        Err(why) => {
            println!("SKIP: {why}");
            None
        }
    }
}

/// Starts an etcd that stops when this test process exits.
fn start_own() -> Result<String, String> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/etcd.sh");
    let out = Command::new("bash")
        .args([script, "start", "--owner", &std::process::id().to_string()])
        .env("HANDOFF_ETCD_NO_INSTALL", "1")
        .output()
        .map_err(|e| format!("cannot run {script}: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    stdout
        .split_whitespace()
        .find_map(|w| w.strip_prefix("HANDOFF_ETCD="))
        .map(str::to_string)
        .ok_or_else(|| {
            format!(
                "HANDOFF_ETCD is unset and scripts/etcd.sh could not start etcd ({}); install etcd-server",
                String::from_utf8_lossy(&out.stderr).trim()
            )
        })
}

pub async fn client(endpoint: &str) -> Client {
    let options = ConnectOptions::new().with_connect_timeout(Duration::from_secs(5));
    Client::connect([endpoint], Some(options))
        .await
        .unwrap_or_else(|e| panic!("connect to etcd at {endpoint}: {e}"))
}

/// A deployment name no other story (or earlier run) uses.
pub fn deployment(story: &str) -> Deployment {
    static N: AtomicU32 = AtomicU32::new(0);
    let name = format!(
        "{story}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    );
    Deployment::new(&name).unwrap_or_else(|e| panic!("{e}"))
}

pub fn key(b: u8) -> WorkerKey {
    WorkerKey::from_bytes([b; 32])
}

pub fn id(s: &str) -> WorkerId {
    WorkerId::new(s).unwrap_or_else(|e| panic!("{e}"))
}

pub fn record(role: Role, key_byte: u8) -> WorkerRecord {
    WorkerRecord {
        role,
        address: "127.0.0.1:7100".into(),
        transport: Transport::Tcp,
        public_key: key(key_byte),
        model: ModelFingerprint::from_u64(MODEL),
        pages_free: 100,
        pages_total: 128,
        queue_depth: 0,
        kv_dtype: KvDtype::F16,
        epoch: Epoch(0),
    }
}

pub async fn register(
    client: &Client,
    d: &Deployment,
    worker: &str,
    ttl_s: u64,
    r: WorkerRecord,
) -> Registration {
    let config = RegistrationConfig {
        deployment: d.clone(),
        worker: id(worker),
        ttl: Duration::from_secs(ttl_s),
    };
    Registration::register(client, &config, r)
        .await
        .unwrap_or_else(|e| panic!("register {worker}: {e}"))
}

/// A watch of `d` trusting the keys `trusted`.
pub async fn watch(client: &Client, d: &Deployment, trusted: &[u8]) -> MembershipWatch {
    let m = Membership::new(
        d,
        TrustedKeys::new(trusted.iter().map(|&b| key(b))),
        ModelFingerprint::from_u64(MODEL),
    );
    MembershipWatch::start(client, m)
        .await
        .unwrap_or_else(|e| panic!("watch: {e}"))
}

pub fn live_ids(m: &Membership) -> Vec<String> {
    m.live().map(|w| w.id.to_string()).collect()
}
