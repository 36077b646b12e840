//! Shared rig for the transfer stories: a prefill side and a decode side
//! over a transport, each with its own pool, driven with synthetic KV.

use handoff::RoleKind;
use std::time::{Duration, Instant};

use handoff::kv::StagedHostPages;
use handoff::transfer::{
    DecodeOutcome, DecodeSide, PrefillSide, Transfer, TransferConfig, TransferError, synthetic,
};
use handoff::{
    AdmissionLimits, KvDtype, KvGeometry, KvPool, PoolConfig, Request, RequestId, TenantId,
};

pub fn geometry(dtype: KvDtype) -> KvGeometry {
    KvGeometry {
        n_layers: 3,
        n_kv_heads: 2,
        head_dim: 8,
        dtype,
    }
}

pub struct Rig<T: Transfer> {
    pub prefill: PrefillSide<T::Prefill>,
    pub decode: DecodeSide<T::Decode>,
    pub prefill_pool: KvPool,
    pub decode_pool: KvPool,
}

pub struct RigSpec {
    pub dtype: KvDtype,
    pub prefill_page: usize,
    pub decode_page: usize,
    pub prefill_pages: usize,
    pub decode_pages: usize,
    pub prefill_window: usize,
    pub decode_window: usize,
}

impl Default for RigSpec {
    fn default() -> Self {
        RigSpec {
            dtype: KvDtype::BF16,
            prefill_page: 16,
            decode_page: 16,
            prefill_pages: 32,
            decode_pages: 32,
            prefill_window: 256,
            decode_window: 256,
        }
    }
}

/// Where the pools a rig builds keep their page bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pages {
    Host,
    /// Staged device pages that hash landed KV where it is.
    Device,
    /// Staged device pages that cannot hash: landed rows are read back.
    DeviceWithoutHashing,
}

thread_local! {
    static DEVICE_PAGES: std::cell::Cell<Pages> = const { std::cell::Cell::new(Pages::Host) };
}

fn with_pages<R>(pages: Pages, f: impl FnOnce() -> R) -> R {
    DEVICE_PAGES.with(|d| d.set(pages));
    let out = f();
    DEVICE_PAGES.with(|d| d.set(Pages::Host));
    out
}

/// Runs `f` with the page bytes of every pool the rig builds on this
/// thread behind [`StagedHostPages`]: device-resident storage, every access
/// a staged copy, and landed KV hashed where it is, as on a GPU.
pub fn with_device_pages<R>(f: impl FnOnce() -> R) -> R {
    with_pages(Pages::Device, f)
}

/// [`with_device_pages`] on a device that cannot hash: the pools read
/// landed rows back to check them.
pub fn with_device_pages_without_hashing<R>(f: impl FnOnce() -> R) -> R {
    with_pages(Pages::DeviceWithoutHashing, f)
}

/// A pool of `cfg`, in host memory or (inside [`with_device_pages`]) on
/// staged device pages.
pub fn pool(cfg: PoolConfig) -> KvPool {
    let bytes = || cfg.storage_bytes().unwrap();
    match DEVICE_PAGES.with(|d| d.get()) {
        Pages::Host => KvPool::new(cfg).unwrap(),
        Pages::Device => {
            KvPool::with_device_pages(cfg, Box::new(StagedHostPages::new(bytes()))).unwrap()
        }
        Pages::DeviceWithoutHashing => KvPool::with_device_pages(
            cfg,
            Box::new(StagedHostPages::new(bytes()).without_hashing()),
        )
        .unwrap(),
    }
}

pub fn rig<T: Transfer>(t: &T, cfg: TransferConfig, spec: RigSpec) -> Rig<T> {
    let g = geometry(spec.dtype);
    let prefill_pool = pool(PoolConfig::new(g, spec.prefill_page, spec.prefill_pages));
    let decode_pool = pool(PoolConfig::new(g, spec.decode_page, spec.decode_pages));
    rig_over(t, cfg, prefill_pool, decode_pool, &spec)
}

/// A rig over pools the story built (device pages it keeps handles on,
/// pools it can kill), admitting at `spec`'s windows and page sizes.
pub fn rig_over<T: Transfer>(
    t: &T,
    cfg: TransferConfig,
    prefill_pool: KvPool,
    decode_pool: KvPool,
    spec: &RigSpec,
) -> Rig<T> {
    let (pl, dl) = t.connect(&cfg).unwrap();
    let prefill = PrefillSide::new(
        pl,
        prefill_pool.clone(),
        AdmissionLimits::new(spec.prefill_window, spec.prefill_pages, spec.prefill_page),
        cfg.clone(),
    );
    let decode = DecodeSide::new(
        dl,
        decode_pool.clone(),
        AdmissionLimits::new(spec.decode_window, spec.decode_pages, spec.decode_page),
        cfg,
    );
    Rig {
        prefill,
        decode,
        prefill_pool,
        decode_pool,
    }
}

pub fn request(id: u64, tenant: u32, prompt_len: usize) -> Request {
    Request::new(RequestId(id), TenantId(tenant), vec![1; prompt_len], 4)
}

