//! Kernel parameter structs, field for field the ones in `cuda/params.cuh`
//! (read that file for the shapes behind each pointer). Both are described
//! once in the kernel table (`table/params.rs`): build.rs generates from it
//! the Rust structs (`params_structs.rs`, included here), and the checks of
//! every field's offset and type and every struct's size, the C++ side's
//! `static_assert`s against params.cuh and this side's const asserts
//! (`params_layout.rs`, included at the end of this file).
//!
//! Pointers are device addresses (`CUdeviceptr`). Only the ops (`ops/`)
//! fill them in, from buffers whose sizes they have checked.

use cudarc::driver::DeviceRepr;

/// Formats of the ggml-block matmul's weights (`QFMT_*` in params.cuh).
pub(crate) const QFMT_Q8_0: u32 = 0;
pub(crate) const QFMT_Q4_0: u32 = 1;
pub(crate) const QFMT_Q4_1: u32 = 2;
pub(crate) const QFMT_Q4_K: u32 = 3;
pub(crate) const QFMT_Q5_K: u32 = 4;
pub(crate) const QFMT_Q6_K: u32 = 5;
pub(crate) const QFMT_Q5_0: u32 = 6;
pub(crate) const QFMT_Q5_1: u32 = 7;

/// Parameter structs the kernels receive by value.
macro_rules! device_repr {
    ($($t:ty),* $(,)?) => {$(
        // SAFETY: #[repr(C)], made only of integers and floats, with every
        // field's offset and type and the size asserted (params_layout.rs)
        // against the table that the C++ struct in cuda/params.cuh is
        // asserted against;
        // the kernel receives it by value.
        unsafe impl DeviceRepr for $t {}
    )*};
}

include!(concat!(env!("OUT_DIR"), "/params_structs.rs"));
include!(concat!(env!("OUT_DIR"), "/params_layout.rs"));

#[cfg(test)]
mod tests {
    //! The C++ half of the layout checks, run with the host compiler: the
    //! generated asserts accept cuda/params.cuh as it is, and refuse it
    //! with one field moved, one retyped, or one struct grown.
    use std::path::{Path, PathBuf};
    use std::process::Command;

    fn cxx() -> Option<PathBuf> {
        let paths = std::env::var_os("PATH")?;
        ["c++", "g++", "clang++"].iter().find_map(|c| {
            std::env::split_paths(&paths)
                .map(|d| d.join(c))
                .find(|p| p.is_file())
        })
    }

    /// Compiles the generated layout checks against `params_cuh`; the
    /// compiler's complaint when they fail.
    fn check_layout(cxx: &Path, params_cuh: &str) -> Result<(), String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let generated = include_str!(concat!(env!("OUT_DIR"), "/cuda-gen/params_layout.cuh"));
        std::fs::write(dir.path().join("params.cuh"), params_cuh).map_err(|e| e.to_string())?;
        let main = dir.path().join("main.cpp");
        std::fs::write(&main, format!("{generated}\nint main() {{ return 0; }}\n"))
            .map_err(|e| e.to_string())?;
        let out = Command::new(cxx)
            .args(["-std=c++17", "-fsyntax-only", "-I"])
            .arg(dir.path())
            .arg(&main)
            .output()
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    #[test]
    fn the_cxx_layout_checks_accept_params_cuh_and_refuse_any_drift() {
        let Some(cxx) = cxx() else {
            eprintln!(
                "SKIP the_cxx_layout_checks_accept_params_cuh_and_refuse_any_drift: no C++ compiler"
            );
            return;
        };
        let real = include_str!("../../../cuda/params.cuh");
        assert_eq!(check_layout(&cxx, real), Ok(()));

        let swapped = "    uint32_t n_heads;             // query heads\n    uint32_t batch;\n";
        let drifts = [
            // Two fields of DecodeParams swapped: same size, other offsets.
            (
                "    uint32_t batch;\n    uint32_t n_heads;             // query heads\n",
                swapped,
                "DecodeParams::batch: table.rs puts it at byte 72",
            ),
            // A u32 that became a float: same offset and size.
            (
                "    uint32_t n_rows;\n    uint32_t dim;\n    float eps;",
                "    uint32_t n_rows;\n    float dim;\n    float eps;",
                "RmsNormParams::dim: table.rs says U32",
            ),
            // A field added at the end of a struct.
            (
                "    uint32_t row_bytes;         // kv_dim * dtype size\n",
                "    uint32_t row_bytes;         // kv_dim * dtype size\n    uint64_t extra;\n",
                "PageChecksumParams: table.rs says 64 bytes",
            ),
        ];
        for (from, to, complaint) in drifts {
            assert_eq!(
                real.matches(from).count(),
                1,
                "{from:?} is in params.cuh once"
            );
            let drifted = real.replacen(from, to, 1);
            let err = check_layout(&cxx, &drifted).expect_err(complaint);
            assert!(err.contains(complaint), "{complaint}: {err}");
        }
    }
}
