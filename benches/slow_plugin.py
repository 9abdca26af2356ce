"""What one slow sampler costs the requests it shares a batch with (`--plugin-step-ms`).

Starts `mlxhost serve` once per setting, with the first-party plugins plus the test-only `spin`
sampler (loops until its deadline, `--sampler-deadline-ms`, default 1000), and per setting:

  alone:  one normal request (greedy, max_tokens 16), timed;
  mixed:  --slow requests naming `spin` and --normal normal requests at once, the normal ones
          timed end to end (p50 and worst), the slow ones' statuses and messages counted.

Settings: `--plugin-step-ms 50` (the default bound) and `--plugin-step-ms 100000`, which turns
the bound off (every call keeps its own 1 s deadline and no row is ever deferred: the behaviour
before the bound existed). Both in one run, so the ratio is side by side.

    benches/slow_plugin.sh [--bin target/release/mlxhost] [--slow 8] [--normal 8]
Standard library only; prints a table and writes --out (JSON).
"""
import argparse
import json
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plugins_with_spin(tmp):
    root = Path(tmp) / "plugins"
    root.mkdir()
    for name in ("standard", "openai"):
        shutil.copytree(ROOT / "plugins" / name, root / name, ignore=shutil.ignore_patterns("src", "target", "Cargo.*"))
    shutil.copytree(ROOT / "plugins" / "testing" / "spin", root / "spin", ignore=shutil.ignore_patterns("src", "Cargo.*"))
    return root


def post(url, body, timeout=600):
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, payload = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, payload = e.code, e.read()
    return time.monotonic() - started, status, payload


def run_setting(binary, plugins, step_ms, slow, normal, batch):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix="slow-plugin-", suffix=".log", delete=False)
    proc = subprocess.Popen([binary, "serve", "--port", str(port), "--plugins", str(plugins),
                             "--batch", str(batch), "--plugin-step-ms", str(step_ms)],
                            stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.time() + 300
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"server did not start: {Path(log.name).read_text()[-2000:]}")
            time.sleep(0.2)
        normal_body = {"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 16, "temperature": 0}
        slow_body = {**normal_body, "sampler": "spin", "max_tokens": 4}
        post(url, normal_body)  # warm
        alone = statistics.median(post(url, normal_body)[0] for _ in range(3))
        normal_times, slow_results = [], []

        def one_normal():
            t, status, _ = post(url, normal_body)
            normal_times.append((t, status))

        def one_slow():
            t, status, payload = post(url, slow_body)
            try:
                message = json.loads(payload)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = payload[:200].decode(errors="replace")
            slow_results.append((t, status, message))

        threads = [threading.Thread(target=one_slow) for _ in range(slow)]
        threads += [threading.Thread(target=one_normal) for _ in range(normal)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        times = sorted(t for t, _ in normal_times)
        return {
            "plugin_step_ms": step_ms,
            "alone_s": round(alone, 3),
            "normal_p50_s": round(statistics.median(times), 3),
            "normal_worst_s": round(times[-1], 3),
            "normal_statuses": sorted({s for _, s in normal_times}),
            "slow_worst_s": round(max(t for t, _, _ in slow_results), 3),
            "slow_statuses": sorted({s for _, s, _ in slow_results}),
            "slow_messages": sorted({m for _, _, m in slow_results}),
        }
    finally:
        proc.terminate()
        proc.wait(60)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=str(ROOT / "target" / "release" / "mlxhost"))
    ap.add_argument("--slow", type=int, default=8, help="requests naming the spin sampler (default 8)")
    ap.add_argument("--normal", type=int, default=8, help="normal requests beside them (default 8)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out", default="slow_plugin.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        plugins = plugins_with_spin(tmp)
        results = [run_setting(args.bin, plugins, ms, args.slow, args.normal, args.batch) for ms in (50, 100000)]
    print(f"{'--plugin-step-ms':>16} {'alone s':>8} {'normal p50 s':>13} {'normal worst s':>15} {'slow worst s':>13}  slow answers")
    for r in results:
        print(f"{r['plugin_step_ms']:>16} {r['alone_s']:>8} {r['normal_p50_s']:>13} {r['normal_worst_s']:>15} "
              f"{r['slow_worst_s']:>13}  {r['slow_statuses']} {r['slow_messages']}")
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
