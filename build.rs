//! Build script. Without the `cuda` feature it does nothing.
//!
//! With it, it first generates, from the kernel table
//! (`src/backend/cuda/table/`, see there), the `extern "C"` entry points
//! each `cuda/*.cu` includes, the Rust params structs, the C++ and Rust
//! layout checks of the params structs, and the Rust `KernelId` table. Then every `cuda/*.cu` is
//! compiled by nvcc into a fatbin in OUT_DIR (SASS for sm_80 and sm_90 plus
//! compute_90 PTX for newer GPUs), and `OUT_DIR/kernels.rs` lists them for
//! `include_bytes!`. nvcc is looked up in `$NVCC`, `$CUDA_HOME/bin`,
//! `$CUDA_PATH/bin`, then `PATH`; `scripts/install-nvcc.sh` installs one
//! from PyPI.

use std::env;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

// The crate compiles this file too; here only the table is read.
#[allow(dead_code)]
#[path = "src/backend/cuda/table/mod.rs"]
mod table;

use table::{Dtype, FAMILIES, Family, Field, PARAMS, Smem};

/// Where the generated C++ headers go (an include directory of nvcc).
const GEN_CUDA_DIR: &str = "cuda-gen";

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=src/backend/cuda/table");
    for file in ["mod.rs", "families.rs", "params.rs"] {
        println!("cargo::rerun-if-changed=src/backend/cuda/table/{file}");
    }
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
    let gen_dir = out.join(GEN_CUDA_DIR);
    generate(&out, &gen_dir, &sources)?;

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
            .arg("-I")
            .arg(&gen_dir)
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

// ------------------------------------------------------------ generation

/// One instantiation of a family: a value on each of its axes.
struct Instance {
    family: &'static Family,
    dtype: Option<Dtype>,
    head_dim: Option<usize>,
    group: Option<usize>,
}

impl Instance {
    fn symbol(&self) -> String {
        let mut s = self.family.name.to_string();
        if let Some(d) = self.dtype {
            let _ = write!(s, "_{}", d.name());
        }
        if let Some(d) = self.head_dim {
            let _ = write!(s, "_d{d}");
        }
        if let Some(g) = self.group {
            let _ = write!(s, "_g{g}");
        }
        s
    }

    /// The `KernelId` variant: the symbol in CamelCase.
    fn variant(&self) -> String {
        self.symbol()
            .split('_')
            .map(|w| {
                let mut c = w.chars();
                c.next()
                    .map(|f| f.to_ascii_uppercase().to_string() + c.as_str())
                    .unwrap_or_default()
            })
            .collect()
    }

    fn template_args(&self) -> String {
        let mut args = Vec::new();
        if let Some(d) = self.dtype {
            args.push(d.cxx().to_string());
        }
        if let Some(d) = self.head_dim {
            args.push(d.to_string());
        }
        if let Some(g) = self.group {
            args.push(g.to_string());
        }
        if args.is_empty() {
            String::new()
        } else {
            format!("<{}>", args.join(", "))
        }
    }

    fn smem(&self) -> usize {
        self.family.smem.bytes(self.head_dim.unwrap_or(0))
    }
}

/// Every instantiation of the table, family by family.
fn instances() -> Vec<Instance> {
    fn axis<T: Copy>(values: &[T]) -> Vec<Option<T>> {
        if values.is_empty() {
            vec![None]
        } else {
            values.iter().copied().map(Some).collect()
        }
    }
    let mut all = Vec::new();
    for family in FAMILIES {
        for &dtype in &axis(family.dtypes) {
            for &head_dim in &axis(family.head_dims) {
                for &group in &axis(family.groups) {
                    all.push(Instance {
                        family,
                        dtype,
                        head_dim,
                        group,
                    });
                }
            }
        }
    }
    all
}

const GENERATED: &str = "Generated by build.rs from src/backend/cuda/table/: do not edit.";

/// Writes the generated C++ headers into `gen_dir` and the Rust tables into
/// `out`; refuses a table that names a missing source or params struct, and
/// a source that does not include its entry points.
fn generate(out: &Path, gen_dir: &Path, sources: &[PathBuf]) -> Result<(), String> {
    std::fs::create_dir_all(gen_dir).map_err(|e| format!("{}: {e}", gen_dir.display()))?;
    let all = instances();
    let mut stems = Vec::new();
    for src in sources {
        let stem = src
            .file_stem()
            .and_then(|s| s.to_str())
            .ok_or_else(|| format!("odd file name {}", src.display()))?;
        let header = format!("{stem}_kernels.cuh");
        let text = std::fs::read_to_string(src).map_err(|e| format!("{}: {e}", src.display()))?;
        if !text.contains(&format!("#include \"{header}\"")) {
            return Err(format!(
                "cuda/{stem}.cu must end with `#include \"{header}\"` (its entry points, \
                 generated from src/backend/cuda/table/)"
            ));
        }
        stems.push(stem.to_string());
    }
    for f in FAMILIES {
        if !stems.iter().any(|s| s == f.source) {
            return Err(format!(
                "table/families.rs: kernel family {} names cuda/{}.cu, which does not exist",
                f.name, f.source
            ));
        }
        if !PARAMS.iter().any(|p| p.name == f.params) {
            return Err(format!(
                "table/families.rs: kernel family {} takes {}, which PARAMS does not describe",
                f.name, f.params
            ));
        }
    }
    for stem in &stems {
        let text = kernels_cuh(stem, &all);
        write_if_changed(&gen_dir.join(format!("{stem}_kernels.cuh")), &text)?;
    }
    write_if_changed(&gen_dir.join("params_layout.cuh"), &params_layout_cuh())?;
    write_if_changed(&out.join("kernel_table.rs"), &kernel_table_rs(&all))?;
    write_if_changed(&out.join("params_structs.rs"), &params_structs_rs())?;
    write_if_changed(&out.join("params_layout.rs"), &params_layout_rs())?;
    Ok(())
}

