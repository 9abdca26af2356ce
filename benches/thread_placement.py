"""Where a server's threads run while it decodes, and what placement does to the one-row step
(Linux; docs/benchmarks.md, "NVIDIA H200"). Against one running `mlxhost serve` (its PID):

1. the machine's CPU topology (SMT siblings, cores, packages, NUMA nodes) within our mask;
2. its threads, and which of them stay busy while no request runs (MLX 0.32's CUDA completion
   worker spins, `host/src/busy_threads.rs`);
3. C=1 streamed requests one after another (benches/stream_gaps.py's), each with the CPUs its
   busy threads ran on (sampled from /proc every ~5 ms) and the median per-token gap, in phases:
   `free` (placement left to the kernel), `pinned` (the evaluating thread pinned to one CPU at
   a time: the spinner's own CPU, its SMT sibling, other cores and packages; the spinner pinned
   where it was), `spinner-idle` (the spinner at SCHED_IDLE, placement free) and `free` again.

Usage: python3 thread_placement.py URL PID [REQUESTS_PER_CONFIG]   (env: MAX_TOKENS, default 128)
Prints one JSON line per request and per finding. Needs the right to set other threads'
affinity (same user or root). Standard library only.
"""
import json
import os
import statistics
import sys
import threading
import time

from stream_gaps import one as one_request


def cpu_topology(cpus):
    """{cpu: {"core": (package, core_id), "siblings": str, "node": int|None}} for `cpus`."""
    topo = {}
    for c in sorted(cpus):
        base = f"/sys/devices/system/cpu/cpu{c}"
        def read(name):
            try:
                with open(f"{base}/topology/{name}") as f:
                    return f.read().strip()
            except OSError:
                return None
        node = next((int(n[4:]) for n in (os.listdir(base) if os.path.isdir(base) else [])
                     if n.startswith("node") and n[4:].isdigit()), None)
        topo[c] = {"core": (read("physical_package_id"), read("core_id")),
                   "siblings": read("thread_siblings_list"), "node": node}
    return topo


