#!/usr/bin/env bash
# Builds the four `no-repeat` example plugins (Rust, C, JavaScript, Python) and the `ollama-js`
# API adapter (JavaScript) into components next to their plugin.toml, so each folder can be
# copied into a plugins directory as is. Installs the toolchains first (scripts/setup-examples.sh).
# Idempotent. Compiled components are cached by the host on first load, so the 12-18 MB
# JS/Python components start fast after the first time.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup-examples.sh
CACHE="${MLXHOST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mlxhost}"
TOOLS="$CACHE/tools"
cargo build -q -p mlxhost-componentize
ENCODE="$PWD/target/debug/mlxhost-componentize"
WIT="$PWD/wit"
EX="$PWD/examples"

# Rust: the guest SDK (plugins/sdk), wasm32 with build-std as in scripts/build-plugins.sh.
(cd "$EX/no-repeat-rust" && RUSTC=/usr/bin/rustc RUSTC_BOOTSTRAP=1 CARGO_TARGET_DIR="$PWD/../../plugins/target" \
  cargo build -q --release)
"$ENCODE" plugins/target/wasm32-unknown-unknown/release/no_repeat_rust.wasm "$EX/no-repeat-rust/no-repeat-rust.wasm"

# C: bindings from wit-bindgen, wasi-libc for malloc (no WASI imports remain), reactor module.
GEN=$(mktemp -d); trap 'rm -rf "$GEN"' EXIT
"$TOOLS/bin/wit-bindgen" c "$WIT" --world logits-processor-plugin --out-dir "$GEN" >/dev/null
clang-19 --target=wasm32-wasi -mexec-model=reactor -O2 -I "$GEN" \
  "$EX/no-repeat-c/no_repeat.c" "$GEN"/*.c "$GEN"/*_component_type.o -o "$GEN/core.wasm"
"$ENCODE" "$GEN/core.wasm" "$EX/no-repeat-c/no-repeat-c.wasm"

# JavaScript: componentize-js with every WASI feature disabled (the host grants none).
"$TOOLS/node_modules/.bin/componentize-js" "$EX/no-repeat-js/no-repeat.js" --wit "$WIT" \
  -n logits-processor-plugin -d stdio random clocks http fetch-event -o "$EX/no-repeat-js/no-repeat-js.wasm" >/dev/null

# JavaScript API adapter (WIT 0.2.0): the Ollama-style chat example.
"$TOOLS/node_modules/.bin/componentize-js" "$EX/ollama-js/ollama.js" --wit "$WIT/0.2.0" \
  -n api-adapter-plugin -d stdio random clocks http fetch-event -o "$EX/ollama-js/ollama-js.wasm" >/dev/null

# Python: componentize-py with WASI stubbed out.
(cd "$EX/no-repeat-py" && "$TOOLS/venv-componentize-py/bin/componentize-py" -d "$WIT" -w logits-processor-plugin \
  componentize app -o no-repeat-py.wasm --stub-wasi >/dev/null)
