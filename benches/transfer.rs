//! Transfer throughput of Llama-3-8B-shaped KV (32 layers, 8 KV heads of
//! 128, bf16: 128 KiB per token) for 1k/8k/32k-token prompts, side by side
//! with the plain baselines of the same bytes:
//!
//! - in-process transfer (plan to verified KV) vs one `memcpy`;
//! - TCP transfer on loopback vs a plain socket copy (1 MiB writes, one
//!   reader thread);
//! - checksum cost: xxh3 over the same bytes (the sender hashes every
//!   region once, the verifier once more over the landed bytes), as a share
//!   of the transfer's wall time.
//!
//! Configurations: TCP with `TransferConfig::default()` (1 MiB batches,
//! 64 MiB in flight); in-process with 256 KiB batches and 2 MiB in flight.
//!
//! Goals: >= 0.8 of memcpy in-process, >= 0.8 of the plain socket over TCP,
//! checksums < 10% of transfer time. Run: `cargo bench --bench transfer`
//! (`-- 1024` for one size). Needs about 4x the largest prompt's KV in
//! memory (16 GiB at 32k; sizes that do not fit are skipped, saying so).

use std::hint::black_box;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use handoff::transfer::{DecodeSide, InProcess, PrefillSide, Tcp, Transfer, TransferConfig};
use handoff::{
    AdmissionLimits, KvDtype, KvGeometry, KvPool, PoolConfig, Request, RequestId, TenantId,
};

const REPS: usize = 5;
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

fn socket_once(bytes: usize) -> Duration {
    let chunk = vec![0x5au8; 1 << 20];
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    let addr = listener.local_addr().expect("addr");
    let reader = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0;
        while got < bytes {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => got += n,
            }
        }
        Instant::now()
    });
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_nodelay(true).expect("nodelay");
    let t = Instant::now();
    let mut sent = 0;
    while sent < bytes {
        let n = chunk.len().min(bytes - sent);
        s.write_all(&chunk[..n]).expect("write");
        sent += n;
    }
    let end = reader.join().expect("reader");
    end - t
}

/// Sender plus verifier hashing of the same bytes, region by region
/// (one page of one layer of K or V at a time), from cold memory.
fn checksum_once(data: &[u8]) -> Duration {
    let region = PAGE * geometry().kv_dim() * 2;
    let t = Instant::now();
    for _pass in 0..2 {
        let mut acc = 0u64;
        for r in data.chunks(region) {
            acc ^= xxhash_rust::xxh3::xxh3_64(r);
        }
        black_box(acc);
    }
    t.elapsed()
}

/// In-process: small batches and a small window keep the sender's hashing
/// and the lander's copy of a batch within the last-level cache (measured
/// 15-25% faster than the defaults, which suit TCP's per-frame costs).
fn inproc_config() -> TransferConfig {
    TransferConfig::default()
        .with_max_batch_bytes(256 << 10)
        .with_max_in_flight_bytes(2 << 20)
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
        "transfer of Llama-3-8B-shaped KV ({} B/token), medians of {REPS} interleaved reps (3 above 1 GiB)",
        g.bytes_per_token()
    );
    println!(
        "{:>7} {:>9} | {:>9} {:>9} {:>6} | {:>9} {:>9} {:>6} | {:>9} {:>9}",
        "tokens",
        "MiB",
        "memcpy",
        "in-proc",
        "ratio",
        "socket",
        "tcp",
        "ratio",
        "cksum/ip",
        "cksum/tcp"
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
        let mut tcp = Pair::new(Tcp, TransferConfig::default(), tokens, &pools);
        // Warm-up: every page touched once.
        let _ = inproc.once(&src);
        let _ = tcp.once(&src);
        // Interleaved reps: a machine that speeds up or slows down affects
        // a transfer and its baseline alike; ratios are per rep.
        let reps = if bytes > (1 << 30) { 3 } else { REPS };
        let (mut m, mut i, mut s, mut t, mut c) = (vec![], vec![], vec![], vec![], vec![]);
        let (mut ri, mut rt, mut ci, mut ct) = (vec![], vec![], vec![], vec![]);
        for _ in 0..reps {
            let dm = memcpy_once(&copy_src, &mut copy_dst);
            let di = inproc.once(&src);
            let ds = socket_once(bytes);
            let dt = tcp.once(&src);
            let dc = checksum_once(&copy_src);
            for (v, d) in [(&mut m, dm), (&mut i, di), (&mut s, ds), (&mut t, dt)] {
                v.push(gbps(bytes, d));
            }
            c.push(dc.as_secs_f64());
            ri.push(dm.as_secs_f64() / di.as_secs_f64());
            rt.push(ds.as_secs_f64() / dt.as_secs_f64());
            ci.push(100.0 * dc.as_secs_f64() / di.as_secs_f64());
            ct.push(100.0 * dc.as_secs_f64() / dt.as_secs_f64());
        }
        println!(
            "{:>7} {:>9} | {:>7.2}GB/s {:>7.2}GB/s {:>6.2} | {:>7.2}GB/s {:>7.2}GB/s {:>6.2} | {:>8.1}% {:>8.1}%",
            tokens,
            bytes >> 20,
            median(m),
            median(i),
            median(ri),
            median(s),
            median(t),
            median(rt),
            median(ci),
            median(ct),
        );
    }
}
