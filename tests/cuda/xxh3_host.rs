//! The GPU checksum's hash, proven on a machine without a GPU.
//!
//! KV pages are trusted after a transfer only when their checksums match
//! the sender's (src/transfer/checksum.rs: xxh3-64, seed 0, of each K/V
//! region, then of the regions' hashes). A GPU that hashed pages with a
//! subtly different xxh3 would fail every transfer it checked, or worse,
//! agree with a sender that is itself wrong in the same way. The GPU code
//! (cuda/checksum.cu) runs the functions of cuda/xxh3.cuh, which are plain
//! C++: this test compiles that header into a host program with each C++
//! compiler it finds (g++/c++/clang++, and nvcc when `$NVCC` or `PATH` has
//! one) and requires the program's hashes to equal twox-hash's, bit for
//! bit, for every length class of xxh3 (0, 1-3, 4-8, 9-16, 17-128, 129-240,
//! one to many 1024-byte blocks, page-sized regions) at aligned and
//! unaligned offsets. The program hashes each range twice: stripe after
//! stripe, and split the way the GPU's warp splits a block (32 lanes of
//! half a stripe, summed), so the decomposition the kernel relies on is
//! checked too.
//!
//! A second test runs the kernels themselves (cuda/checksum.cuh: a warp
//! per range with its shuffle reduction, a block per page) on the host SIMT
//! emulator of tests/support/sim/ and checks ranges and per-page checksums, region
//! layout included, against twox-hash and src/transfer/checksum.rs's rule.
//!
//! Without any C++ compiler the tests print `SKIP` and pass.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use twox_hash::XxHash3_64;

const PROGRAM: &str = r#"
#include "xxh3.cuh"
#include <cstdio>
#include <vector>

int main(int argc, char** argv) {
    if (argc != 3) return 2;
    FILE* f = std::fopen(argv[1], "rb");
    if (!f) return 3;
    std::vector<uint8_t> data;
    int c;
    while ((c = std::fgetc(f)) != EOF) data.push_back((uint8_t)c);
    std::fclose(f);
    FILE* r = std::fopen(argv[2], "r");
    if (!r) return 4;
    unsigned long long off, len;
    while (std::fscanf(r, "%llu %llu", &off, &len) == 2) {
        if (off + len > data.size()) return 5;
        const uint8_t* p = data.data() + off;
        unsigned long long scalar = handoff::xxh3::hash64(p, len);
        unsigned long long split = len <= 240
            ? handoff::xxh3::hash_short(p, len)
            : handoff::xxh3::hash_long(p, len, handoff::xxh3::LaneSplitDelta{});
        std::printf("%016llx %016llx\n", scalar, split);
    }
    std::fclose(r);
    return 0;
}
"#;

use crate::support::sim_host as host;

/// (name, compiler, extra args): one C++ host compiler, and nvcc if any.
fn compilers() -> Vec<(&'static str, PathBuf, Vec<&'static str>)> {
    let mut found = Vec::new();
    if let Some(cxx) = host::cxx() {
        found.push(("c++", cxx, vec!["-x", "c++"]));
    }
    let nvcc = std::env::var_os("NVCC")
        .map(PathBuf::from)
        .filter(|p| p.is_file())
        .or_else(|| host::on_path("nvcc"));
    if let Some(nvcc) = nvcc {
        // Host compilation of the same header as a .cu file: the functions
        // are __host__ __device__ there, as in the kernels.
        found.push(("nvcc", nvcc, vec!["-x", "cu"]));
    }
    found
}

fn build(name: &str, compiler: &Path, args: &[&str], dir: &Path) -> PathBuf {
    let src = dir.join("xxh3_main.cpp");
    std::fs::write(&src, PROGRAM).unwrap();
    let exe = dir.join(format!("xxh3_{name}"));
    let include = concat!(env!("CARGO_MANIFEST_DIR"), "/cuda");
    // nvcc links the CUDA runtime (which registers the header's __constant__
    // secret); a pip-installed nvcc keeps it in ../lib, a toolkit in ../lib64.
    let mut lib_dirs = Vec::new();
    if let Some(root) = compiler.parent().and_then(Path::parent) {
        for lib in ["lib", "lib64"] {
            let dir = root.join(lib);
            if name == "nvcc" && dir.is_dir() {
                lib_dirs.push("-L".into());
                lib_dirs.push(dir.into_os_string());
            }
        }
    }
    let out = Command::new(compiler)
        .args(args)
        .args(&lib_dirs)
        .arg(&src)
        .args(["-O1", "-std=c++17", "-I", include, "-o"])
        .arg(&exe)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{name} could not compile cuda/xxh3.cuh:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}

/// Every length up to 300 (all short paths and the first long ones), block
/// boundaries, several blocks, and K/V regions of real page sizes (16 and 64
/// slots of 8 KV heads x 128 dims in bf16), at offsets 0 and 3.
fn ranges(data_len: usize) -> Vec<(usize, usize)> {
    let mut lens: Vec<usize> = (0..=300).collect();
    lens.extend([
        319,
        320,
        321,
        1023,
        1024,
        1025,
        1087,
        1088,
        1089,
        2047,
        2048,
        2049,
        3000,
        4096,
        10_000,
        16 * 2048,
        16 * 2048 + 5,
        64 * 2048,
    ]);
    let mut out = Vec::new();
    for (i, &len) in lens.iter().enumerate() {
        for off in [0, 3 + i % 13] {
            if off + len <= data_len {
                out.push((off, len));
            }
        }
    }
    out
}

/// SplitMix64 bytes: every bit of input matters.
fn random_bytes(n: usize) -> Vec<u8> {
    let mut state = 0x5EED_u64;
    (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            (z ^ (z >> 31)) as u8
        })
        .collect()
}

