//! Transfer throughput of Llama-3-8B-shaped KV (32 layers, 8 KV heads of
//! 128, bf16: 128 KiB per token) for 1k/8k/32k-token prompts, side by side
//! with plain baselines moving the same bytes from memory to memory:
//!
//! - in-process transfer (plan to verified KV) vs one `memcpy` of the same
//!   bytes between two buffers touched beforehand;
//! - TCP transfer on loopback vs a plain socket copy of the same bytes: 1 MiB
//!   writes from a source buffer, one reader thread reading straight into a
//!   destination buffer (both touched beforehand, like the pools' pages);
//! - authenticated TCP (`TcpAuth`: Noise IK handshake with worker keys, every frame
//!   sealed with AEGIS-128X4) vs the same TCP transport without identities, both
//!   in the same reps: `auth +%` is the time authentication adds to a
//!   transfer, per rep (goal: <= 10% at 8k tokens); `seal` is AEGIS-128X4
//!   alone (the `aegis` crate, as the link uses it) sealing then opening the same bytes
//!   in 1 MiB frames on one thread: the cryptography's own rate, and its
//!   time per side as a share of the plain TCP transfer (`seal %`: the
//!   sender seals and the receiver opens on their own threads, in parallel,
//!   so this is about what a quiet machine adds);
//! - NIXL (`--features nixl`, `$HANDOFF_NIXL_LIB` from
//!   `scripts/install-nixl.sh`): the KV bytes by NIXL READ (UCX, loopback
//!   device; shared memory between the ends where UCX offers it) from the
//!   prefill pool's held pages straight into the decode pool's destination
//!   pages, plans and receipts on authenticated TCP, in
//!   the same reps: `nixl/tcp` and `nixl/auth` are the TCP transfer's time
//!   over NIXL's, per rep (goal: >= 1.0 against TCP);
//! - checksum cost, as a share of each transfer's wall time, from the same
//!   bytes copied region by region (32 KiB: one page of one layer of K or V)
//!   on one thread: `lander` is what hashing adds to the landing thread's
//!   copy as the code does it (each region hashed from the destination
//!   right after its copy): the checksum cost on the transfer's critical
//!   path; `sender` is the sender's hash of each source
//!   region, which runs on the prefill side's own thread, in parallel with
//!   the landing; `fused` is both hashes and the copy on one thread, each
//!   region hashed whole before and after its copy (the figure reported up
//!   to round 3: an upper bound, as if nothing ran in parallel).
//!
//! Configurations: in-process with 256 KiB batches and 2 MiB in flight (or
//! `HANDOFF_BENCH_INPROC_BATCH` / `HANDOFF_BENCH_INPROC_IN_FLIGHT` bytes); TCP
//! with `TransferConfig::default()` (1 MiB batches, 64 MiB in flight), or
//! batches of `HANDOFF_BENCH_TCP_BATCH` bytes.
//!
//! Goals: >= 0.8 of memcpy in-process, >= 0.8 of the plain socket over TCP,
//! checksums < 10% of transfer time. Run: `cargo bench --bench transfer`
//! (`-- 1024` for one size). Needs about 4x the largest prompt's KV in
//! memory (16 GiB at 32k; sizes that do not fit are skipped, saying so).

use std::hint::black_box;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use handoff::transfer::{
    DecodeSide, InProcess, PrefillSide, Tcp, TcpAuth, Transfer, TransferConfig,
};
use handoff::{
    AdmissionLimits, KvDtype, KvGeometry, KvPool, PoolConfig, Request, RequestId, TenantId,
};

const REPS: usize = 9;
const PAGE: usize = 16;

fn geometry() -> KvGeometry {
    KvGeometry {
        n_layers: 32,
        n_kv_heads: 8,
        head_dim: 128,
        dtype: KvDtype::BF16,
    }
}

