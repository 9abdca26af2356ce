# Sourced by the benchmarks that run llama.cpp beside mlxhost. Sets LLAMA_VENV: a venv under
# $MLXHOST_CACHE with llama-cpp-python 0.3.16 (which vendors llama.cpp), built once from source
# (~10 minutes on 2 cores) with GGML_NATIVE=ON, what a user building llama.cpp on this machine
# gets (AVX2/AVX-512 kernels for this CPU).
CACHE="${MLXHOST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mlxhost}"
LLAMA_VENV="$CACHE/venv-llama-cpp-0.3.16"
if [ ! -x "$LLAMA_VENV/bin/python" ] || ! "$LLAMA_VENV/bin/python" -c "import llama_cpp" 2>/dev/null; then
  python3 -m venv "$LLAMA_VENV"
  CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_BLAS=OFF -DLLAMA_CURL=OFF" \
    "$LLAMA_VENV/bin/pip" install -q "llama-cpp-python==0.3.16"
fi
