#!/usr/bin/env bash
# Builds every plugin in the guest workspaces (plugins/, and the test-only plugins under
# plugins/testing/) for wasm32 with Debian's rustc-web + build-std, then encodes each as a
# component next to its plugin.toml (`component = ...`). A plugin folder without a Cargo.toml
# (plugins/hermes, plugins/think, ...) gets a copy of the component of the crate its `component`
# file is named after (plugins/tool-parsers). Idempotent; incremental builds take about a second.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build -q -p mlxhost-componentize
ENCODE="$PWD/target/debug/mlxhost-componentize"
RUSTC_WASM="${RUSTC_WASM:-/usr/bin/rustc}"
[ -x "$RUSTC_WASM" ] || { echo "build-plugins: $RUSTC_WASM missing (apt install rustc-web rust-web-src; scripts/setup.sh does)" >&2; exit 1; }

(cd plugins && RUSTC="$RUSTC_WASM" RUSTC_BOOTSTRAP=1 cargo build -q --release)
OUT=plugins/target/wasm32-unknown-unknown/release
# Encodes $1 (core module) as component $2 when $2 is missing or older.
encode() {
  if [ ! -f "$2" ] || [ "$1" -nt "$2" ]; then
    "$ENCODE" "$1" "$2"
  fi
}
for manifest in plugins/*/plugin.toml plugins/testing/*/plugin.toml; do
  [ -f "$manifest" ] || continue
  dir=$(dirname "$manifest")
  component=$(sed -n 's/^component *= *"\(.*\)"/\1/p' "$manifest" | head -1)
  if [ -f "$dir/Cargo.toml" ]; then
    crate=$(sed -n 's/^name *= *"\(.*\)"/\1/p' "$dir/Cargo.toml" | head -1)
    core="$OUT/${crate//-/_}.wasm"
    [ -f "$core" ] || { echo "build-plugins: $core not built" >&2; exit 1; }
    encode "$core" "$dir/$component"
  else
    # A folder without a crate shares the component of the crate its file is named after
    # (`component = "tool-parsers.wasm"`: the plugins/tool-parsers crate, encoded once there).
    crate="${component%.wasm}"
    core="$OUT/${crate//-/_}.wasm"
    [ -f "plugins/$crate/Cargo.toml" ] && [ -f "$core" ] || { echo "build-plugins: $dir has no Cargo.toml and $core (crate plugins/$crate) is not built" >&2; exit 1; }
    encode "$core" "plugins/$crate/$component"
    if [ ! -f "$dir/$component" ] || [ "plugins/$crate/$component" -nt "$dir/$component" ]; then
      cp "plugins/$crate/$component" "$dir/$component"
    fi
  fi
done