fn gbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Pseudo-random bytes (xorshift), cheap to make.
fn random_bytes(out: &mut [u8], seed: u64) {
    let mut x = seed | 1;
    for chunk in out.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

fn memcpy_once(src: &[u8], dst: &mut [u8]) -> Duration {
    let t = Instant::now();
    dst.copy_from_slice(black_box(src));
    black_box(&dst);
    t.elapsed()
}

/// A plain loopback socket copy of `src` into `dst` (1 MiB writes, one
/// reader thread reading straight into `dst`): the same bytes, from memory
/// to memory, as a transfer moves from source pages to destination pages.
fn socket_once(src: &[u8], dst: &mut [u8]) -> Duration {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    let addr = listener.local_addr().expect("addr");
    std::thread::scope(|scope| {
        let reader = scope.spawn(move || {
            let (mut s, _) = listener.accept().expect("accept");
            let mut got = 0;
            while got < dst.len() {
                match s.read(&mut dst[got..]) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => got += n,
                }
            }
            Instant::now()
        });
        let mut s = TcpStream::connect(addr).expect("connect");
        s.set_nodelay(true).expect("nodelay");
        let t = Instant::now();
        for chunk in src.chunks(1 << 20) {
            s.write_all(chunk).expect("write");
        }
        let end = reader.join().expect("reader");
        end - t
    })
}

/// Seals and opens `buf` in 1 MiB frames with AEGIS-128X4 (the `aegis`
/// crate, as the authenticated link does); returns the time per side (half
/// the total).
fn seal_once(buf: &mut [u8]) -> Duration {
    use aegis::aegis128x4::Aegis128X4;
    let key = [7u8; 16];
    let header = [0u8; 16];
    let nonce = |i: usize| {
        let mut n = [0u8; 16];
        n[8..].copy_from_slice(&(i as u64).to_be_bytes());
        n
    };
    let mut tags = Vec::new();
    let t = Instant::now();
    for (i, frame) in buf.chunks_mut(1 << 20).enumerate() {
        tags.push(Aegis128X4::<16>::new(&key, &nonce(i)).encrypt_in_place(frame, &header));
    }
    for (i, (frame, tag)) in buf.chunks_mut(1 << 20).zip(&tags).enumerate() {
        Aegis128X4::<16>::new(&key, &nonce(i))
            .decrypt_in_place(frame, tag, &header)
            .expect("open");
        black_box(&frame[0]);
    }
    t.elapsed() / 2
}

/// Times of the checksum models over `src` copied into `dst` region by
/// region (one page of one layer of K or V, 32 KiB), one thread.
struct ChecksumTimes {
    /// The copy alone.
    copy: Duration,
    /// The landing thread's loop: each region hashed from the destination
    /// right after its copy.
    lander: Duration,
    /// The sender's loop: one hash per source region.
    sender: Duration,
    /// Each region hashed before its copy and after it landed.
    fused: Duration,
    /// AEGIS-128X4 per side over the same bytes (see [`seal_once`]).
    seal: Duration,
}

fn checksum_once(src: &[u8], dst: &mut [u8]) -> ChecksumTimes {
    let region = PAGE * geometry().kv_dim() * 2;
    let hash = twox_hash::XxHash3_64::oneshot;
    let t = Instant::now();
    for (s, d) in src.chunks(region).zip(dst.chunks_mut(region)) {
        d.copy_from_slice(s);
    }
    black_box(&dst);
    let copy = t.elapsed();
    let mut acc = 0u64;
    let t = Instant::now();
    for (s, d) in src.chunks(region).zip(dst.chunks_mut(region)) {
        d.copy_from_slice(s);
        acc ^= hash(d);
    }
    let lander = t.elapsed();
    let t = Instant::now();
    for s in src.chunks(region) {
        acc ^= hash(s);
    }
    let sender = t.elapsed();
    let t = Instant::now();
    for (s, d) in src.chunks(region).zip(dst.chunks_mut(region)) {
        acc ^= hash(s);
        d.copy_from_slice(s);
        acc ^= hash(d);
    }
    let fused = t.elapsed();
    black_box(acc);
    let seal = seal_once(dst);
    ChecksumTimes {
        copy,
        lander,
        sender,
        fused,
        seal,
    }
}

