#!/usr/bin/env bash
# Packs what the GPU runs need into .gpu/{a,b,c,d} (git-ignored through .git/info/exclude), each
# under the `device` tool's 64 MiB per call: MLX's CUDA wheel (mlx-cuda-13 at the version the build
# links) in two parts, mlx and mlx-lm 0.32.2 for the peer, the stripped release binary, the
# plugins, the system OpenBLAS it links, and the SmolLM2 GGUF in two parts. Each call of the device
# tool carries one folder and copies it to /tmp/g there; the last runs benches/device/unpack.sh.
# Nothing on the GPU machine can reach a registry, hence the carrying. See docs/gpu.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
CACHE="${MLXHOST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mlxhost}"
WHEELS="$CACHE/device-wheels"
mkdir -p "$WHEELS"
for p in mlx-cuda-13==0.32.2 mlx==0.32.2 mlx-lm==0.32.2; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_17_x86_64 -d "$WHEELS" "$p"
done
# (git rev-parse: .git is a file in a worktree.)
EXCLUDE=$(git rev-parse --git-path info/exclude)
grep -qx '/.gpu/' "$EXCLUDE" 2>/dev/null || { mkdir -p "$(dirname "$EXCLUDE")"; echo /.gpu/ >> "$EXCLUDE"; }
rm -rf .gpu && mkdir -p .gpu/a .gpu/b .gpu/c .gpu/d
split -b 44000000 "$WHEELS"/mlx_cuda_13-0.32.2-*.whl .gpu/whl.
mv .gpu/whl.aa .gpu/a/; mv .gpu/whl.ab .gpu/b/
cp "$WHEELS"/mlx-0.32.2-cp312-*.whl "$WHEELS"/mlx_lm-0.32.2-*.whl .gpu/a/
(cd /usr/lib/x86_64-linux-gnu && tar czhf - libopenblas.so.0 libgfortran.so.5 libquadmath.so.0) > .gpu/a/libs.tgz
strip -o .gpu/mlxhost target/release/mlxhost && gzip -1 -c .gpu/mlxhost > .gpu/b/mlxhost.gz && rm .gpu/mlxhost
tar czf .gpu/b/plugins.tgz plugins/*/*.wasm
if [ "${NO_GGUF:-0}" = 1 ]; then
  # Real-shape runs (benches/device/real_shapes.sh) need no GGUF; the binary goes alone in c.
  mv .gpu/b/mlxhost.gz .gpu/c/
else
  split -n 2 "$CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf" .gpu/gguf.
  mv .gpu/gguf.aa .gpu/c/; mv .gpu/gguf.ab .gpu/d/
fi
# Tokenizer files for benches/make_real_shape.py (e.g. `mlxhost convert` of the Qwen2.5-Coder-0.5B
# GGUF): TOKENIZER_DIR, packed as c/tok.tgz.
if [ -n "${TOKENIZER_DIR:-}" ]; then
  tar czf .gpu/c/tok.tgz -C "$TOKENIZER_DIR" $(cd "$TOKENIZER_DIR" && ls | grep -v -e '\.safetensors$' -e '^config\.json$')
fi
# Optional: MLX's and the CUDA driver's kernel caches brought back from an earlier run
# (`tar czf - /tmp/mlx /root/.nv/ComputeCache` there): a cold start compiles for ~200 s.
# benches/device/wave.sh brings them back as jit.tgz. They ride in c when c stays under ~50 MB (the
# working tree travels with every call), else in a call of their own (e).
if [ -f "$CACHE/device-jit/jit.tgz" ]; then
  if [ $(( $(du -sb .gpu/c | cut -f1) + $(stat -c %s "$CACHE/device-jit/jit.tgz") )) -lt 50000000 ]; then
    cp "$CACHE/device-jit/jit.tgz" .gpu/c/
  else
    mkdir -p .gpu/e; cp "$CACHE/device-jit/jit.tgz" .gpu/e/
  fi
fi
du -sh .gpu/*
