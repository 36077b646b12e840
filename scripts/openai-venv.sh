#!/usr/bin/env bash
# Creates the virtual environment in which handoff-server's tests
# (crates/handoff-server/tests/server/openai_server_python.rs and
# openai_server_smollm2.rs) run the official `openai` Python client against
# the server: .venv-openai/ at the repository root, with a pinned `openai`
# from PyPI.
# Idempotent: an environment that already has the pinned version is kept.
# Needs python3 with venv and pip, and access to PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."

OPENAI_VERSION=3.57.0
VENV=.venv-openai

if [ -x "$VENV/bin/python" ] &&
    "$VENV/bin/python" -c "import openai, sys; sys.exit(openai.__version__ != '$OPENAI_VERSION')" 2>/dev/null; then
    echo "openai $OPENAI_VERSION already in $VENV"
    exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check "openai==$OPENAI_VERSION"
"$VENV/bin/python" -c "import openai; print('openai', openai.__version__, 'in $VENV')"
