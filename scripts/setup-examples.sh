#!/usr/bin/env bash
# Installs the guest toolchains the plugin examples in examples/ build with, idempotently:
#   C:          apt clang-19 lld-19 wasi-libc libclang-rt-19-dev-wasm32, and wit-bindgen-cli
#               (cargo install, into $MLXHOST_CACHE/tools);
#   JavaScript: npm @bytecodealliance/componentize-js (into $MLXHOST_CACHE/tools/node_modules);
#   Python:     pip componentize-py (into the venv $MLXHOST_CACHE/tools/venv-componentize-py).
# Rust needs nothing beyond scripts/setup.sh. Prints nothing on success.
set -euo pipefail
CACHE="${MLXHOST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mlxhost}"
TOOLS="$CACHE/tools"
mkdir -p "$TOOLS"
WIT_BINDGEN_VERSION=0.48.1
COMPONENTIZE_JS_VERSION=0.23.0
COMPONENTIZE_PY_VERSION=0.25.1

APT_PACKAGES=(clang-19 lld-19 wasi-libc libclang-rt-19-dev-wasm32)
# Node.js: Debian's nodejs + npm unless a node with npm is already installed (e.g. NodeSource's,
# which conflicts with Debian's npm package).
command -v npm >/dev/null || APT_PACKAGES+=(nodejs npm)
"$(dirname "$0")/apt-ensure.sh" "${APT_PACKAGES[@]}"

if [ "$("$TOOLS/bin/wit-bindgen" --version 2>/dev/null | awk '{print $2}')" != "$WIT_BINDGEN_VERSION" ]; then
  echo "setup-examples: cargo install wit-bindgen-cli $WIT_BINDGEN_VERSION (about 2 minutes)" >&2
  cargo install --quiet --locked --root "$TOOLS" wit-bindgen-cli --version "$WIT_BINDGEN_VERSION"
fi

installed_version() {  # $1 = package.json path
  python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["version"])' "$1" 2>/dev/null || true
}
if [ "$(installed_version "$TOOLS/node_modules/@bytecodealliance/componentize-js/package.json")" != "$COMPONENTIZE_JS_VERSION" ] || \
   [ ! -d "$TOOLS/node_modules/@bytecodealliance/preview2-shim" ]; then
  echo "setup-examples: npm install @bytecodealliance/componentize-js@$COMPONENTIZE_JS_VERSION" >&2
  printf '{"private": true, "dependencies": {"@bytecodealliance/componentize-js": "%s"}}\n' "$COMPONENTIZE_JS_VERSION" \
    > "$TOOLS/package.json"
  rm -rf "$TOOLS/node_modules" "$TOOLS/package-lock.json"
  (cd "$TOOLS" && npm install --silent --no-audit --no-fund >/dev/null)
fi

PYVENV="$TOOLS/venv-componentize-py"
py_version=$("$PYVENV/bin/python" -c "import importlib.metadata as m; print(m.version('componentize-py'))" 2>/dev/null || true)
if [ "$py_version" != "$COMPONENTIZE_PY_VERSION" ]; then
  echo "setup-examples: pip install componentize-py==$COMPONENTIZE_PY_VERSION" >&2
  python3 -m venv "$PYVENV"
  "$PYVENV/bin/pip" install --quiet --disable-pip-version-check "componentize-py==$COMPONENTIZE_PY_VERSION"
fi
