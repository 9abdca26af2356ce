#!/usr/bin/env bash
# Creates (once per requirements change) the Python venv the HTTP end-to-end suite runs in
# ($MLXHOST_CACHE/venv-test, from tests/python/requirements.txt: the official `openai` SDK and
# pytest) and prints its python. Idempotent; pip's cache makes a rebuild fast.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${MLXHOST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mlxhost}"
VENV="$CACHE/venv-test"
REQ=tests/python/requirements.txt
want=$(sha256sum "$REQ" | cut -d' ' -f1)
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.requirements-sha256" 2>/dev/null)" != "$want" ]; then
  echo "python-test-env: installing $REQ into $VENV" >&2
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check -r "$REQ"
  echo "$want" > "$VENV/.requirements-sha256"
fi
echo "$VENV/bin/python"
