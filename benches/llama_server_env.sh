# Sourced by the benchmarks that run llama.cpp's own programs beside mlxhost. Sets LLAMA_SERVER
# and LLAMA_BENCH: `llama-server` and `llama-bench` built once into $MLXHOST_CACHE/llama.cpp-0.3.16
# from the llama.cpp tree vendored in the llama-cpp-python 0.3.16 sdist (the llama.cpp that
# benches/llama_cpp_env.sh builds), with GGML_NATIVE=ON (AVX2/AVX-512 kernels for this CPU), no
# BLAS and static libraries, only those two targets, under nice (~4 minutes on 2 cores; the
# compiler's output goes to build.log there).
# Requires a C++ compiler and cmake (installed with scripts/apt-ensure.sh when missing).
CACHE="${MLXHOST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mlxhost}"
LLAMA_CPP_DIR="$CACHE/llama.cpp-0.3.16"
LLAMA_SERVER="$LLAMA_CPP_DIR/bin/llama-server"
LLAMA_BENCH="$LLAMA_CPP_DIR/bin/llama-bench"
if [ ! -x "$LLAMA_SERVER" ] || [ ! -x "$LLAMA_BENCH" ]; then
  command -v cmake >/dev/null || "$(dirname "${BASH_SOURCE[0]}")/../scripts/apt-ensure.sh" cmake
  (
    set -euo pipefail
    src="$LLAMA_CPP_DIR/src"  # the unpacked sdist; llama.cpp is its vendor/llama.cpp
    if [ ! -f "$src/vendor/llama.cpp/CMakeLists.txt" ]; then
      echo "llama_server_env: fetching the llama-cpp-python 0.3.16 sdist" >&2
      tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
      python3 -m pip download --quiet --no-binary :all: --no-deps llama-cpp-python==0.3.16 -d "$tmp"
      mkdir -p "$tmp/src" "$LLAMA_CPP_DIR"
      tar xzf "$tmp"/llama_cpp_python-0.3.16.tar.gz -C "$tmp/src" --strip-components=1
      rm -rf "$src"; mv "$tmp/src" "$src"
    fi
    echo "llama_server_env: building llama-server and llama-bench (once)" >&2
    build="$LLAMA_CPP_DIR/build"
    log="$LLAMA_CPP_DIR/build.log"
    { cmake -S "$src/vendor/llama.cpp" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DGGML_BLAS=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF &&
      nice -n 19 cmake --build "$build" --target llama-server llama-bench -j2; } >"$log" 2>&1 ||
      { tail -n 40 "$log" >&2; exit 1; }
    mkdir -p "$LLAMA_CPP_DIR/bin"
    cp "$build/bin/llama-server" "$build/bin/llama-bench" "$LLAMA_CPP_DIR/bin/"
  ) || { echo "llama_server_env: building llama.cpp failed" >&2; return 1; }
fi
export LLAMA_SERVER LLAMA_BENCH
