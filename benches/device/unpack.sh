#!/usr/bin/env bash
# On the GPU machine (device tool), after .gpu/{a,b,c,d} were copied to /tmp/g: installs MLX's CUDA
# build, mlx and mlx-lm into the image's python3 (whose site-packages hold the CUDA libraries the
# wheel's rpath points to), unpacks the binary, the plugins, OpenBLAS and the GGUF. Prints the
# environment to source: MLXHOST_BIN, GGUF, LD_LIBRARY_PATH (the CUDA libmlx first).
set -euo pipefail
cd "$(dirname "$0")/../.."
G=/tmp/g
cat $G/whl.aa $G/whl.ab > $G/mlx_cuda_13-0.32.2-py3-none-manylinux_2_35_x86_64.whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  $G/mlx_cuda_13-0.32.2-py3-none-manylinux_2_35_x86_64.whl $G/mlx-0.32.2-*.whl $G/mlx_lm-0.32.2-*.whl >&2
SITE=$(python3 -c 'import mlx, os; print(os.path.dirname(os.path.dirname(mlx.__path__[0] + "/x")))')
mkdir -p $G/lib && tar xzf $G/libs.tgz -C $G/lib
gunzip -c $G/mlxhost.gz > $G/mlxhost && chmod +x $G/mlxhost
tar xzf $G/plugins.tgz
[ -f $G/jit.tgz ] && tar xzf $G/jit.tgz -C /
mkdir -p $G/models
[ -f $G/gguf.aa ] && cat $G/gguf.aa $G/gguf.ab > $G/models/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f $G/tok.tgz ] && mkdir -p $G/tok && tar xzf $G/tok.tgz -C $G/tok
echo "export MLXHOST_BIN=$G/mlxhost GGUF=$G/models/SmolLM2-135M-Instruct.Q4_1.gguf MLX_DIR=$G/models/SmolLM2-135M-Instruct-mlx LD_LIBRARY_PATH=$SITE/mlx/lib:$G/lib MLXHOST_CACHE=$G/cache"