/// In-process: small batches and a small window keep the sender's hashing
/// and the lander's copy of a batch within the last-level cache (measured
/// 15-25% faster than the defaults, which suit TCP's per-frame costs).
fn inproc_config() -> TransferConfig {
    let env = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    TransferConfig::default()
        .with_max_batch_bytes(env("HANDOFF_BENCH_INPROC_BATCH", 256 << 10))
        .with_max_in_flight_bytes(env("HANDOFF_BENCH_INPROC_IN_FLIGHT", 2 << 20))
        .with_receipt_timeout(RECEIPT_TIMEOUT)
}

/// The receipt's deadline runs from the decode end's admission, before the
/// source fill: at 32k tokens (4 GiB) on a machine near its memory the
/// first fill alone took over the default 30 s.
const RECEIPT_TIMEOUT: Duration = Duration::from_secs(300);

/// TCP: `TransferConfig::default()`, or batches of
/// `HANDOFF_BENCH_TCP_BATCH` bytes.
fn tcp_config() -> TransferConfig {
    let batch = std::env::var("HANDOFF_BENCH_TCP_BATCH")
        .ok()
        .and_then(|v| v.parse().ok());
    let cfg = TransferConfig::default().with_receipt_timeout(RECEIPT_TIMEOUT);
    match batch {
        Some(b) => cfg.with_max_batch_bytes(b),
        None => cfg,
    }
}

struct Pools {
    prefill: KvPool,
    decode: KvPool,
}

/// A prefill side and a decode side over one transport.
struct Pair<T: Transfer> {
    prefill: PrefillSide<T::Prefill>,
    decode: DecodeSide<T::Decode>,
    tokens: usize,
    next_id: u64,
}

impl<T: Transfer> Pair<T> {
    fn new(t: T, cfg: TransferConfig, tokens: usize, pools: &Pools) -> Self {
        let (pl, dl) = t.connect(&cfg).expect("connect");
        let window = tokens + PAGE;
        let prefill = PrefillSide::new(
            pl,
            pools.prefill.clone(),
            AdmissionLimits::new(window, pools.prefill.capacity(), PAGE),
            cfg.clone(),
        );
        let decode = DecodeSide::new(
            dl,
            pools.decode.clone(),
            AdmissionLimits::new(window, pools.decode.capacity(), PAGE),
            cfg,
        );
        Pair {
            prefill,
            decode,
            tokens,
            next_id: 0,
        }
    }

    /// One transfer: plan to verified KV, the source fill excluded.
    fn once(&mut self, src: &[u8]) -> Duration {
        let g = geometry();
        self.next_id += 1;
        let layer_bytes = self.tokens * g.kv_dim() * 2;
        let req = Request::new(
            RequestId(self.next_id),
            TenantId(1),
            vec![1; self.tokens],
            1,
        );
        let _ = self.decode.submit(req).expect("admitted");
        let mut job = self.prefill.next_job().expect("plan");
        for layer in 0..g.n_layers {
            let k = &src[layer * layer_bytes % (src.len() - layer_bytes)..][..layer_bytes];
            job.seq_mut().append_bytes(layer, k, k).expect("fill");
        }
        let t0 = Instant::now();
        self.prefill.complete(job, None).expect("sent");
        let verified = loop {
            if let Some(o) = self.decode.poll(Duration::from_secs(60)).pop() {
                break o.result.expect("verified");
            }
        };
        let d = t0.elapsed();
        drop(verified);
        self.prefill.poll(Duration::from_millis(20)).expect("ack");
        d
    }
}

