#!/usr/bin/env bash
# Every cargo target that a document names must exist, so that each command in the docs runs as written.
#
# Reads every *.md that git tracks (and any new one not ignored), finds each `--test NAME`, `--example NAME`,
# `--bench NAME` and `--bin NAME` (also `--flag=NAME`, and a flag at the end of a line whose name opens the next
# line), and fails, naming the file and line, when the crate has no such target:
#   --test NAME     tests/NAME.rs or tests/NAME/main.rs (an area such as `--test transfer`; a module inside an
#                   area is a filter after it: `cargo test --test transfer fault_matrix`)
#   --example NAME  examples/NAME.rs or examples/NAME/main.rs
#   --bench NAME    benches/NAME.rs or benches/NAME/main.rs
#   --bin NAME      src/bin/NAME.rs, src/bin/NAME/main.rs, or src/main.rs of a package called NAME
# A document is checked against the crate it lies in (the nearest Cargo.toml above it, e.g. fuzz/), the
# repository's root crate (fuzz/README.md runs `cd .. && cargo test --test model ...`) and the workspace's member
# crates under crates/ (`cargo run -p handoff-server --example openai_load`).
#
# No file is exempt: docs/bench-history.md quotes only commands that still run. A history page that must quote
# a command whose target is gone should say so in its text and be added to EXEMPT below with the reason.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

EXEMPT=()

if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    mapfile -t docs < <(git ls-files --cached --others --exclude-standard -- '*.md' | sort -u)
else
    mapfile -t docs < <(find . -name '*.md' -not -path './target/*' -not -path './.git/*' | sed 's|^\./||' | sort)
fi

# The crate directory a document belongs to: the nearest directory above it holding a Cargo.toml.
crate_of() {
    local dir
    dir=$(dirname "$1")
    while [ "$dir" != "." ] && [ "$dir" != "/" ]; do
        if [ -f "$dir/Cargo.toml" ]; then
            echo "$dir"
            return
        fi
        dir=$(dirname "$dir")
    done
    echo "."
}

# has_target DIR KIND NAME: whether the crate in DIR has that target.
has_target() {
    local dir=$1 kind=$2 name=$3
    case $kind in
    test) [ -f "$dir/tests/$name.rs" ] || [ -f "$dir/tests/$name/main.rs" ] ;;
    example) [ -f "$dir/examples/$name.rs" ] || [ -f "$dir/examples/$name/main.rs" ] ;;
    bench) [ -f "$dir/benches/$name.rs" ] || [ -f "$dir/benches/$name/main.rs" ] ;;
    bin)
        [ -f "$dir/src/bin/$name.rs" ] || [ -f "$dir/src/bin/$name/main.rs" ] || {
            [ -f "$dir/src/main.rs" ] &&
                grep -qE "^name[[:space:]]*=[[:space:]]*\"$name\"" "$dir/Cargo.toml"
        }
        ;;
    *) return 1 ;;
    esac
}

failures=0
checked=0
for doc in "${docs[@]}"; do
    [ -f "$doc" ] || continue
    skip=0
    for e in "${EXEMPT[@]+"${EXEMPT[@]}"}"; do
        [ "$doc" = "$e" ] && skip=1
    done
    [ $skip -eq 1 ] && continue
    crate=$(crate_of "$doc")
    # One line per reference: LINE KIND NAME. A flag ending a line takes its name from the next line's first word.
    while read -r line kind name; do
        checked=$((checked + 1))
        if has_target "$crate" "$kind" "$name" || has_target "$root" "$kind" "$name"; then
            continue
        fi
        found=0
        for member in "$root"/crates/*/; do
            [ -f "$member/Cargo.toml" ] && has_target "${member%/}" "$kind" "$name" && found=1 && break
        done
        [ $found -eq 1 ] && continue
        echo "$doc:$line: --$kind $name: no such target (see scripts/check-doc-commands.sh for where each lives)"
        failures=$((failures + 1))
    done < <(awk '
        function emit(kind, name, line) {
            gsub(/[`*,;:)(\]\["'\''.]+$/, "", name)
            gsub(/^[`*"'\'']+/, "", name)
            if (name != "" && name !~ /^-/) print line, kind, name
        }
        {
            if (pending != "") {
                if (match($0, /^[ \t`]*[^ \t`]+/)) {
                    w = substr($0, RSTART, RLENGTH)
                    gsub(/^[ \t`]+/, "", w)
                    emit(pending, w, pending_line)
                }
                pending = ""
            }
            rest = $0
            while (match(rest, /--(test|example|bench|bin)([= \t`]|$)/)) {
                flag = substr(rest, RSTART + 2, RLENGTH - 2)
                sub(/[= \t`]$/, "", flag)
                rest = substr(rest, RSTART + RLENGTH)
                if (match(rest, /^[ \t]*[A-Za-z0-9_.\/-]+/)) {
                    w = substr(rest, RSTART, RLENGTH)
                    gsub(/^[ \t]+/, "", w)
                    emit(flag, w, NR)
                    rest = substr(rest, RSTART + RLENGTH)
                } else if (rest ~ /^[ \t`]*$/) {
                    pending = flag
                    pending_line = NR
                }
            }
        }
    ' "$doc")
done

if [ $failures -gt 0 ]; then
    echo "check-doc-commands: $failures of $checked target references in the docs name no target" >&2
    exit 1
fi
echo "check-doc-commands: all $checked target references in ${#docs[@]} documents name existing targets"
