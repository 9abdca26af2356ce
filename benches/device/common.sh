# Sourced by the scripts in benches/device/ after unpack.sh's environment: the repository root as
# the working folder, BIN, OUT (default ./$1-out, created), the converted model at $MLX_DIR, and
# `up URL` (waits for a server; prints the seconds it took).
: "${MLX_DIR:?set by benches/device/unpack.sh}" "${GGUF:?set by benches/device/unpack.sh}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-$1-out}"; mkdir -p "$OUT"
BIN="${MLXHOST_BIN:-target/release/mlxhost}"
nvidia-smi -L
[ -f "$MLX_DIR/model.safetensors" ] || "$BIN" convert "$GGUF" "$MLX_DIR"
up() {
  local t0=$SECONDS
  for _ in $(seq 900); do curl -sf "$1" >/dev/null && { echo $((SECONDS - t0)); return 0; }; sleep 0.5; done
  echo "not up: $1" >&2; return 1
}
