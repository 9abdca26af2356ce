"""The RAM prompt cache over HTTP: a resent or extended conversation reuses the cached KV of
its prefix (usage.prompt_tokens_details.cached_tokens, GET /stats), with the same output as a
cold run (semantics.md's "same": logprobs within the float32 path's 0.1 nats, tokens equal)."""

import re

from conftest import Server

SYSTEM = {"role": "system", "content": "You are a helpful assistant who knows geography and answers precisely."}
FIRST = [SYSTEM, {"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
REQ = {"max_tokens": 12, "temperature": 0, "logprobs": True, "return_tokens_as_token_ids": True}


def run(c, messages):
    r = c.post("/v1/chat/completions", json={**REQ, "messages": messages})
    assert r.status_code == 200, r.text
    return r.json()


def logprobs(body):
    return [(t["token"], t["logprob"]) for t in body["choices"][0]["logprobs"]["content"]]


def test_a_resent_prompt_reuses_its_kv_with_the_same_output(tmp_path):
    s = Server("--prompt-cache", "0.5")
    try:
        with s.http() as c:
            cold = run(c, FIRST)
            assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            hit = run(c, FIRST)
            cached = hit["usage"]["prompt_tokens_details"]["cached_tokens"]
            # Everything but the last prompt token (the step needs logits).
            assert cached == hit["usage"]["prompt_tokens"] - 1
            assert hit["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
            for (t1, l1), (t2, l2) in zip(logprobs(cold), logprobs(hit)):
                assert t1 == t2 and abs(l1 - l2) < 0.1
            # The conversation grows: its whole earlier part comes from the cache.
            follow = FIRST + [{"role": "assistant", "content": cold["choices"][0]["message"]["content"]},
                              {"role": "user", "content": "And of Italy?"}]
            more = run(c, follow)
            assert more["usage"]["prompt_tokens_details"]["cached_tokens"] >= cold["usage"]["prompt_tokens"]
            stats = c.get("/stats").json()["prompt_cache"]
            assert stats["hits"] == 2 and stats["misses"] == 1
            assert stats["tokens_reused"] >= cached and stats["entries"] >= 1 and 0 < stats["bytes"] <= stats["max_bytes"]
    finally:
        s.stop()


def test_a_zero_cap_disables_the_cache(tmp_path):
    s = Server("--prompt-cache", "0")
    try:
        with s.http() as c:
            run(c, FIRST)
            again = run(c, FIRST)
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            stats = c.get("/stats").json()["prompt_cache"]
            assert stats["entries"] == 0 and stats["hits"] == 0
    finally:
        s.stop()


def test_full_warm_up_meets_prompt_cache_hits_and_leaves_the_cache_empty():
    # The GPU's warm-up plan (MLXHOST_WARMUP=full runs it on the CPU) ends with rows seeded from
    # a warm-up-only cache: an exact repeat, an extension and a 26-token branch (issue 35: the
    # first real hit once waited 36.6 s for kernels the warm-up had not met). The server's own
    # cache and statistics start empty.
    s = Server(env={"MLXHOST_WARMUP": "full"})
    try:
        m = re.search(r"warm-up done rows=(\d+) prompt_cache_hits=(\d+) reused_tokens=(\d+)", s.text())
        assert m, s.text()
        assert int(m.group(2)) == 3 and int(m.group(3)) > 26, m.group(0)
        with s.http() as h:
            stats = h.get("/stats").json()
        assert stats["prompt_cache"]["entries"] == 0 and stats["prompt_cache"]["hits"] == 0, stats
        assert stats["batch"]["steps"] == 0, stats["batch"]
    finally:
        s.stop()
