# Sourced by the HTTP benchmarks after side_by_side.sh: builds the plugins, makes LOGS (a temp
# folder for the servers' stderr) and PIDS (servers started in the background, killed on exit),
# and defines wait_up URL LOG (waits up to 5 minutes for a server to answer URL, else prints the
# end of its LOG and exits 1).
./scripts/build-plugins.sh
LOGS=$(mktemp -d); PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$LOGS"' EXIT
wait_up() {  # $1 = url, $2 = log
  for _ in $(seq 600); do
    curl -sf "$1" >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  echo "server at $1 did not come up:" >&2; tail -20 "$2" >&2; exit 1
}
