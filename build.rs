//! Build script. Without the `cuda` feature it does nothing; the CUDA
//! issue fills in kernel compilation (nvcc -> fatbin -> include_bytes!).

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
}
