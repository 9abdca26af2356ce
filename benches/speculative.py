"""Speculative decoding benchmark client for benches/speculative.sh: one `mlxhost serve`, the
same prompts without speculation and with each drafter (`"speculative": {"drafter": NAME}` vs
`"speculative": false`, so one server, one model load; `draft-model` where the server has
`--draft-model`). Greedy, and the server runs without a
prompt cache (`--prompt-cache 0`, benches/speculative.sh), so both sides get the same prompts,
prefill them whole and write the same replies.

Two prompt sets: code edits ("rewrite this 60-line function renaming X to Y": the reply repeats
the function with one name changed, the case prompt lookup is for) and free text (short stories:
little to look up). At batch 1 (requests one after another) and at concurrency 8 (8 requests at
once): aggregate tok/s (completion tokens / wall time, prefill included) and decode tok/s (one
stream's rate after its first token: tokens after the first / time from the first content chunk
to the last, summed over requests), with the server's drafted / accepted counters (/stats,
`batch.speculative`).

Without and with each drafter alternate (request by request at batch 1, round by round at
concurrency 8), ROUNDS times, and each mode's rounds are summed: a machine whose load changes meanwhile slows both
alike.

Usage: python speculative.py URL     Env: MAX_TOKENS (256), N1 (prompts per set at batch 1, 3),
LEVELS ("1 8"), SETS ("code-edit free-text"), ROUNDS (2), DRAFTERS (space-separated drafter
names, "prompt-lookup"; DRAFTER, one name, is read where DRAFTERS is unset), N_MAX (draft length
bound; the server's when unset). Prints one JSON line per (set, level, mode), then a table
with the speed-ups.
"""
import json
import os
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(__file__))
from http_bench import stream_chat  # noqa: E402

MAX_TOKENS = int(os.environ.get("MAX_TOKENS", "256"))
N1 = int(os.environ.get("N1", "3"))
LEVELS = [int(x) for x in os.environ.get("LEVELS", "1 8").split()]
SETS = os.environ.get("SETS", "code-edit free-text").split()
ROUNDS = int(os.environ.get("ROUNDS", "2"))
DRAFTERS = os.environ.get("DRAFTERS", os.environ.get("DRAFTER", "prompt-lookup")).split()
N_MAX = os.environ.get("N_MAX")

# A 60-line function in the style of real code (each line different), and the names a code-edit
# prompt renames in it (every one occurs several times).
FUNCTION = """def summarize_orders(records, config, threshold=100):
    \"\"\"Group paid orders by customer and flag the ones above threshold.\"\"\"
    totals = {}
    errors = []
    count = 0
    currency = config.get("currency", "EUR")
    cutoff = config.get("since")
    for record in records:
        if record.get("status") != "paid":
            continue
        if cutoff is not None and record["created_at"] < cutoff:
            continue
        customer = record.get("customer_id")
        if customer is None:
            errors.append(("missing customer", record.get("id")))
            continue
        try:
            amount = float(record["amount"])
        except (KeyError, TypeError, ValueError) as exc:
            errors.append((str(exc), record.get("id")))
            continue
        if record.get("currency", currency) != currency:
            rate = config["rates"].get(record["currency"])
            if rate is None:
                errors.append(("unknown currency", record.get("id")))
                continue
            amount = amount * rate
        entry = totals.setdefault(customer, {"orders": 0, "amount": 0.0, "items": set()})
        entry["orders"] += 1
        entry["amount"] += amount
        for item in record.get("items", []):
            entry["items"].add(item["sku"])
        count += 1
    flagged = []
    for customer, entry in sorted(totals.items()):
        average = entry["amount"] / entry["orders"]
        if entry["amount"] >= threshold:
            flagged.append(
                {
                    "customer": customer,
                    "total": round(entry["amount"], 2),
                    "average": round(average, 2),
                    "distinct_items": len(entry["items"]),
                }
            )
    flagged.sort(key=lambda row: row["total"], reverse=True)
    limit = config.get("limit")
    if limit is not None:
        flagged = flagged[:limit]
    report = {
        "currency": currency,
        "orders_counted": count,
        "customers": len(totals),
        "flagged": flagged,
        "errors": errors,
    }
    if config.get("verbose"):
        for message, order_id in errors:
            print(f"order {order_id}: {message}")
    return report"""
NAMES = [("totals", "per_customer"), ("errors", "problems"), ("flagged", "large_accounts"),
         ("config", "settings"), ("entry", "summary"), ("average", "mean"), ("count", "n_counted"),
         ("threshold", "min_total")]
