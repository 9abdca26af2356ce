"""What to do with MLX's spinning CUDA completion worker, measured on one running server
(Linux; docs/benchmarks.md, "NVIDIA H200", run 11). Against one `mlxhost serve` started with
`MLXHOST_ISOLATE_BUSY_THREADS=off` (its PID): finds the spinner (busy while idle) and the
evaluating thread (busiest during a request), then rotates placements over ROUNDS rounds, N
C=1 streamed requests each (benches/stream_gaps.py's), so slow drift of the machine falls on
every configuration alike:

- `free`: both threads SCHED_OTHER, any CPU;
- `spinner-idle`: the spinner at SCHED_IDLE, any CPU;
- `apart@X`: the evaluating thread pinned to CPU X, the spinner to another CPU;
- `together-idle@X`: both pinned to CPU X, the spinner at SCHED_IDLE, so it runs only when the
  evaluating thread waits and never holds MLX's worker mutex while the evaluating thread runs
  on another CPU.

After each request: the server's resident memory and the GPU's used memory (completion tasks
free MLX buffers; a starved worker would show as growth).

Usage: python3 spinner_modes.py URL PID [ROUNDS] [N]   (env: MAX_TOKENS, default 128)
Prints one JSON line per request and a summary per configuration. Standard library only.
"""
import json
import os
import statistics
import subprocess
import sys
import time

from thread_placement import busy_while_idle, evaluating_thread, sampled_request


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    return None


def gpu_used_mib():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        return int(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def place(engine, spinners, allowed, engine_cpus, spinner_cpus, spinner_idle):
    os.sched_setaffinity(engine, engine_cpus or allowed)
    for s in spinners:
        os.sched_setaffinity(s, spinner_cpus or allowed)
        policy = os.SCHED_IDLE if spinner_idle else os.SCHED_OTHER
        os.sched_setscheduler(s, policy, os.sched_param(0))


def main():
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    url, pid = sys.argv[1].rstrip("/"), int(sys.argv[2])
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    n = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    allowed = os.sched_getaffinity(0)
    spinners = busy_while_idle(pid)
    counter = [2000]
    engine, _ = evaluating_thread(url, pid, spinners, counter)
    cpus = sorted(allowed)
    xs = sorted({cpus[len(cpus) // 4], cpus[len(cpus) // 2]})
    other = {x: cpus[(cpus.index(x) + len(cpus) // 2 - 1) % len(cpus)] for x in xs}
    print(json.dumps({"spinners": spinners, "evaluating_thread": engine, "cpus": xs,
                      "apart_spinner_cpu": other}), flush=True)
    if not spinners:
        print(json.dumps({"note": "no spinner found; placements still rotated"}), flush=True)
    configs = [("free", None, None, False), ("spinner-idle", None, None, True)]
    for x in xs:
        if other[x] != x:  # with two CPUs there is no "apart"
            configs.append((f"apart@{x}", {x}, {other[x]}, False))
        configs.append((f"together-idle@{x}", {x}, {x}, True))
    gaps = {name: [] for name, *_ in configs}
    for r in range(rounds):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for name, ecpus, scpus, idle in order:
            place(engine, spinners, allowed, ecpus, scpus, idle)
            time.sleep(0.05)
            for _ in range(n):
                row = sampled_request(url, pid, counter)
                row.update(config=name, round=r, rss_mib=rss_mib(pid), gpu_used_mib=gpu_used_mib())
                print(json.dumps(row), flush=True)
                gaps[name].append(row["gap_median_ms"])
    place(engine, spinners, allowed, None, None, False)
    for name, g in gaps.items():
        print(json.dumps({"config": name, "median_gap_ms": statistics.median(g),
                          "min_ms": min(g), "max_ms": max(g), "gap_medians_ms": g}), flush=True)


if __name__ == "__main__":
    main()
