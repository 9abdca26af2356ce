#!/usr/bin/env bash
# Prefill against llama.cpp's own server, one run on the same GGUF and the same token ids (issue
# 44): TTFT of a 512- and a 19000-token prompt (`max_tokens: 1`, cold: no prompt cache on either
# side), mlxhost serve vs llama-server built from the llama.cpp vendored in llama-cpp-python
# 0.3.16 (benches/llama_server_env.sh builds it once). benches/prefill_ttft.py starts both servers
# and does the requests; arguments go to it.
#   benches/prefill_ttft.sh --model qwen2.5-coder-1.5b          # --lengths 512,19000 --repeats 1
#   benches/prefill_ttft.sh --lengths 512 --out prefill.json    # BUILD=0: use the built binary as is
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${BUILD:-1}" != 0 ]; then
  ./scripts/setup.sh >/dev/null
  cargo build --release -q -p mlxhost
  ./scripts/build-plugins.sh
fi
. benches/llama_server_env.sh
python3 benches/prefill_ttft.py "$@"
