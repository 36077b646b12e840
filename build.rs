//! Build script. Without the `cuda` feature it does nothing.
//!
//! With it, every `cuda/*.cu` is compiled by nvcc into a fatbin in OUT_DIR
//! (SASS for sm_80 and sm_90 plus compute_90 PTX for newer GPUs), and
//! `OUT_DIR/kernels.rs` lists them for `include_bytes!`. nvcc is looked up
//! in `$NVCC`, `$CUDA_HOME/bin`, `$CUDA_PATH/bin`, then `PATH`;
//! `scripts/install-nvcc.sh` installs one from PyPI.

use std::env;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    if let Err(msg) = build_kernels() {
        // One line per message line: cargo prints each `cargo::error`.
        for line in msg.lines() {
            println!("cargo::error={line}");
        }
    }
}

const NVCC_FLAGS: &[&str] = &[
    "--fatbin",
    "-O3",
    "-std=c++17",
    // Compressed images (the driver inflates them at load): the kernels
    // are embedded in every binary, and a GPU bundle must stay small.
    "-Xfatbin=-compress-all",
    "-gencode",
    "arch=compute_80,code=sm_80",
    "-gencode",
    "arch=compute_90,code=sm_90",
    "-gencode",
    "arch=compute_90,code=compute_90",
];

fn build_kernels() -> Result<(), String> {
    for var in ["NVCC", "CUDA_HOME", "CUDA_PATH", "PATH"] {
        println!("cargo::rerun-if-env-changed={var}");
    }
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").map_err(|e| e.to_string())?);
    let out = PathBuf::from(env::var("OUT_DIR").map_err(|e| e.to_string())?);
    let src_dir = manifest.join("cuda");
    // A new or removed file changes the directory's mtime.
    println!("cargo::rerun-if-changed={}", src_dir.display());

    let mut sources = Vec::new();
    let entries = std::fs::read_dir(&src_dir)
        .map_err(|e| format!("cannot read {}: {e}", src_dir.display()))?;
    for entry in entries {
        let path = entry.map_err(|e| e.to_string())?.path();
        match path.extension().and_then(|e| e.to_str()) {
            Some("cu") => {
                println!("cargo::rerun-if-changed={}", path.display());
                sources.push(path);
            }
            Some("cuh") => println!("cargo::rerun-if-changed={}", path.display()),
            _ => {}
        }
    }
    sources.sort();

    let nvcc = find_nvcc()?.ok_or_else(|| {
        "the `cuda` feature needs nvcc (CUDA 13.0) to compile the kernels in cuda/, and none was found \
         in $NVCC, $CUDA_HOME/bin, $CUDA_PATH/bin or PATH.\n\
         Install one without a GPU or root: `eval \"$(scripts/install-nvcc.sh)\"`, \
         or set NVCC=/path/to/nvcc; or build without `--features cuda`."
            .to_string()
    })?;

    // Compile all sources in parallel: nvcc is single-threaded per file.
    let mut jobs: Vec<(String, PathBuf, Child)> = Vec::new();
    for src in &sources {
        let stem = src
            .file_stem()
            .and_then(|s| s.to_str())
            .ok_or_else(|| format!("odd file name {}", src.display()))?
            .to_string();
        let fatbin = out.join(format!("{stem}.fatbin"));
        let child = Command::new(&nvcc)
            .args(NVCC_FLAGS)
            .arg("-I")
            .arg(&src_dir)
            .arg("-o")
            .arg(&fatbin)
            .arg(src)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", nvcc.display()))?;
        jobs.push((stem, fatbin, child));
    }
    let mut failures = String::new();
    let mut listing = String::from(
        "/// Kernel images compiled by build.rs: (source stem, fatbin bytes).\n\
         pub(crate) const FATBINS: &[(&str, &[u8])] = &[\n",
    );
    for (stem, fatbin, child) in jobs {
        let output = child
            .wait_with_output()
            .map_err(|e| format!("nvcc for {stem}.cu: {e}"))?;
        if !output.status.success() {
            failures.push_str(&format!(
                "nvcc failed on cuda/{stem}.cu ({}):\n{}{}",
                output.status,
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ));
            continue;
        }
        listing.push_str(&format!(
            "    ({stem:?}, include_bytes!({:?})),\n",
            fatbin.display().to_string()
        ));
    }
    if !failures.is_empty() {
        return Err(failures);
    }
    listing.push_str("];\n");
    std::fs::write(out.join("kernels.rs"), listing).map_err(|e| e.to_string())?;
    Ok(())
}

/// `$NVCC` (which must then exist), `$CUDA_HOME/bin`, `$CUDA_PATH/bin`, `PATH`.
fn find_nvcc() -> Result<Option<PathBuf>, String> {
    let exe = if cfg!(windows) { "nvcc.exe" } else { "nvcc" };
    if let Some(p) = env::var_os("NVCC").filter(|v| !v.is_empty()) {
        let p = PathBuf::from(p);
        return if is_file(&p) {
            Ok(Some(p))
        } else {
            Err(format!(
                "NVCC={} is not a file: fix or unset it (scripts/install-nvcc.sh prints a working value)",
                p.display()
            ))
        };
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = env::var_os(var) {
            let p = Path::new(&home).join("bin").join(exe);
            if is_file(&p) {
                return Ok(Some(p));
            }
        }
    }
    Ok(env::var_os("PATH").and_then(|paths| {
        env::split_paths(&paths)
            .map(|d| d.join(exe))
            .find(|p| is_file(p))
    }))
}

fn is_file(p: &Path) -> bool {
    p.metadata().map(|m| m.is_file()).unwrap_or(false)
}
