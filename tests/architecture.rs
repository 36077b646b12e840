//! The map and the house agree: every reference from one top-level module of
//! `src/` to another (`use crate::...` lines, paths in code, doc links, prose
//! in comments that names a `crate::` path, `super::` chains that climb to
//! the crate root, and names the root re-exports) must run down the layers
//! that ARCHITECTURE.md lists in its `layers` block. The layers are read from
//! the document itself, so the map cannot drift from this check.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

/// One reference that runs against the layers (or that the check cannot
/// place), named by file and line.
#[derive(Debug, PartialEq, Eq)]
struct Violation {
    file: String,
    line: usize,
    from: String,
    to: String,
    why: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}: {} -> {}: {}",
            self.file, self.line, self.from, self.to, self.why
        )
    }
}

/// The rows of the fenced ```` ```layers ```` block, top row first: each
/// module's row index. A line is `names | what they are`; the names before
/// `|` are separated by spaces, `·` or commas.
fn parse_layers(doc: &str) -> Result<BTreeMap<String, usize>, String> {
    let mut rows = BTreeMap::new();
    let mut lines = doc.lines();
    lines
        .by_ref()
        .find(|l| l.trim() == "```layers")
        .ok_or("ARCHITECTURE.md has no ```layers block")?;
    let mut row = 0;
    for line in lines {
        if line.trim_start().starts_with("```") {
            return if rows.is_empty() {
                Err("the layers block is empty".into())
            } else {
                Ok(rows)
            };
        }
        let names = line.split('|').next().unwrap_or("");
        let names: Vec<&str> = names
            .split(|c: char| c.is_whitespace() || c == '·' || c == ',')
            .filter(|n| !n.is_empty())
            .collect();
        if names.is_empty() {
            continue;
        }
        for n in names {
            if rows.insert(n.to_string(), row).is_some() {
                return Err(format!("{n} is on two rows of the layers block"));
            }
        }
        row += 1;
    }
    Err("the layers block is not closed".into())
}

/// The crate root's modules and the names it re-exports, each with the
/// module it comes from (`pub use sched::{AdmissionLimits, ...}`).
struct Root {
    modules: BTreeSet<String>,
    reexports: BTreeMap<String, String>,
}

fn parse_root(lib: &str) -> Root {
    let mut modules = BTreeSet::new();
    let mut reexports = BTreeMap::new();
    let code = strip_line_comments(lib);
    for item in code.split(';') {
        // The item without its attributes (`#[cfg(...)]` lines).
        let item = item
            .lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .collect::<Vec<_>>()
            .join(" ");
        let item = item.trim();
        let decl = item
            .strip_prefix("pub(crate) ")
            .or_else(|| item.strip_prefix("pub "))
            .unwrap_or(item);
        if let Some(name) = decl.strip_prefix("mod ") {
            modules.insert(name.trim().to_string());
            continue;
        }
        let Some(rest) = item
            .strip_prefix("pub use ")
            .or_else(|| item.strip_prefix("pub(crate) use "))
        else {
            continue;
        };
        let rest = rest.trim_start_matches("crate::");
        let Some((module, names)) = rest.split_once("::") else {
            continue;
        };
        for name in names.split([',', '{', '}']) {
            let name = name.trim();
            let name = name.rsplit(" as ").next().unwrap_or(name).trim();
            let name = name.rsplit("::").next().unwrap_or(name);
            if !name.is_empty() {
                reexports.insert(name.to_string(), module.to_string());
            }
        }
    }
    Root { modules, reexports }
}