/// Per-rep figures: throughputs, ratios to the baselines, and the time
/// checksums add (lander, sender, fused) as a share of each transfer.
#[derive(Default)]
struct Rates {
    memcpy: Vec<f64>,
    inproc: Vec<f64>,
    socket: Vec<f64>,
    tcp: Vec<f64>,
    auth: Vec<f64>,
    ratio_inproc: Vec<f64>,
    ratio_tcp: Vec<f64>,
    /// Time authentication adds to a TCP transfer, % of the plain one.
    auth_cost: Vec<f64>,
    /// AEGIS-128X4 alone: GB/s per side, and its time per side as a % of
    /// the plain TCP transfer.
    seal: Vec<f64>,
    seal_share: Vec<f64>,
    /// `[lander, sender, fused]` shares of the in-process / TCP transfer.
    share_inproc: [Vec<f64>; 3],
    share_tcp: [Vec<f64>; 3],
}

impl Rates {
    fn push(&mut self, bytes: usize, [dm, di, ds, dt, da]: [Duration; 5], c: &ChecksumTimes) {
        let secs = |d: Duration| d.as_secs_f64();
        self.memcpy.push(gbps(bytes, dm));
        self.inproc.push(gbps(bytes, di));
        self.socket.push(gbps(bytes, ds));
        self.tcp.push(gbps(bytes, dt));
        self.auth.push(gbps(bytes, da));
        self.auth_cost
            .push(100.0 * (secs(da) - secs(dt)) / secs(dt));
        self.seal.push(gbps(bytes, c.seal));
        self.seal_share.push(100.0 * secs(c.seal) / secs(dt));
        self.ratio_inproc.push(secs(dm) / secs(di));
        self.ratio_tcp.push(secs(ds) / secs(dt));
        let added = [
            c.lander.saturating_sub(c.copy),
            c.sender,
            c.fused.saturating_sub(c.copy),
        ];
        for (i, d) in added.into_iter().enumerate() {
            self.share_inproc[i].push(100.0 * secs(d) / secs(di));
            self.share_tcp[i].push(100.0 * secs(d) / secs(dt));
        }
    }
}

/// One NIXL transfer per call, or why NIXL cannot run here.
type Once = Box<dyn FnMut(&[u8]) -> Duration>;

#[cfg(feature = "nixl")]
fn nixl_pair(tokens: usize, pools: &Pools) -> Result<Once, String> {
    handoff::transfer::nixl::available().map_err(|e| e.to_string())?;
    let mut p = Pair::new(handoff::transfer::Nixl, tcp_config(), tokens, pools);
    Ok(Box::new(move |src| p.once(src)))
}

#[cfg(not(feature = "nixl"))]
fn nixl_pair(_: usize, _: &Pools) -> Result<Once, String> {
    Err("built without the nixl feature (cargo bench --features nixl --bench transfer)".into())
}

fn mem_available() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

