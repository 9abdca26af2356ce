# Sourced by the benchmarks that compare with mlx-lm on identical files. Sets BIN (the release
# mlxhost, built), MLX_DIR (the installed SmolLM2 converted to the MLX layout, once), VENV (mlx-lm
# 0.32.2 in a venv under $MLXHOST_CACHE, once) and OPENBLAS (the system OpenBLAS, for LD_PRELOAD
# under mlx-lm's float32 runs).
CACHE="${MLXHOST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mlxhost}"
./scripts/setup.sh >/dev/null
cargo build --release -q -p mlxhost
BIN=target/release/mlxhost
MLX_DIR="$CACHE/models/SmolLM2-135M-Instruct-mlx"
[ -f "$MLX_DIR/model.safetensors" ] || "$BIN" convert "$CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf" "$MLX_DIR"
VENV="$CACHE/venv-mlx-lm-0.32.2"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import mlx_lm" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "mlx-lm==0.32.2" "mlx[cpu]"
fi
OPENBLAS=$(ls /usr/lib/*-linux-gnu/libopenblas.so.0 2>/dev/null | head -1)
# OpenBLAS 0.3.21 does not know this CPU and falls back to its SSE3 kernels; mlxhost re-runs
# itself with OPENBLAS_CORETYPE set (runtime::better_openblas_coretype), and the peers get the
# same kernels here so float32 runs compare like with like.
if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
  export OPENBLAS_CORETYPE="${OPENBLAS_CORETYPE:-SkylakeX}"
fi
