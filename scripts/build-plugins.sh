#!/usr/bin/env bash
# Builds every plugin in the guest workspaces (plugins/, and the test-only plugins under
# plugins/testing/) for wasm32 with Debian's rustc-web + build-std, then encodes each as a
# component next to its plugin.toml (`component = ...`). Idempotent; incremental builds take
# about a second.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build -q -p mlxhost-componentize
ENCODE="$PWD/target/debug/mlxhost-componentize"
RUSTC_WASM="${RUSTC_WASM:-/usr/bin/rustc}"
[ -x "$RUSTC_WASM" ] || { echo "build-plugins: $RUSTC_WASM missing (apt install rustc-web rust-web-src; scripts/setup.sh does)" >&2; exit 1; }

(cd plugins && RUSTC="$RUSTC_WASM" RUSTC_BOOTSTRAP=1 cargo build -q --release)
OUT=plugins/target/wasm32-unknown-unknown/release
for manifest in plugins/*/plugin.toml plugins/testing/*/plugin.toml; do
  [ -f "$manifest" ] || continue
  dir=$(dirname "$manifest")
  crate=$(sed -n 's/^name *= *"\(.*\)"/\1/p' "$dir/Cargo.toml" | head -1)
  component=$(sed -n 's/^component *= *"\(.*\)"/\1/p' "$manifest" | head -1)
  core="$OUT/${crate//-/_}.wasm"
  [ -f "$core" ] || { echo "build-plugins: $core not built" >&2; exit 1; }
  if [ ! -f "$dir/$component" ] || [ "$core" -nt "$dir/$component" ]; then
    "$ENCODE" "$core" "$dir/$component"
  fi
done
