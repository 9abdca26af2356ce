"""Request probes for benches/gpu.sh, standard library only (it runs under the GPU machine's
python3): the first request a server answers after it reported ready, and the prefill of a long
prompt.

  python gpu_requests.py first URL         one streamed request with a new prompt: TTFT and total
  python gpu_requests.py prefill URL N     a prompt of about N tokens, max_tokens 1, 3 times with
                                           a unique first line (no prefix reuse): median seconds,
                                           prompt tokens (from usage), prefill tok/s
Prints one JSON line.
"""
import json
import statistics
import sys
import time
import uuid

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from http_bench import stream_chat  # noqa: E402


def chat(url, content, max_tokens):
    return {"model": "default_model", "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}


def first(url):
    t = time.perf_counter()
    ttft, last, usage, _ = stream_chat(url, chat(url, "Write a haiku about a lighthouse at dawn.", 16))
    return {"probe": "first_request", "url": url, "ttft_s": ttft, "total_s": time.perf_counter() - t,
            "completion_tokens": usage["completion_tokens"] if usage else None}


def prefill(url, n):
    words = ("The keeper climbed the stairs each evening, trimmed the wick, and wrote the weather "
             "in his log. ").split()
    body_words = [words[i % len(words)] for i in range(int(n * 0.75))]
    times, prompt_tokens = [], None
    for _ in range(3):
        text = f"Note {uuid.uuid4()}.\n" + " ".join(body_words) + "\nSummarize."
        ttft, _, usage, _ = stream_chat(url, chat(url, text, 1))
        times.append(ttft)
        if usage:
            prompt_tokens = usage["prompt_tokens"]
    med = statistics.median(times)
    return {"probe": "prefill", "url": url, "prompt_tokens": prompt_tokens, "ttft_s_median": med,
            "prefill_tok_s": prompt_tokens / med if prompt_tokens else None}


if __name__ == "__main__":
    mode, url = sys.argv[1], sys.argv[2]
    out = first(url) if mode == "first" else prefill(url, int(sys.argv[3]))
    print(json.dumps(out), flush=True)
