#!/usr/bin/env python3
"""Sweeps MLX's and mlxhost's environment knobs over `mlxhost bench` on one machine, alternating
configurations round by round so the machine's drift hits each alike, and prints the median
decode ms/token (and graph-building ms) per configuration and batch size.

Usage: gpu_knobs.py BIN MODEL [--rounds N] [--batch 1 8] [--decode-tokens 256]
                    [--config NAME=K=V,K=V ...] [--generate PROMPT --plugins DIR]
With --generate it also runs `mlxhost generate` once per configuration and round (the engine's
step with the plugin chain and logprob reads, as `serve` runs it) and reports its decode tok/s.
Without --config it sweeps the knobs that decide how MLX's CUDA backend launches a step
(docs/benchmarks.md, "Run 9", "Launch knobs"): MLX's default (the kernels per CUDA graph
commit, MLX_MAX_OPS_PER_BUFFER, is 100 on compute capability 9.0/10.0/12.0 and 20 elsewhere in
MLX 0.32, `get_graph_limits` in mlx/backend/cuda/device.cpp), 20 and 300 kernels per commit,
CUDA graphs off (MLX_USE_CUDA_GRAPHS=0), decode rows attending over their own caches instead of
the slab (MLXHOST_DECODE_ATTENTION=per-row), and the slab through MLX's SDPA instead of
mlxhost's kernel (MLXHOST_SLAB_ATTENTION=sdpa). `default` always runs with every swept
key removed from the environment.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys

DEFAULT_CONFIGS = [
    "default=",
    "ops20=MLX_MAX_OPS_PER_BUFFER=20",
    "ops300=MLX_MAX_OPS_PER_BUFFER=300",
    "graphs_off=MLX_USE_CUDA_GRAPHS=0",
    "per_row=MLXHOST_DECODE_ATTENTION=per-row",
    "slab_sdpa=MLXHOST_SLAB_ATTENTION=sdpa",
]


def parse_config(spec):
    name, _, rest = spec.partition("=")
    env = {}
    for item in filter(None, rest.split(",")):
        k, sep, v = item.partition("=")
        if not sep:
            sys.exit(f"--config {spec!r}: {item!r} is not KEY=VALUE")
        env[k] = v
    return name, env


def env_for(env, swept):
    """This process's environment without any swept key, then `env` on top."""
    run_env = {k: v for k, v in os.environ.items() if k not in swept}
    run_env.update(env)
    return run_env


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bin")
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--config", action="append", default=None)
    ap.add_argument("--generate", help="prompt for an `mlxhost generate` run per config and round")
    ap.add_argument("--plugins", default="plugins")
    args = ap.parse_args()
    configs = [parse_config(c) for c in (args.config or DEFAULT_CONFIGS)]
    swept = {k for _, env in configs for k in env}
    results = {}
    gen = {}
    for r in range(args.rounds):
        # Rotate the order each round.
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for name, env in order:
            for batch in args.batch:
                run_env = env_for(env, swept)
                p = subprocess.run(
                    [args.bin, "bench", "--model", args.model, "--prompt-tokens",
                     str(args.prompt_tokens), "--decode-tokens", str(args.decode_tokens),
                     "--batch", str(batch)],
                    capture_output=True, text=True, env=run_env)
                if p.returncode != 0:
                    print(json.dumps({"config": name, "batch": batch, "error": p.stderr[-500:]}),
                          flush=True)
                    continue
                out = json.loads(p.stdout.strip().splitlines()[-1])
                row = {"config": name, "batch": batch, "round": r,
                       "decode_ms_per_step": round(out["decode_ms_per_step"], 3),
                       "decode_mean_ms": round(out.get("decode_mean_ms_per_step", float("nan")), 3),
                       "graph_build_ms": round(out["decode_graph_build_ms"], 3)}
                print(json.dumps(row), flush=True)
                results.setdefault((name, batch), []).append(row)
            if args.generate:
                run_env = env_for(env, swept)
                run_env["MLXHOST_LOG"] = "mlxhost::engine=debug"
                p = subprocess.run(
                    [args.bin, "generate", "--model", args.model, "--plugins", args.plugins,
                     "--prompt", args.generate, "--max-tokens", str(args.decode_tokens)],
                    capture_output=True, text=True, env=run_env)
                # "generation: N tokens, X tok/s | plugins: Y% of decode time"
                m = re.search(r"generation: (\d+) tokens, ([-\d.e+]+) tok/s \| plugins: ([-\d.e+]+)%",
                              p.stderr)
                if p.returncode != 0 or not m:
                    print(json.dumps({"config": name, "generate_error": p.stderr[-500:]}),
                          flush=True)
                    continue
                row = {"config": name, "round": r, "generate_tokens": int(m.group(1)),
                       "generate_tok_s": float(m.group(2)), "plugin_share": float(m.group(3))}
                # The engine's per-step breakdown for one-row steps (engine::generate's
                # "step timing" debug line).
                t = re.search(r"step timing rows=1 steps=\d+ step_ms=([-\d.e+]+) "
                              r"forward_graph_ms=([-\d.e+]+) forward_build_ms=([-\d.e+]+) plugin_ms=([-\d.e+]+) "
                              r"eval_ms=([-\d.e+]+)",
                              p.stderr)
                # engine::generate's "step spread" line: the median one-request step.
                sp = re.search(r"step spread steps=\d+ median=([-\d.e+]+) mean=([-\d.e+]+)"
                               r"(?: p90=[-\d.e+]+ p99=([-\d.e+]+) slowest=(\[[^\]]*\]))?",
                               p.stderr)
                if sp:
                    row.update(step_median_ms=float(sp.group(1)), step_mean_ms=float(sp.group(2)))
                    if sp.group(3):
                        row.update(step_p99_ms=float(sp.group(3)), slowest_ms=sp.group(4))
                if t:
                    row.update(step_ms=float(t.group(1)), forward_ms=float(t.group(2)),
                               build_ms=float(t.group(3)), plugin_ms=float(t.group(4)),
                               eval_ms=float(t.group(5)))
                print(json.dumps(row), flush=True)
                gen.setdefault(name, []).append(row)
    print("\n| config | batch | decode ms/step (median) | runs | mean ms/step | graph build ms |")
    print("|---|---:|---:|---|---:|---:|")
    for (name, batch), rows in results.items():
        steps = [x["decode_ms_per_step"] for x in rows]
        builds = [x["graph_build_ms"] for x in rows]
        print(f"| {name} | {batch} | {statistics.median(steps):.2f} | "
              f"{', '.join(f'{s:.2f}' for s in steps)} | "
              f"{statistics.median(x['decode_mean_ms'] for x in rows):.2f} | "
              f"{statistics.median(builds):.2f} |")
    if gen:
        print("\n| config | generate tok/s (median) | runs | tokens | plugin share % | "
              "step ms median / mean | mean step ms (forward incl. launch, plugins, eval) |")
        print("|---|---:|---|---:|---:|---|---|")
        for name, rows in gen.items():
            rates = [x["generate_tok_s"] for x in rows]
            print(f"| {name} | {statistics.median(rates):.1f} | "
                  f"{', '.join(f'{x:.1f}' for x in rates)} | {rows[0]['generate_tokens']} | "
                  f"{statistics.median(x['plugin_share'] for x in rows):.1f} | "
                  f"{spread(rows)} | {step_breakdown(rows)} |")


def spread(rows):
    """Median over runs of each run's median and mean step ms."""
    timed = [x for x in rows if "step_median_ms" in x]
    if not timed:
        return "-"
    return (f"{statistics.median(x['step_median_ms'] for x in timed):.2f} / "
            f"{statistics.median(x['step_mean_ms'] for x in timed):.2f}")


def step_breakdown(rows):
    """Median one-row step ms and its parts, from the rows that logged them."""
    timed = [x for x in rows if "step_ms" in x]
    if not timed:
        return "-"
    med = {k: statistics.median(x[k] for x in timed)
           for k in ("step_ms", "forward_ms", "build_ms", "plugin_ms", "eval_ms")}
    return (f"{med['step_ms']:.2f} ({med['forward_ms']:.2f} of which build {med['build_ms']:.2f}, "
            f"{med['plugin_ms']:.2f}, {med['eval_ms']:.2f})")


if __name__ == "__main__":
    main()
