#!/usr/bin/env python3
"""Teacher-forced drift of a quantized KV cache (--kv-bits) against the float cache.

For each position P in POSITIONS, the COUNT tokens after the first P tokens of a natural text
(the repository's docs, concatenated and repeated as needed), teacher-forced: one `mlxhost score`
row per position, once per scheme (float, then each --kv-bits), on the same binary and model. Per
scheme and position it reports, against float: the mean and max |delta| of the reference token's
logprob, the max |delta| over float's top-5 logprobs (at the same ids), how often the top-1 id is
the same, and how often top-1 agrees where float's top-2 gap is over 0.1 nats (semantics.md's
near-tie rule: a flip inside a near-tie is not a divergence).

    benches/kv_quant_drift.py MODEL.gguf TOKENIZER.json [--positions 1024,8192] [--bits 8,4]
Prints one JSON line per (scheme, position). Needs the `tokenizers` package (any venv).
"""
import argparse, glob, json, os, subprocess, sys, tempfile

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("tokenizer")
ap.add_argument("--positions", default="1024,8192,16384")
ap.add_argument("--bits", default="8,4")
ap.add_argument("--count", type=int, default=64)
ap.add_argument("--group-size", type=int, default=64)
ap.add_argument("--bin", default=os.environ.get("MLXHOST_BIN", "target/release/mlxhost"))
args = ap.parse_args()

from tokenizers import Tokenizer

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
text = "\n\n".join(open(p, encoding="utf-8").read() for p in sorted(glob.glob(os.path.join(root, "docs", "*.md"))))
ids = Tokenizer.from_file(args.tokenizer).encode(text).ids
positions = [int(p) for p in args.positions.split(",")]
need = max(positions) + args.count
while len(ids) < need:
    ids = ids + ids
# One row per position (a row scoring everything from the first window on would hold logits
# for every position: 7k x 262k floats on Gemma 3, more memory than this machine has).
lines = [json.dumps({"prompt_ids": ids[:p], "continuation_ids": ids[p:p + args.count]}) for p in positions]
inp = tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False)
inp.write("\n".join(lines) + "\n")
inp.close()


def score(extra):
    run = subprocess.run([args.bin, "score", "--model", args.model, "--input", inp.name, "--top-logprobs", "5"] + extra,
                         capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"mlxhost score {' '.join(extra)} failed ({run.returncode}): {run.stderr.strip()[-2000:]}")
    out = run.stdout
    return [json.loads(l)["steps"] for l in out.splitlines() if l.startswith("{")]


base = score([])
for bits in [int(b) for b in args.bits.split(",")]:
    quant = score(["--kv-bits", str(bits), "--kv-group-size", str(args.group_size)])
    for p, fs, qs in zip(positions, base, quant):
        ref = [abs(f["logprob"] - q["logprob"]) for f, q in zip(fs, qs)]
        top5 = []
        same, clear, clear_same = 0, 0, 0
        for f, q in zip(fs, qs):
            qd = dict((int(i), lp) for i, lp in q["top"])
            top5 += [abs(lp - qd[int(i)]) for i, lp in f["top"] if int(i) in qd]
            agree = f["top"][0][0] == q["top"][0][0]
            same += agree
            if f["top"][0][1] - f["top"][1][1] > 0.1:
                clear += 1
                clear_same += agree
        print(json.dumps({
            "model": os.path.basename(args.model), "kv_bits": bits, "group_size": args.group_size,
            "position": p, "tokens": len(fs),
            "ref_logprob_mean_abs": round(sum(ref) / len(ref), 5), "ref_logprob_max_abs": round(max(ref), 5),
            "top5_logprob_max_abs": round(max(top5), 5),
            "top1_agree": f"{same}/{len(fs)}", "top1_agree_outside_near_ties": f"{clear_same}/{clear}",
        }), flush=True)
os.unlink(inp.name)
