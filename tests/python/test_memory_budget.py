"""Admission under --memory-budget as agent clients meet it: a request reserves the KV its
prompt needs plus a growth step, not its whole max_tokens (Claude Code and opencode send 32000);
reservations grow as rows decode, and when the budget runs short the youngest row is preempted
(paused, its KV kept in the prompt cache) and resumed later, with the same output as alone."""

import threading

import pytest

from conftest import PLUGINS, Server, chat, run_binary

# SmolLM2-135M keeps 46,080 B of KV a position (float32; 30 layers x 2 x 3 heads x 64). Two
# short prompts (~40 tokens with the template) reserve ~12.8 MB each at admission (a 256-position
# step plus prefill activations); 300 tokens each would take ~31 MB together, over the 26.8 MB
# budget, so near 290 positions the younger row is preempted until the first finishes.
BUDGET_GIB = "0.025"
LONG = 300


@pytest.fixture(scope="module")
def budgeted():
    s = Server("--memory-budget", BUDGET_GIB, "--batch", "4")
    yield s
    s.stop()


def story(client, text, max_tokens=LONG):
    r = client.chat.completions.create(
        model="m", messages=chat(text), max_tokens=max_tokens, temperature=0
    )
    return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens


def test_agent_sized_max_tokens_are_admitted_and_clamped(budgeted):
    # Under the old rule each would reserve its whole context's KV (8192 x 46 KB = 377 MB),
    # over the 32 MB budget: refused. Now they reserve their prompt plus a growth step.
    with budgeted.http() as h:
        kv = h.get("/stats").json()["batch"]
        r = h.post(
            "/v1/messages",
            json={"model": "m", "max_tokens": 32000, "messages": chat("Hi"), "stop_sequences": [" "]},
        )
        assert r.status_code == 200, r.text
        assert r.json()["stop_reason"] in ("stop_sequence", "end_turn"), r.json()
        # opencode's default: Chat Completions with max_tokens 32000 over an 8192 context.
        r = h.post(
            "/v1/chat/completions",
            json={"messages": chat("Hi"), "max_tokens": 32000, "stop": [" "], "temperature": 0},
        )
        assert r.status_code == 200, r.text
        batch = h.get("/stats").json()["batch"]
        assert batch["memory_budget_bytes"] == int(float(BUDGET_GIB) * 2**30), batch
        assert batch["kv_bytes_per_token"] == 46_080, batch
        assert kv["preemptions"] == batch["preemptions"] == 0, batch


def test_the_youngest_row_is_preempted_and_resumes_with_the_same_output(budgeted):
    client = budgeted.client()
    prompts = ["Tell a long story about a dragon.", "Write a long poem about the sea."]
    alone = [story(client, p) for p in prompts]
    for text, finish, n in alone:
        assert finish == "length" and n == LONG, (finish, n)
    with budgeted.http() as h:
        before = h.get("/stats").json()["batch"]["preemptions"]
    together = [None, None]
    started = threading.Event()

    def run(i):
        if i == 1:
            started.wait()
        together[i] = story(client, prompts[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    threads[0].start()
    started.set()
    threads[1].start()
    for t in threads:
        t.join(timeout=600)
    assert together == alone
    with budgeted.http() as h:
        batch = h.get("/stats").json()["batch"]
    assert batch["preemptions"] > before, batch
    assert batch["preempted"] == 0 and batch["running"] == 0, batch
    assert "preempted a row" in budgeted.text() and "resumed a preempted row" in budgeted.text()


def test_a_lone_row_that_outgrows_the_budget_finishes_with_length():
    # 0.015 GiB holds ~340 positions of SmolLM2's KV: a short prompt and its first growth step
    # (256 positions) are admitted, then the row cannot grow past the budget and ends as it
    # would at the end of the context.
    s = Server("--memory-budget", "0.015", "--batch", "2")
    try:
        client = s.client()
        text, finish, n = story(client, "Tell a long story about a dragon.", max_tokens=400)
        assert finish == "length" and 0 < n < 400, (finish, n)
        assert "outgrew the memory budget" in s.text()
    finally:
        s.stop()


def test_memory_limit_bounds_mlx_and_holds_the_budget():
    # --memory-limit sets MLX's limit, --memory-cache its buffer cache's cap; the admission budget
    # is what the limit leaves once the weights, the cache cap and the prompt cache are out.
    g = 2**30
    s = Server("--memory-limit", "6", "--memory-cache", "0.5", "--prompt-cache", "1")
    try:
        with s.http() as h:
            r = h.post("/v1/chat/completions", json={"messages": chat("Hi"), "max_tokens": 4})
            assert r.status_code == 200, r.text
            stats = h.get("/stats").json()
            mem = stats["memory"]
            assert mem["limit_bytes"] == 6 * g, mem
            assert mem["cache_limit_bytes"] == g // 2, mem
            assert mem["weights_bytes"] > 50_000_000, mem  # SmolLM2-135M's packed weights
            assert mem["peak_bytes"] >= mem["active_bytes"] > 0, mem
            budget = stats["batch"]["memory_budget_bytes"]
            assert budget == 6 * g - mem["weights_bytes"] - g // 2 - g, (budget, mem)
            metrics = h.get("/metrics").text
            assert f'mlxhost_memory_bytes{{kind="limit"}} {6 * g}' in metrics
    finally:
        s.stop()


def test_a_cache_larger_than_the_limit_fails_startup_naming_the_flag():
    r = run_binary(
        "serve", "--plugins", str(PLUGINS), "--memory-limit", "1", "--memory-cache", "2", timeout=120
    )
    assert r.returncode != 0
    assert "--memory-cache" in r.stderr, r.stderr


def test_a_limit_that_leaves_no_kv_memory_fails_startup_naming_the_flags():
    # SmolLM2-135M's packed weights alone take more than 0.05 GiB.
    r = run_binary("serve", "--plugins", str(PLUGINS), "--memory-limit", "0.05", timeout=300)
    assert r.returncode != 0
    assert "--memory-limit" in r.stderr and "leaves no memory for KV caches" in r.stderr, r.stderr
