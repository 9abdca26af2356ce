"""TTFT over HTTP for a ~4k-token conversation: cold prefill vs a RAM prompt-cache hit (the same
conversation resent with one more user turn, as agents do). Standard library only.

Usage: python prompt_cache.py URL   (env: REPEATS=2, TURNS=24)
"""
import json
import os
import statistics
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from http_bench import stream_chat  # noqa: E402
REPEATS = int(os.environ.get("REPEATS", "2"))
TURNS = int(os.environ.get("TURNS", "24"))
PARAGRAPH = ("The lighthouse keeper logged the wind, the swell and every passing ship, and in the evenings "
             "he repaired the lamp, polished the lens and wrote long letters to his sister in the city. ")


def ttft(messages):
    first, _, usage, _ = stream_chat(sys.argv[1], {
        "messages": messages, "max_tokens": 8, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}})
    return first, usage


def main():
    cold, hit = [], []
    for rep in range(REPEATS):
        messages = [{"role": "system", "content": f"Session {rep} {time.time()}. You summarize logbooks."}]
        for i in range(TURNS):
            messages.append({"role": "user", "content": f"Entry {i}: " + PARAGRAPH * 3})
            messages.append({"role": "assistant", "content": f"Noted entry {i}."})
        messages.append({"role": "user", "content": "Summarize the log in one sentence."})
        t_cold, u_cold = ttft(messages)
        t_hit, u_hit = ttft(messages + [{"role": "assistant", "content": "The keeper kept the light."},
                                        {"role": "user", "content": "And what did he write?"}])
        print(f"# rep {rep}: cold {t_cold:.3f} s ({u_cold['prompt_tokens']} tokens), RAM hit {t_hit:.3f} s "
              f"({u_hit['prompt_tokens_details']['cached_tokens']} of {u_hit['prompt_tokens']} tokens cached)",
              file=sys.stderr)
        cold.append((t_cold, u_cold))
        hit.append((t_hit, u_hit))
    c = statistics.median(t for t, _ in cold)
    h = statistics.median(t for t, _ in hit)
    print(json.dumps({"prompt_tokens": cold[0][1]["prompt_tokens"], "ttft_cold_s": c, "ttft_ram_hit_s": h,
                      "cached_tokens": hit[0][1]["prompt_tokens_details"]["cached_tokens"],
                      "speedup": c / h, "runs": REPEATS}))


if __name__ == "__main__":
    main()