TOPICS = ["a lighthouse keeper", "a baker", "a sailor", "a clockmaker", "a gardener", "a pilot",
          "a librarian", "a blacksmith"]


def prompt(kind, i):
    if kind == "code-edit":
        old, new = NAMES[i % len(NAMES)]
        return (f"Rewrite this function, renaming `{old}` to `{new}`. "
                f"Reply with the whole function only.\n\n```python\n{FUNCTION}\n```")
    return f"Write a short story about {TOPICS[i % len(TOPICS)]}."


def body(kind, i, drafter):
    b = {"model": "default_model", "messages": [{"role": "user", "content": prompt(kind, i)}],
         "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
         "stream_options": {"include_usage": True}}
    if drafter:
        s = {"drafter": drafter}
        if N_MAX:
            s["n_max"] = int(N_MAX)
        b["speculative"] = s
    else:
        b["speculative"] = False
    return b


def spec_stats(url):
    with urllib.request.urlopen(url + "/stats", timeout=60) as r:
        s = json.load(r)["batch"]["speculative"]
    return s["drafted"], s["accepted"]


def run_round(url, kind, level, drafter, first_prompt=0):
    """One round: at level 1 one request (prompt `first_prompt`), else `level` requests at once;
    with `drafter` (None: no speculation)."""
    n = 1 if level == 1 else level
    results = [None] * n
    d0, a0 = spec_stats(url)

    def one(i):
        first, last, usage, chunks = stream_chat(url, body(kind, first_prompt + i, drafter))
        tokens = usage["completion_tokens"] if usage else chunks
        decode = (last - first) if first is not None and last is not None else 0.0
        results[i] = (tokens, decode)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    d1, a1 = spec_stats(url)
    return {"set": kind, "level": level, "mode": drafter or "none", "requests": n,
            "completion_tokens": sum(r[0] for r in results), "wall_s": wall,
            "decode_tokens": sum(r[0] - 1 for r in results), "decode_s": sum(r[1] for r in results),
            "drafted": d1 - d0, "accepted": a1 - a0}


def merge(rounds):
    """Sums rounds of one (set, level, mode): aggregate tok/s = completion tokens / wall time;
    decode tok/s = one stream's rate after its first token (tokens after the first / time from
    the first content chunk to the last, summed over requests)."""
    r = {k: rounds[0][k] for k in ["set", "level", "mode"]}
    for k in ["requests", "completion_tokens", "wall_s", "decode_tokens", "decode_s", "drafted",
              "accepted"]:
        r[k] = sum(x[k] for x in rounds)
    r["aggregate_tok_s"] = round(r["completion_tokens"] / r["wall_s"], 2)
    r["decode_tok_s"] = round(r["decode_tokens"] / r["decode_s"], 2) if r["decode_s"] else 0.0
    r["acceptance"] = round(r["accepted"] / r["drafted"], 3) if r["drafted"] else None
    r["wall_s"] = round(r["wall_s"], 2)
    r["decode_s"] = round(r["decode_s"], 2)
    return r


def main():
    url = sys.argv[1]
    rows = []
    for kind in SETS:
        for level in LEVELS:
            modes = [None] + DRAFTERS
            runs = {m: [] for m in modes}
            # The modes alternate request by request at level 1, round by round at 8.
            for _ in range(ROUNDS):
                for i in range(N1 if level == 1 else 1):
                    for m in modes:
                        runs[m].append(run_round(url, kind, level, m, i))
            for m in modes:
                r = merge(runs[m])
                print(json.dumps(r), flush=True)
                rows.append(r)
    print(f"\n{'set':10} {'level':>5} {'mode':>14} {'agg tok/s':>10} {'decode tok/s':>12} "
          f"{'accept':>7} {'agg x':>7} {'decode x':>8}")
    for r in rows:
        base = next(b for b in rows if b["set"] == r["set"] and b["level"] == r["level"]
                    and b["mode"] == "none")
        up = r["aggregate_tok_s"] / base["aggregate_tok_s"] if base["aggregate_tok_s"] else 0
        dup = r["decode_tok_s"] / base["decode_tok_s"] if base["decode_tok_s"] else 0
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        print(f"{r['set']:10} {r['level']:>5} {r['mode']:>14} {r['aggregate_tok_s']:>10.1f} "
              f"{r['decode_tok_s']:>12.1f} {acc:>7} {up:>6.2f}x {dup:>7.2f}x")


if __name__ == "__main__":
    main()