#[test]
fn the_gpu_xxh3_header_hashes_exactly_as_the_transfer_layer() {
    let compilers = compilers();
    if compilers.is_empty() {
        let _ = writeln!(
            std::io::stderr(),
            "SKIP the_gpu_xxh3_header_hashes_exactly_as_the_transfer_layer: no C++ compiler \
             (c++, g++, clang++ or nvcc) found"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = random_bytes(64 * 2048 + 64);
    let data_path = dir.path().join("data.bin");
    std::fs::write(&data_path, &data).unwrap();
    let ranges = ranges(data.len());
    let list: String = ranges.iter().map(|(o, l)| format!("{o} {l}\n")).collect();
    let ranges_path = dir.path().join("ranges.txt");
    std::fs::write(&ranges_path, list).unwrap();

    for (name, compiler, args) in compilers {
        let exe = build(name, &compiler, &args, dir.path());
        let out = Command::new(&exe)
            .arg(&data_path)
            .arg(&ranges_path)
            .output()
            .unwrap();
        assert!(out.status.success(), "{name} program failed: {out:?}");
        let text = String::from_utf8(out.stdout).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), ranges.len(), "{name}: one line per range");
        for (&(off, len), line) in ranges.iter().zip(&lines) {
            let want = XxHash3_64::oneshot(&data[off..off + len]);
            let (scalar, split) = line.split_once(' ').unwrap();
            let scalar = u64::from_str_radix(scalar, 16).unwrap();
            let split = u64::from_str_radix(split, 16).unwrap();
            assert_eq!(
                scalar, want,
                "{name}: stripe-by-stripe, {len} bytes at {off}"
            );
            assert_eq!(split, want, "{name}: warp split, {len} bytes at {off}");
        }
        let _ = writeln!(
            std::io::stderr(),
            "{name} ({}): {} ranges equal to twox-hash",
            compiler.display(),
            ranges.len()
        );
    }
}

#[test]
fn the_gpu_checksum_kernels_on_a_simt_emulator_hash_as_the_transfer_layer() {
    let Some(cxx) = host::cxx() else {
        let _ = writeln!(
            std::io::stderr(),
            "SKIP the_gpu_checksum_kernels_on_a_simt_emulator_hash_as_the_transfer_layer: no C++ \
             compiler (c++, g++ or clang++) found"
        );
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let exe = host::build_emulated(&cxx, "checksum_main.cpp", dir.path());

    // The bytes are also the KV arena: 3 layers, pages of 16 slots, rows of
    // 256 bytes (2 KV heads x 64 dims in bf16): 24 KiB a page, 8 pages.
    let (n_layers, page_size, row) = (3usize, 16usize, 256usize);
    let page_bytes = n_layers * 2 * page_size * row;
    let data = random_bytes(8 * page_bytes);
    let mut ranges: Vec<(usize, usize)> = (0..=260).map(|len| (len % 7, len)).collect();
    ranges.extend([
        (0, 1024),
        (8, 1025),
        (3, 2049),
        (0, 4096),
        (5, 16 * 256 + 1),
    ]);
    ranges.push((0, page_bytes)); // a whole page: 24 blocks of 1024 bytes
    // Scattered pages: full, partial, one row, none, full.
    let pages = [(5usize, 16usize), (0, 9), (3, 1), (6, 0), (2, 16)];

    let data_path = dir.path().join("data.bin");
    std::fs::write(&data_path, &data).unwrap();
    let ranges_path = dir.path().join("ranges.txt");
    let list: String = ranges.iter().map(|(o, l)| format!("{o} {l}\n")).collect();
    std::fs::write(&ranges_path, list).unwrap();
    let pages_path = dir.path().join("pages.txt");
    let list: String = pages.iter().map(|(p, t)| format!("{p} {t}\n")).collect();
    std::fs::write(&pages_path, list).unwrap();
    let run = Command::new(&exe)
        .arg(&data_path)
        .arg(&ranges_path)
        .arg(&pages_path)
        .args([page_bytes, n_layers, page_size, row].map(|x| x.to_string()))
        .output()
        .unwrap();
    assert!(run.status.success(), "emulated kernels failed: {run:?}");
    let text = String::from_utf8(run.stdout).unwrap();
    let hex = |s: &str| u64::from_str_radix(s, 16).unwrap();
    let mut lines = text.lines();
    for &(off, len) in &ranges {
        let line = lines.next().expect("one R line per range");
        let got = hex(line.strip_prefix("R ").expect("an R line"));
        assert_eq!(
            got,
            XxHash3_64::oneshot(&data[off..off + len]),
            "xxh3_ranges: {len} bytes at {off}"
        );
    }
    for &(page, tokens) in &pages {
        let line = lines.next().expect("one P line per page");
        let fields: Vec<u64> = line
            .strip_prefix("P ")
            .expect("a P line")
            .split(' ')
            .map(hex)
            .collect();
        // src/transfer/checksum.rs: region (layer, K|V) = the first `tokens`
        // rows of that layer's K or V in the page; the page checksum is
        // xxh3-64 of the region hashes' little-endian bytes.
        let regions: Vec<u64> = (0..n_layers * 2)
            .map(|r| {
                let at = page * page_bytes + r * page_size * row;
                XxHash3_64::oneshot(&data[at..at + tokens * row])
            })
            .collect();
        let bytes: Vec<u8> = regions.iter().flat_map(|h| h.to_le_bytes()).collect();
        assert_eq!(fields[1..], regions[..], "page {page}: region hashes");
        assert_eq!(
            fields[0],
            XxHash3_64::oneshot(&bytes),
            "page {page}: checksum"
        );
    }
}
