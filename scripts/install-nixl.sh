#!/usr/bin/env bash
# Installs what the `nixl` feature needs on a fresh machine, idempotently:
#
# - libclang (Debian's libclang-dev), which nixl-sys's bindgen needs to
#   build (nixl-sys builds with its stub-api: no NIXL headers needed);
# - NIXL's runtime from the PyPI wheel nixl-cu12==1.5.1, checked against
#   its pinned sha256: libnixl_capi.so, NIXL's plugins (UCX among them) and
#   UCX, unzipped into .nixl/ (git-ignored) with the wheel's own layout, so
#   that the libraries find one another from where they lie. No Python is
#   needed at run time.
#
# Prints the line that points handoff at the library:
#   export HANDOFF_NIXL_LIB=<repo>/.nixl/.nixl_cu12.mesonpy.libs/libnixl_capi.so
# Needs python3 with pip and access to PyPI and Debian's packages.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=1.5.1
WHEEL=nixl_cu12-$VERSION-cp311-cp311-manylinux_2_28_x86_64.whl
SHA256=341d0dfa499f941c054614252f1d8047d1380e33f29c87707372ff5ec7d3779a
DEST=.nixl
LIB=$DEST/.nixl_cu12.mesonpy.libs/libnixl_capi.so
MARK=$DEST/installed-$VERSION

if ! ls /usr/lib/llvm-*/lib/libclang.so >/dev/null 2>&1; then
    echo "install-nixl: installing libclang-dev (bindgen)" >&2
    SUDO=""
    [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libclang-dev >/dev/null
fi

if [ ! -f "$MARK" ] || [ ! -f "$LIB" ]; then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    echo "install-nixl: downloading nixl-cu12==$VERSION from PyPI" >&2
    python3 -m pip download --quiet --no-deps --only-binary=:all: \
        --python-version 3.11 --platform manylinux_2_28_x86_64 \
        "nixl-cu12==$VERSION" -d "$tmp"
    got=$(python3 -c 'import hashlib,sys; print(hashlib.sha256(open(sys.argv[1],"rb").read()).hexdigest())' "$tmp/$WHEEL")
    if [ "$got" != "$SHA256" ]; then
        echo "install-nixl: $WHEEL has sha256 $got, expected $SHA256; refusing it" >&2
        exit 1
    fi
    rm -rf "$DEST"
    mkdir -p "$DEST"
    # Only the native libraries: NIXL's own (with its plugins) and the
    # bundled dependencies (UCX among them) they find through $ORIGIN.
    python3 - "$tmp/$WHEEL" "$DEST" <<'PY'
import os, stat, sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
keep = (".nixl_cu12.mesonpy.libs/", "nixl_cu12.libs/")
with zipfile.ZipFile(wheel) as z:
    for info in z.infolist():
        if info.filename.startswith(keep) and not info.is_dir():
            path = z.extract(info, dest)
            os.chmod(path, os.stat(path).st_mode | stat.S_IRUSR | stat.S_IXUSR)
PY
    touch "$MARK"
fi
echo "install-nixl: NIXL $VERSION in $DEST" >&2
echo "export HANDOFF_NIXL_LIB=$PWD/$LIB"