/// Rewrites `path` only when its text changes (nvcc and rustc then see an
/// unchanged file as unchanged).
fn write_if_changed(path: &Path, text: &str) -> Result<(), String> {
    if std::fs::read_to_string(path).is_ok_and(|old| old == text) {
        return Ok(());
    }
    std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
}

/// `<stem>_kernels.cuh`: the entry points of the families compiled in
/// `cuda/<stem>.cu`, and checks of the constants the host mirrors.
fn kernels_cuh(stem: &str, all: &[Instance]) -> String {
    let mut s = format!(
        "// {GENERATED}\n// The entry points of cuda/{stem}.cu: one per kernel the host launches.\n\
         #pragma once\n#include \"params_layout.cuh\"\n\n"
    );
    for f in FAMILIES.iter().filter(|f| f.source == stem) {
        for (name, value) in f.mirrors {
            let _ = writeln!(
                s,
                "static_assert(handoff::{name} == {value}, \"{name}: table.rs assumes {value}\");"
            );
        }
    }
    for i in all.iter().filter(|i| i.family.source == stem) {
        let f = i.family;
        let bounds = if f.bounded && f.min_blocks > 0 {
            format!("__launch_bounds__({}, {}) ", f.threads, f.min_blocks)
        } else if f.bounded {
            format!("__launch_bounds__({}) ", f.threads)
        } else {
            String::new()
        };
        let _ = writeln!(
            s,
            "extern \"C\" __global__ void {bounds}{}(const handoff::{} p) {{ handoff::{}{}(p); }}",
            i.symbol(),
            f.params,
            f.body,
            i.template_args()
        );
        if let (Smem::Tiles { cfg, .. }, Some(hd)) = (f.smem, i.head_dim) {
            let bytes = i.smem();
            let _ = writeln!(
                s,
                "static_assert(handoff::{cfg}<{hd}>::SMEM_BYTES == {bytes}, \
                 \"{cfg}<{hd}>: table.rs assumes {bytes} bytes of dynamic shared memory\");"
            );
        }
        if let Smem::Fixed { cfg, bytes } = f.smem {
            let _ = writeln!(
                s,
                "static_assert(handoff::{cfg}::SMEM_BYTES == {bytes}, \
                 \"{cfg}: table.rs assumes {bytes} bytes of dynamic shared memory\");"
            );
        }
    }
    s
}

/// `params_layout.cuh`: every field's offset and kind, every struct's size.
fn params_layout_cuh() -> String {
    let mut s = format!(
        "// {GENERATED}\n// The layout of every params struct, as src/backend/cuda/params.rs \
         asserts it too.\n#pragma once\n#include <cstddef>\n#include <cstdint>\n\
         #include <type_traits>\n#include \"params.cuh\"\n\n"
    );
    for p in PARAMS {
        let (offsets, size) = table::layout(p);
        let ty = format!("handoff::{}", p.name);
        for (&(field, kind), off) in p.fields.iter().zip(offsets) {
            let _ = writeln!(
                s,
                "static_assert(offsetof({ty}, {field}) == {off}, \"{}::{field}: table.rs puts it at byte {off}\");",
                p.name
            );
            let check = match kind {
                Field::Ptr => format!("std::is_pointer<decltype({ty}::{field})>::value"),
                other => format!(
                    "std::is_same<decltype({ty}::{field}), {}>::value",
                    match other {
                        Field::U64 => "uint64_t",
                        Field::U32 => "uint32_t",
                        Field::F32 => "float",
                        _ => "double",
                    }
                ),
            };
            let _ = writeln!(
                s,
                "static_assert({check}, \"{}::{field}: table.rs says {kind:?}\");",
                p.name
            );
        }
        let _ = writeln!(
            s,
            "static_assert(sizeof({ty}) == {size}, \"{}: table.rs says {size} bytes\");\n",
            p.name
        );
    }
    s
}

fn rust_type(kind: Field) -> &'static str {
    match kind {
        Field::Ptr | Field::U64 => "u64",
        Field::U32 => "u32",
        Field::F32 => "f32",
        Field::F64 => "f64",
    }
}