/// `src` without `//` comments (for parsing lib.rs's items only).
fn strip_line_comments(src: &str) -> String {
    src.lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The identifier at the start of `s`.
fn ident(s: &str) -> &str {
    &s[..s.find(|c: char| !is_ident(c)).unwrap_or(s.len())]
}

/// Every top-level item that `text` (one file of module `module_path`,
/// e.g. `["kv", "storage", "pages"]`) names from the crate root, as
/// `(line, first path segment)`: after `crate::` (or `$crate::`), inside a
/// `crate::{...}` group (across lines), and after a `super::` chain that
/// climbs to the root.
fn root_refs(text: &str, module_path: &[String]) -> Vec<(usize, String)> {
    let line_of = |at: usize| text[..at].matches('\n').count() + 1;
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(i) = text[from..].find("crate::") {
        let at = from + i;
        from = at + "crate::".len();
        if text[..at].chars().next_back().is_some_and(is_ident) {
            continue; // `mycrate::`, not this crate's root
        }
        let rest = &text[from..];
        if let Some(group) = rest.strip_prefix('{') {
            group_refs(group, from + 1, &line_of, &mut out);
        } else {
            let name = ident(rest);
            if !name.is_empty() {
                out.push((line_of(from), name.to_string()));
            }
        }
    }
    // `super::` chains, counted against the file's depth plus the inline
    // modules (`mod tests {`) open at that line (rustfmt's layout).
    let mut inline: Vec<usize> = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let indent = line.len() - line.trim_start().len();
        if inline
            .last()
            .is_some_and(|&open| open == indent && line.trim() == "}")
        {
            inline.pop();
        }
        let depth = module_path.len() + inline.len();
        let mut from = 0;
        while let Some(i) = line[from..].find("super::") {
            let at = from + i;
            if line[..at].chars().next_back().is_some_and(is_ident) {
                from = at + 1;
                continue;
            }
            let mut rest = &line[at..];
            let mut ups = 0;
            while let Some(r) = rest.strip_prefix("super::") {
                ups += 1;
                rest = r;
            }
            from = line.len() - rest.len();
            if ups >= depth && !ident(rest).is_empty() {
                out.push((n + 1, ident(rest).to_string()));
            }
        }
        let t = line.trim_start();
        let opens_inline = t.ends_with('{')
            && t.split_whitespace()
                .take_while(|w| *w != "{")
                .any(|w| w == "mod")
            && !t.starts_with("//");
        if opens_inline {
            inline.push(indent);
        }
    }
    out
}

/// The first segment of each item of a `crate::{...}` group that starts at
/// byte `start` of the file (`group` is the text after the `{`).
fn group_refs(
    group: &str,
    start: usize,
    line_of: &dyn Fn(usize) -> usize,
    out: &mut Vec<(usize, String)>,
) {
    let mut depth = 0;
    let mut expect_item = true;
    let mut i = 0;
    let bytes = group.as_bytes();
    while i < bytes.len() {
        let c = bytes[i] as char;
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => return,
            '}' => depth -= 1,
            ',' if depth == 0 => expect_item = true,
            c if is_ident(c) && expect_item && depth == 0 => {
                let name = ident(&group[i..]);
                out.push((line_of(start + i), name.to_string()));
                expect_item = false;
                i += name.len();
                continue;
            }
            _ => {}
        }
        i += 1;
    }
}

/// The module path of a file under `src/`: `kv/storage/mod.rs` is
/// `["kv", "storage"]`, `kv/seq/received.rs` is `["kv", "seq", "received"]`.
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if let Some(last) = parts.pop() {
        let stem = last.trim_end_matches(".rs");
        if stem != "mod" {
            parts.push(stem.to_string());
        }
    }
    parts
}

/// The references of one file that run against `layers`.
fn check_file(
    rel: &Path,
    text: &str,
    layers: &BTreeMap<String, usize>,
    root: &Root,
) -> Vec<Violation> {
    let path = module_path(rel);
    let Some(from) = path.first().cloned() else {
        return Vec::new();
    };
    let file = format!("src/{}", rel.display());
    let mut out = Vec::new();
    for (line, name) in root_refs(text, &path) {
        let to = if root.modules.contains(&name) {
            name.clone()
        } else if let Some(m) = root.reexports.get(&name) {
            m.clone()
        } else {
            out.push(Violation {
                file: file.clone(),
                line,
                from: from.clone(),
                to: name,
                why: "names no module or re-export of the crate root".into(),
            });
            continue;
        };
        if to == from {
            continue;
        }
        let why = match (layers.get(&from), layers.get(&to)) {
            (Some(a), Some(b)) if a < b => continue,
            (Some(a), Some(b)) if a == b => format!("{from} and {to} share a row of the layers"),
            (Some(_), Some(_)) => format!("{to} is above {from} in ARCHITECTURE.md's layers"),
            _ => "a module missing from ARCHITECTURE.md's layers".into(),
        };
        out.push(Violation {
            file: file.clone(),
            line,
            from: from.clone(),
            to,
            why,
        });
    }
    out
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| {
            e.unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
                .path()
        })
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn every_crate_reference_in_src_runs_down_the_layers_of_architecture_md() {
    let root_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root_dir.join("ARCHITECTURE.md")).unwrap();
    let layers = parse_layers(&doc).unwrap_or_else(|e| panic!("ARCHITECTURE.md: {e}"));
    let src = root_dir.join("src");
    let root = parse_root(&std::fs::read_to_string(src.join("lib.rs")).unwrap());

    // The map names every module of the crate root, and nothing else.
    let on_map: BTreeSet<String> = layers.keys().cloned().collect();
    assert_eq!(
        on_map, root.modules,
        "ARCHITECTURE.md's layers and src/lib.rs's modules differ"
    );

    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut violations = Vec::new();
    let mut refs = 0;
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap();
        if rel == Path::new("lib.rs") {
            continue; // the root declares and re-exports every module
        }
        let text = std::fs::read_to_string(f).unwrap();
        refs += root_refs(&text, &module_path(rel)).len();
        violations.extend(check_file(rel, &text, &layers, &root));
    }
    assert!(
        refs > 500,
        "only {refs} crate references found in src/: the scan is broken"
    );
    assert!(
        violations.is_empty(),
        "{} references run against ARCHITECTURE.md's layers:\n{}",
        violations.len(),
        violations
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("\n")
    );
}