impl<T: Transfer> Rig<T> {
    /// Prefill takes the next plan, computes synthetic KV, sends it.
    pub fn serve_one(&mut self) -> Result<RequestId, TransferError> {
        let mut job = self.prefill.next_job_within(Duration::from_secs(5))?;
        let id = job.request();
        let n = job.prompt().len();
        synthetic::fill(job.seq_mut(), id, n)?;
        self.prefill.complete(job, Some(id.0 as u32)).map(|()| id)
    }

    /// Polls decode until `n` outcomes arrived (or 10 s passed).
    pub fn outcomes(&mut self, n: usize) -> Vec<DecodeOutcome> {
        let until = Instant::now() + Duration::from_secs(10);
        let mut out = Vec::new();
        while out.len() < n && Instant::now() < until {
            out.extend(self.decode.poll(Duration::from_millis(50)));
        }
        out
    }

    /// Lets prefill process decode's answers that have already arrived.
    pub fn settle(&mut self) {
        let _ = self.prefill.poll(Duration::from_millis(100));
    }

    /// Both pools back to full capacity, balanced, nothing held, no
    /// isolation violation. Prefill is polled until decode's answers have
    /// released every held transfer and both pools are full, up to
    /// [`DEADLINE`]: a loaded machine may deliver the last answer late, but
    /// never loses it. Every observation on the way must be balanced and free
    /// of isolation violations.
    pub fn assert_clean(&mut self) {
        let until = Instant::now() + DEADLINE;
        loop {
            let stats = [
                ("prefill", self.prefill_pool.stats()),
                ("decode", self.decode_pool.stats()),
            ];
            for (side, s) in &stats {
                assert!(s.balanced(), "{side} pool unbalanced: {s:?}");
                assert_eq!(s.isolation_violations, 0, "{side} isolation violations");
            }
            let clean =
                self.prefill.held_transfers() == 0 && stats.iter().all(|(_, s)| s.is_full());
            if clean || Instant::now() >= until {
                break;
            }
            if self.prefill.poll(Duration::from_millis(20)).is_err() {
                // The link has ended: nothing more will arrive, but a
                // writer thread may still be letting go of its pages.
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        for (side, pool) in [
            ("prefill", &self.prefill_pool),
            ("decode", &self.decode_pool),
        ] {
            let s = pool.stats();
            assert!(
                s.is_full(),
                "{side} pool not back to full within {DEADLINE:?}: {s:?}"
            );
        }
        assert_eq!(
            self.prefill.held_transfers(),
            0,
            "prefill still holds source pages {DEADLINE:?} after the test ended"
        );
        assert_eq!(
            self.decode.in_flight(),
            0,
            "decode still has transfers in flight"
        );
    }
}

/// How long a test waits for something that must happen: long enough that a
/// loaded 2-core machine never trips it, short enough that a hang fails.
pub const DEADLINE: Duration = Duration::from_secs(10);

/// Workers of one deployment: `n` worker keys, each trusting all of them.
/// Returns each worker's configuration (`base` with its identity) and id.
pub fn deployment(
    base: &TransferConfig,
    n: usize,
) -> Vec<(TransferConfig, handoff::transfer::PeerId)> {
    use handoff::transfer::{Allowlist, Identity, WorkerKey};
    let keys: Vec<WorkerKey> = (0..n).map(|_| WorkerKey::generate().unwrap()).collect();
    let trusted = Allowlist::of(keys.iter().map(|k| k.peer_id()));
    keys.into_iter()
        .map(|k| {
            let id = k.peer_id();
            let cfg = base
                .clone()
                .with_identity(Identity::new(k, trusted.clone()));
            (cfg, id)
        })
        .collect()
}

/// Calls `poll` until it reports that what the test waits for holds, or
/// panics naming `what` once [`DEADLINE`] has passed. `poll` makes one step
/// of progress (or sleeps briefly) and then observes.
pub fn wait_until(what: &str, mut poll: impl FnMut() -> bool) {
    let until = Instant::now() + DEADLINE;
    while !poll() {
        assert!(Instant::now() < until, "{what}: not within {DEADLINE:?}");
    }
}

/// Finds the outcome of `id`; panics if there is not exactly one.
pub fn outcome_of(
    outcomes: Vec<DecodeOutcome>,
    id: RequestId,
) -> (DecodeOutcome, Vec<DecodeOutcome>) {
    let (mine, rest): (Vec<_>, Vec<_>) = outcomes.into_iter().partition(|o| o.request == id);
    assert_eq!(mine.len(), 1, "expected exactly one outcome for {id}");
    (mine.into_iter().next().unwrap(), rest)
}

/// The tiny GQA model of the worker stories, seeded.
pub fn tiny_model(seed: u64) -> handoff::model::Model {
    use handoff::model::{Model, ModelConfig, random_weights};
    Model::cpu(random_weights(&ModelConfig::tiny_gqa(), seed)).unwrap()
}

/// A `role` configuration for [`tiny_model`]: a window of 64 tokens in a
/// pool of `pool` tokens.
pub fn tiny_worker_config<R: RoleKind>(pool: usize) -> handoff::EngineConfig<R> {
    use handoff::model::ModelConfig;
    handoff::EngineConfigBuilder::<R>::new(ModelConfig::tiny_gqa().kv_geometry(KvDtype::F32))
        .max_context(64)
        .pool_tokens(pool)
        .build()
        .unwrap()
}