/// `params_structs.rs`: every params struct as the table describes it
/// (pointers as `u64` device addresses), and the list of them for
/// params.rs's `device_repr!` (included by params.rs).
fn params_structs_rs() -> String {
    let mut s = format!("// {GENERATED}\n\n");
    for p in PARAMS {
        let _ = writeln!(
            s,
            "/// {} See `{}` in cuda/params.cuh.\n#[repr(C)]\n\
             #[derive(Clone, Copy, Debug, Default, bytemuck::NoUninit)]\n\
             pub(crate) struct {} {{",
            p.doc, p.name, p.name
        );
        for &(field, kind) in p.fields {
            let _ = writeln!(s, "    pub {field}: {},", rust_type(kind));
        }
        s.push_str("}\n\n");
    }
    s.push_str("device_repr!(\n");
    for p in PARAMS {
        let _ = writeln!(s, "    {},", p.name);
    }
    s.push_str(");\n");
    s
}

/// `params_layout.rs`: the same checks on the Rust structs (included by
/// params.rs).
fn params_layout_rs() -> String {
    let mut s = format!("// {GENERATED}\n\n");
    for p in PARAMS {
        let (offsets, size) = table::layout(p);
        let name = p.name;
        let _ = writeln!(s, "const _: () = {{");
        for (&(field, _), off) in p.fields.iter().zip(offsets) {
            let _ = writeln!(
                s,
                "    assert!(::core::mem::offset_of!({name}, {field}) == {off}, \"{name}::{field}: table.rs puts it at byte {off}\");"
            );
        }
        let _ = writeln!(
            s,
            "    assert!(::core::mem::size_of::<{name}>() == {size}, \"{name}: table.rs says {size} bytes\");\n}};"
        );
        let _ = writeln!(s, "const _: fn(&{name}) = |p| {{");
        for &(field, kind) in p.fields {
            let _ = writeln!(s, "    let _: {} = p.{field};", rust_type(kind));
        }
        let _ = writeln!(s, "}};\n");
    }
    s
}

/// `kernel_table.rs`: `KernelId`, each kernel's spec, and one typed lookup
/// per family (included by kernels.rs).
fn kernel_table_rs(all: &[Instance]) -> String {
    let mut s = format!(
        "// {GENERATED}\n\n/// Every compiled kernel, one variant per instantiation in the table.\n\
         #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]\npub(crate) enum KernelId {{\n"
    );
    for i in all {
        let _ = writeln!(s, "    /// `{}`", i.symbol());
        let _ = writeln!(s, "    {},", i.variant());
    }
    let _ = writeln!(
        s,
        "}}\n\nimpl KernelId {{\n    /// Every kernel in table order: `ALL[k as usize] == k`.\n    \
         pub(crate) const ALL: [KernelId; {}] = [",
        all.len()
    );
    for i in all {
        let _ = writeln!(s, "        KernelId::{},", i.variant());
    }
    s.push_str(
        "    ];\n\n    /// Its symbol, block size, dynamic shared memory and error text.\n    \
         pub(crate) const fn spec(self) -> KernelSpec {\n        match self {\n",
    );
    for i in all {
        let _ = writeln!(
            s,
            "            KernelId::{} => KernelSpec {{ symbol: {:?}, threads: {}, dynamic_smem: {}, during: {:?} }},",
            i.variant(),
            i.symbol(),
            i.family.threads,
            i.smem(),
            i.family.during
        );
    }
    s.push_str("        }\n    }\n}\n");
    for f in FAMILIES {
        let mut args = Vec::new();
        let mut keys = Vec::new();
        if !f.dtypes.is_empty() {
            args.push("dtype: KvDtype");
            keys.push("dtype");
        }
        if !f.head_dims.is_empty() {
            args.push("head_dim: usize");
            keys.push("head_dim");
        }
        if !f.groups.is_empty() {
            args.push("group: usize");
            keys.push("group");
        }
        let ret = format!("Kernel<{}>", f.params);
        let members = all.iter().filter(|i| i.family.name == f.name);
        if keys.is_empty() {
            let Some(i) = members.into_iter().next() else {
                continue;
            };
            let _ = writeln!(
                s,
                "\n/// `{}`.\npub(crate) const fn {}() -> {ret} {{\n    Kernel::new(KernelId::{})\n}}",
                f.name,
                f.name,
                i.variant()
            );
            continue;
        }
        let _ = writeln!(
            s,
            "\n/// `{}` for ({}), or `None` where the table has no such instantiation.\n\
             #[allow(unreachable_patterns)]\npub(crate) fn {}({}) -> Option<{ret}> {{\n    \
             let id = match ({},) {{",
            f.name,
            keys.join(", "),
            f.name,
            args.join(", "),
            keys.join(", ")
        );
        for i in members {
            let mut pat = Vec::new();
            if let Some(d) = i.dtype {
                pat.push(format!("KvDtype::{}", d.rust()));
            }
            if let Some(d) = i.head_dim {
                pat.push(d.to_string());
            }
            if let Some(g) = i.group {
                pat.push(g.to_string());
            }
            let _ = writeln!(
                s,
                "        ({},) => KernelId::{},",
                pat.join(", "),
                i.variant()
            );
        }
        s.push_str("        _ => return None,\n    };\n    Some(Kernel::new(id))\n}\n");
    }
    s
}
