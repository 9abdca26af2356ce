"""TTFT over HTTP for a ~4k-token conversation, in one run: cold prefill, a RAM prompt-cache hit
(the same conversation resent with one more user turn, as agents do), and an SSD restore after a
server restart with the cache files evicted from the OS page cache (posix_fadvise DONTNEED).
Starts and restarts the server itself. Standard library only.

Usage: python prompt_cache.py MLXHOST_BIN   (env: REPEATS=2, TURNS=30, PORT=18090)
"""
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from http_bench import stream_chat  # noqa: E402

BIN = sys.argv[1]
REPEATS = int(os.environ.get("REPEATS", "2"))
TURNS = int(os.environ.get("TURNS", "30"))
PORT = int(os.environ.get("PORT", "18090"))
URL = f"http://127.0.0.1:{PORT}"
PARAGRAPH = ("The lighthouse keeper logged the wind, the swell and every passing ship, and in the evenings "
             "he repaired the lamp, polished the lens and wrote long letters to his sister in the city. ")


def get(path):
    with urllib.request.urlopen(URL + path, timeout=10) as r:
        return json.loads(r.read())


def start(ssd_dir, log):
    proc = subprocess.Popen([BIN, "serve", "--plugins", "plugins", "--port", str(PORT), "--prompt-cache", "2",
                             "--ssd-cache", ssd_dir], stdout=subprocess.DEVNULL, stderr=log)
    for _ in range(1200):
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}")
        try:
            if get("/health").get("status") == "ok":
                return proc
        except OSError:
            pass
        time.sleep(0.25)
    raise TimeoutError("server not ready")


def stop(proc):
    proc.send_signal(signal.SIGTERM)  # a clean stop writes what is pending
    proc.wait(120)


def evict_page_cache(root):
    """Drops the cache files' pages from the OS page cache (they were fsynced, so clean)."""
    files = 0
    for dirpath, _, names in os.walk(root):
        for n in names:
            fd = os.open(os.path.join(dirpath, n), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            files += 1
    return files


def resident(root):
    """Resident pages of the cache files (util-linux `fincore`), for the record."""
    paths = [os.path.join(d, n) for d, _, ns in os.walk(os.path.join(root, "v1")) for n in ns]
    if not paths or not shutil.which("fincore"):
        return None
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *paths],
                         capture_output=True, text=True).stdout.split()
    return sum(int(x) for x in out if x.isdigit())


def ttft(messages):
    first, _, usage, _ = stream_chat(URL, {
        "messages": messages, "max_tokens": 8, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}})
    return first, usage


def one_run(rep, ssd_dir, log):
    messages = [{"role": "system", "content": f"Session {rep} {time.time()}. You summarize logbooks."}]
    for i in range(TURNS):
        messages.append({"role": "user", "content": f"Entry {i}: " + PARAGRAPH * 3})
        messages.append({"role": "assistant", "content": f"Noted entry {i}."})
    messages.append({"role": "user", "content": "Summarize the log in one sentence."})
    proc = start(ssd_dir, log)
    try:
        t_cold, u_cold = ttft(messages)
        t_ram, u_ram = ttft(messages + [{"role": "assistant", "content": "The keeper kept the light."},
                                        {"role": "user", "content": "And what did he write?"}])
        while True:  # the write-behind snapshot, once requests settle
            s = get("/stats")["ssd_cache"]
            if s["writes"] >= 1 and s["pending_writes"] == 0:
                break
            time.sleep(0.2)
    finally:
        stop(proc)
    files = evict_page_cache(ssd_dir)
    res = resident(ssd_dir)
    proc = start(ssd_dir, log)
    try:
        t_ssd, u_ssd = ttft(messages + [{"role": "assistant", "content": "The keeper kept the light."},
                                        {"role": "user", "content": "What was the weather like?"}])
        s = get("/stats")["ssd_cache"]
    finally:
        stop(proc)
    print(f"# rep {rep}: cold {t_cold:.3f} s ({u_cold['prompt_tokens']} tokens), RAM hit {t_ram:.3f} s "
          f"({u_ram['prompt_tokens_details']['cached_tokens']} of {u_ram['prompt_tokens']} cached), "
          f"SSD restore after restart {t_ssd:.3f} s ({u_ssd['prompt_tokens_details']['cached_tokens']} of "
          f"{u_ssd['prompt_tokens']} restored; restore {s['last_restore_ms']:.0f} ms; {files} files, "
          f"{s['bytes'] / 2**20:.0f} MiB, resident after eviction: {res} bytes)", file=sys.stderr)
    assert s["hits"] == 1, s
    return {"cold": t_cold, "ram": t_ram, "ssd": t_ssd, "prompt_tokens": u_cold["prompt_tokens"],
            "ram_cached": u_ram["prompt_tokens_details"]["cached_tokens"],
            "ssd_cached": u_ssd["prompt_tokens_details"]["cached_tokens"],
            "restore_ms": s["last_restore_ms"], "ssd_bytes": s["bytes"]}


def main():
    runs = []
    with tempfile.TemporaryDirectory(prefix="mlxhost-ssd-bench-") as tmp, \
            open(os.path.join(tmp, "server.log"), "w") as log:
        for rep in range(REPEATS):
            ssd_dir = os.path.join(tmp, f"ssd-{rep}")
            runs.append(one_run(rep, ssd_dir, log))
    med = {k: statistics.median(r[k] for r in runs) for k in ("cold", "ram", "ssd", "restore_ms")}
    print(json.dumps({"prompt_tokens": runs[0]["prompt_tokens"], "ttft_cold_s": med["cold"],
                      "ttft_ram_hit_s": med["ram"], "ttft_ssd_restore_s": med["ssd"],
                      "ssd_restore_ms": med["restore_ms"], "ssd_bytes": runs[0]["ssd_bytes"],
                      "ram_cached_tokens": runs[0]["ram_cached"], "ssd_cached_tokens": runs[0]["ssd_cached"],
                      "speedup_ram": med["cold"] / med["ram"], "speedup_ssd": med["cold"] / med["ssd"],
                      "runs": REPEATS}))


if __name__ == "__main__":
    main()