fn main() {
    let sizes: Vec<usize> = match std::env::args().skip(1).find_map(|a| a.parse().ok()) {
        Some(n) => vec![n],
        None => vec![1024, 8192, 32768],
    };
    let g = geometry();
    println!(
        "transfer of Llama-3-8B-shaped KV ({} B/token), medians of {REPS} interleaved reps (3 above 1 GiB), ratios per rep",
        g.bytes_per_token()
    );
    println!(
        "{:>7} {:>6} | {:>9} {:>9} {:>5} | {:>9} {:>9} {:>5} | {:>9} {:>6} {:>9} {:>6} | {:>13} {:>13} {:>13}",
        "tokens",
        "MiB",
        "memcpy",
        "in-proc",
        "ratio",
        "socket",
        "tcp",
        "ratio",
        "tcp+auth",
        "auth+%",
        "seal",
        "seal%",
        "lander ip/tcp",
        "sender ip/tcp",
        "fused ip/tcp"
    );
    for tokens in sizes {
        let bytes = tokens * g.bytes_per_token();
        if mem_available().is_some_and(|m| m < 4 * bytes + (512 << 20)) {
            println!(
                "{tokens:>7} skipped: needs {} MiB of free memory",
                (4 * bytes) >> 20
            );
            continue;
        }
        let mut copy_src = vec![0u8; bytes];
        random_bytes(&mut copy_src, 7);
        let mut copy_dst = vec![0u8; bytes];
        copy_dst.copy_from_slice(&copy_src); // touch every page first
        let pages = tokens.div_ceil(PAGE) + 1;
        let pools = Pools {
            prefill: KvPool::new(PoolConfig::new(g, PAGE, pages)).expect("pool"),
            decode: KvPool::new(PoolConfig::new(g, PAGE, pages + 1)).expect("pool"),
        };
        let mut src = vec![0u8; tokens * g.kv_dim() * 2 * 2];
        random_bytes(&mut src, tokens as u64);
        let mut inproc = Pair::new(InProcess, inproc_config(), tokens, &pools);
        let mut tcp = Pair::new(Tcp, tcp_config(), tokens, &pools);
        let mut auth = Pair::new(TcpAuth, tcp_config(), tokens, &pools);
        let mut nixl = nixl_pair(tokens, &pools);
        // Warm-up: every page touched once.
        let _ = inproc.once(&src);
        let _ = tcp.once(&src);
        let _ = auth.once(&src);
        if let Ok(n) = nixl.as_mut() {
            let _ = n(&src);
        }
        let (mut nixl_rate, mut nixl_tcp, mut nixl_auth) = (Vec::new(), Vec::new(), Vec::new());
        // Interleaved reps: a machine that speeds up or slows down affects
        // a transfer and its baseline alike; ratios are per rep.
        let reps = if bytes > (1 << 30) { 3 } else { REPS };
        let mut m = Rates::default();
        for _ in 0..reps {
            let dm = memcpy_once(&copy_src, &mut copy_dst);
            let di = inproc.once(&src);
            let ds = socket_once(&copy_src, &mut copy_dst);
            let dt = tcp.once(&src);
            let da = auth.once(&src);
            if let Ok(n) = nixl.as_mut() {
                let dn = n(&src);
                nixl_rate.push(gbps(bytes, dn));
                nixl_tcp.push(dt.as_secs_f64() / dn.as_secs_f64());
                nixl_auth.push(da.as_secs_f64() / dn.as_secs_f64());
            }
            let c = checksum_once(&copy_src, &mut copy_dst);
            m.push(bytes, [dm, di, ds, dt, da], &c);
        }
        let [lander_ip, sender_ip, fused_ip] = m.share_inproc;
        let [lander_tcp, sender_tcp, fused_tcp] = m.share_tcp;
        println!(
            "{:>7} {:>6} | {:>5.2}GB/s {:>5.2}GB/s {:>5.2} | {:>5.2}GB/s {:>5.2}GB/s {:>5.2} | {:>5.2}GB/s {:>5.1}% {:>5.2}GB/s {:>5.1}% | {:>5.1}% {:>5.1}% {:>5.1}% {:>5.1}% {:>5.1}% {:>5.1}%",
            tokens,
            bytes >> 20,
            median(m.memcpy),
            median(m.inproc),
            median(m.ratio_inproc),
            median(m.socket),
            median(m.tcp),
            median(m.ratio_tcp),
            median(m.auth),
            median(m.auth_cost),
            median(m.seal),
            median(m.seal_share),
            median(lander_ip),
            median(lander_tcp),
            median(sender_ip),
            median(sender_tcp),
            median(fused_ip),
            median(fused_tcp),
        );
        match &nixl {
            Ok(_) => println!(
                "{:>7} {:>6} | nixl {:>5.2}GB/s  nixl/tcp {:>5.2}  nixl/auth {:>5.2}",
                tokens,
                bytes >> 20,
                median(nixl_rate),
                median(nixl_tcp),
                median(nixl_auth),
            ),
            Err(why) => println!("{tokens:>7} {:>6} | nixl skipped: {why}", bytes >> 20),
        }
    }
}
