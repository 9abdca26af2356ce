"""Shared prefixes are prefilled once: a request whose prompt shares a long prefix with a row
still prefilling it waits for that row's KV and starts from it (Claude Code's parallel
subagents and side requests carry the same ~19k-token system prompt), with the same output as
each request run alone. /stats counts prefilled tokens and lists each admission's reuse."""

import threading

import pytest

from conftest import Server

# ~1,200 tokens of shared system prompt (SmolLM2's tokenizer), then different questions.
SYSTEM = {"role": "system", "content": "You are a careful coding agent. Follow the rules. " * 120}
QUESTIONS = ["Say hello.", "Name a colour."]
REQ = {"max_tokens": 8, "temperature": 0, "logprobs": True}


def messages(q):
    return [SYSTEM, {"role": "user", "content": q}]


def ask(h, q):
    r = h.post("/v1/chat/completions", json={**REQ, "messages": messages(q)})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]


@pytest.fixture(scope="module")
def uncached():
    # The RAM prompt cache off: a shared prefix can only come from a running row.
    s = Server("--prompt-cache", "0")
    yield s
    s.stop()


def test_two_requests_sharing_a_long_prefix_prefill_it_once(uncached):
    with uncached.http() as h:
        alone = [ask(h, q) for q in QUESTIONS]
        prompt = [u["prompt_tokens"] for _, u in alone]
        assert min(prompt) > 1000, prompt
        before = h.get("/stats").json()["batch"]
        together = [None, None]
        first_in = threading.Event()

        def run(i):
            with uncached.http() as c:
                if i == 0:
                    first_in.set()
                together[i] = ask(c, QUESTIONS[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        threads[0].start()
        first_in.wait()
        threads[1].start()
        for t in threads:
            t.join(timeout=600)
        after = h.get("/stats").json()["batch"]
    assert [t for t, _ in together] == [t for t, _ in alone]
    reused = [u["prompt_tokens_details"]["cached_tokens"] for _, u in together]
    shared = prompt[0] - 15  # the questions differ in their last ~10 tokens
    assert max(reused) >= shared - 32, reused
    prefilled = after["prefill_tokens"] - before["prefill_tokens"]
    assert prefilled <= sum(prompt) - (shared - 32), (prefilled, prompt)
    assert after["tokens_from_running_rows"] - before["tokens_from_running_rows"] == max(reused)
    recent = after["recent"][-2:]
    assert sorted(r["reused_from"] for r in recent) == ["none", "running_row"], recent
    assert all(r["prompt_tokens"] in prompt for r in recent), recent