const TOY_MAP: &str =
    "# map\n\n```layers\ntop | uses the rest\nmid · side | two on one row\nleaf\n```\n";
const TOY_LIB: &str = "pub mod top;\npub mod mid;\n#[cfg(feature = \"x\")]\npub mod side;\nmod leaf;\npub use mid::{Thing, Other as Renamed};\npub use leaf::Leafy;\n";

fn toy_check(file: &str, text: &str) -> Vec<(usize, String, String)> {
    let layers = parse_layers(TOY_MAP).unwrap();
    let root = parse_root(TOY_LIB);
    check_file(Path::new(file), text, &layers, &root)
        .into_iter()
        .map(|v| (v.line, v.to, v.why))
        .collect()
}

#[test]
fn the_layers_block_and_the_root_are_read_as_written() {
    let layers = parse_layers(TOY_MAP).unwrap();
    assert_eq!(layers["top"], 0);
    assert_eq!((layers["mid"], layers["side"]), (1, 1));
    assert_eq!(layers["leaf"], 2);
    assert!(parse_layers("no block here").is_err());
    assert!(parse_layers("```layers\na\na\n```").is_err());
    let root = parse_root(TOY_LIB);
    assert_eq!(root.modules.len(), 4);
    assert_eq!(root.reexports["Thing"], "mid");
    assert_eq!(root.reexports["Renamed"], "mid");
    assert_eq!(root.reexports["Leafy"], "leaf");
}

#[test]
fn downward_references_pass() {
    let text = "use crate::mid::Thing;\nuse crate::{leaf, side::X};\n/// [`Leafy`](crate::Leafy)\nfn f() { crate::top::g() }\n";
    assert!(toy_check("top/a.rs", text).is_empty());
    assert!(toy_check("mid.rs", "use crate::leaf::Y;\nuse crate::mid::Z;\n").is_empty());
}

#[test]
fn an_upward_or_sideways_reference_is_named_by_line_in_any_form() {
    // A use line, a doc link, prose, a multi-line group, a root re-export
    // and a super chain that climbs to the root, each against the map.
    let text = "use crate::top::A;\n\
                /// See [`B`](crate::top::B).\n\
                // (crate::side::C is its neighbour)\n\
                use crate::{\n    leaf::D,\n    top::{E, F},\n};\n\
                fn g() -> crate::Thing { todo!() }\n\
                fn h() { super::super::top::i() }\n\
                fn j() { $crate::top::k() }\n";
    let got = toy_check("leaf/inner.rs", text);
    let lines: Vec<(usize, &str)> = got.iter().map(|(l, to, _)| (*l, to.as_str())).collect();
    assert_eq!(
        lines,
        [
            (1, "top"),
            (2, "top"),
            (3, "side"),
            (6, "top"),
            (8, "mid"),
            (10, "top"),
            (9, "top"),
        ]
    );
    assert!(got[0].2.contains("above"), "{}", got[0].2);

    let same_row = toy_check("mid/x.rs", "use crate::side::S;\n");
    assert_eq!(same_row.len(), 1);
    assert!(same_row[0].2.contains("share a row"), "{}", same_row[0].2);

    let unknown = toy_check("top.rs", "use crate::nowhere::N;\n");
    assert_eq!(unknown.len(), 1);
    assert!(unknown[0].2.contains("names no module"));
}

#[test]
fn super_chains_count_inline_modules_and_stop_below_the_root() {
    // In leaf/a.rs, `super::x` is `leaf::x`; inside `mod tests`, two
    // `super`s still stay in `leaf`, three reach the root.
    let text = "use super::x;\n\
                #[cfg(test)]\n\
                mod tests {\n    use super::super::y;\n    use super::super::super::top::Z;\n}\n\
                use super::super::mid::W;\n";
    let got = toy_check("leaf/a.rs", text);
    let lines: Vec<(usize, &str)> = got.iter().map(|(l, to, _)| (*l, to.as_str())).collect();
    assert_eq!(lines, [(5, "top"), (7, "mid")]);
}