def thread_stat(pid, tid):
    """(comm, last CPU, utime + stime ticks) of one thread, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            raw = f.read()
    except OSError:
        return None
    comm = raw[raw.index("(") + 1:raw.rindex(")")]
    fields = raw[raw.rindex(")") + 2:].split()
    # fields[0] is field 3 (state): utime = field 14, stime = 15, processor = 39.
    return comm, int(fields[36]), int(fields[11]) + int(fields[12])


def threads(pid):
    return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))


def busy_while_idle(pid, seconds=0.5):
    """Threads of `pid` that used at least 70% of a CPU over `seconds` with no request running."""
    hz = os.sysconf("SC_CLK_TCK")
    before = {t: thread_stat(pid, t) for t in threads(pid)}
    time.sleep(seconds)
    out = []
    for t, b in before.items():
        a = thread_stat(pid, t)
        if a and b and (a[2] - b[2]) / hz >= 0.7 * seconds:
            out.append(t)
    return out


class Sampler:
    """Samples every thread's CPU of `pid` every ~5 ms until stopped; per thread the CPUs seen
    (counts) and the CPU ticks used over the window."""

    def __init__(self, pid):
        self.pid = pid
        self.seen = {}
        self.stop_flag = threading.Event()
        self.start_ticks = {t: thread_stat(pid, t) for t in threads(pid)}
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop_flag.is_set():
            for t in threads(self.pid):
                s = thread_stat(self.pid, t)
                if s:
                    self.seen.setdefault(t, {}).setdefault(s[1], 0)
                    self.seen[t][s[1]] += 1
            time.sleep(0.005)

    def finish(self, seconds):
        self.stop_flag.set()
        self.thread.join()
        hz = os.sysconf("SC_CLK_TCK")
        out = {}
        for t, cpus in self.seen.items():
            b, a = self.start_ticks.get(t), thread_stat(self.pid, t)
            if not (a and b):
                continue
            share = (a[2] - b[2]) / hz / max(seconds, 1e-6)
            if share >= 0.1:
                out[f"{a[0]}:{t}"] = {"cpu_share": round(share, 2),
                                      "cpus": dict(sorted(cpus.items(), key=lambda kv: -kv[1])[:3])}
        return out


def sampled_request(url, pid, counter):
    """One C=1 request (stream_gaps.one's row, numbered `counter[0]`, then incremented) with
    `threads`: each busy thread of `pid` during it, its CPU share and the CPUs it ran on."""
    sampler = Sampler(pid)
    t0 = time.perf_counter()
    row = one_request(url, counter[0])
    counter[0] += 1
    row["threads"] = sampler.finish(time.perf_counter() - t0)
    return row


def evaluating_thread(url, pid, spinners, counter):
    """(tid, per-thread CPU use) of the evaluating thread: the busiest thread of `pid` during one
    request that is not one of `spinners`."""
    busy = sampled_request(url, pid, counter)["threads"]
    candidates = sorted(((v["cpu_share"], int(k.rsplit(":", 1)[1])) for k, v in busy.items()
                         if int(k.rsplit(":", 1)[1]) not in spinners), reverse=True)
    if not candidates:
        raise SystemExit("no busy thread found during a request")
    return candidates[0][1], busy


def own_cpu():
    with open("/proc/thread-self/stat") as f:
        raw = f.read()
    return int(raw[raw.rindex(")") + 2:].split()[36])


def run_config(url, pid, name, n, counter):
    rows = []
    for _ in range(n):
        row = sampled_request(url, pid, counter)
        row["config"] = name
        row["client_cpu"] = own_cpu()
        print(json.dumps(row), flush=True)
        rows.append(row)
    med = statistics.median(r["gap_median_ms"] for r in rows)
    print(json.dumps({"config": name, "median_gap_ms": med,
                      "gap_medians_ms": [r["gap_median_ms"] for r in rows]}), flush=True)
    return med


def main():
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    url, pid = sys.argv[1].rstrip("/"), int(sys.argv[2])
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    allowed = os.sched_getaffinity(0)
    topo = cpu_topology(allowed)
    print(json.dumps({"allowed_cpus": sorted(allowed),
                      "topology": {c: {**v, "core": "/".join(map(str, v["core"]))}
                                   for c, v in topo.items()}}), flush=True)
    spinners = busy_while_idle(pid)
    names = {t: (thread_stat(pid, t) or ("?",))[0] for t in threads(pid)}
    print(json.dumps({"threads": {str(t): n_ for t, n_ in names.items()},
                      "busy_while_idle": spinners}), flush=True)
    counter = [1000]
    run_config(url, pid, "free", n * 2, counter)

    engine, busy = evaluating_thread(url, pid, spinners, counter)
    print(json.dumps({"evaluating_thread": engine, "name": names.get(engine),
                      "during_request": busy}), flush=True)

    # Pinned: the spinner stays where it is, the evaluating thread moves CPU to CPU; this client
    # sits on a CPU that neither uses.
    spin_cpu = thread_stat(pid, spinners[0])[1] if spinners else None
    for s in spinners:
        os.sched_setaffinity(s, {thread_stat(pid, s)[1]})
    targets = []
    if spin_cpu is not None:
        targets.append(("spinner's CPU", spin_cpu))
        sib = [int(x) for x in (topo[spin_cpu]["siblings"] or "").replace("-", ",").split(",")
               if x.isdigit() and int(x) != spin_cpu and int(x) in allowed]
        if sib:
            targets.append(("spinner's SMT sibling", sib[0]))
    used_cores = {topo[c]["core"] for _, c in targets}
    for c in sorted(allowed):
        if len(targets) >= 8:
            break
        if topo[c]["core"] not in used_cores:
            targets.append((f"core {'/'.join(map(str, topo[c]['core']))}", c))
            used_cores.add(topo[c]["core"])
    spare = [c for c in sorted(allowed, reverse=True) if c not in {t for _, t in targets}]
    if spare:
        os.sched_setaffinity(0, {spare[0]})
    results = {}
    for label, cpu in targets:
        os.sched_setaffinity(engine, {cpu})
        results[f"{label} (cpu {cpu})"] = run_config(url, pid, f"engine on cpu {cpu}: {label}", n,
                                                    counter)
    os.sched_setaffinity(engine, allowed)
    os.sched_setaffinity(0, allowed)
    for s in spinners:
        os.sched_setaffinity(s, allowed)
    print(json.dumps({"pinned_median_gap_ms": results}), flush=True)

    if spinners:
        for s in spinners:
            os.sched_setscheduler(s, os.SCHED_IDLE, os.sched_param(0))
        run_config(url, pid, "spinner at SCHED_IDLE, placement free", n * 2, counter)
        for s in spinners:
            os.sched_setscheduler(s, os.SCHED_OTHER, os.sched_param(0))
    run_config(url, pid, "free again", n * 2, counter)


if __name__ == "__main__":
    main()
