"""Continuous batching over HTTP: concurrent requests run in one batch and
answer exactly as they do alone; a client that disconnects, a plugin that
traps or a full queue touches only its own request; /stats and /health show
the batch while it runs."""

import concurrent.futures as cf
import threading
import time

import httpx
import pytest

from conftest import Server, chat, plugin_folder

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
    "What is 2 + 2?",
    "Say hello in Spanish.",
    "List two fruits.",
]


def ask(client, text, **kw):
    r = client.chat.completions.create(
        model="m", messages=chat(text), max_tokens=kw.pop("max_tokens", 24), logprobs=True, top_logprobs=2, **kw
    )
    c = r.choices[0]
    return c.message.content, [t.token for t in c.logprobs.content], [t.top_logprobs for t in c.logprobs.content]


def same_until_near_tie(a, b, tol=0.1):
    """semantics.md's "same" on the float32 path: tokens equal until the first
    step whose (alone) top-2 margin is below twice the tolerance."""
    (_, ta, tops), (_, tb, _) = a, b
    for i, (x, y) in enumerate(zip(ta, tb)):
        top = tops[i]
        if len(top) >= 2 and top[0].logprob - top[1].logprob < 2 * tol:
            return True
        if x != y:
            return False
    return len(ta) == len(tb)


@pytest.fixture(scope="module")
def batch_server(tmp_path_factory):
    plugins = plugin_folder(tmp_path_factory.mktemp("p"), "standard", "openai", "repetition-penalty", "frequency-penalty", "trap", "dry")
    s = Server("--batch", "8", "--max-queue", "12", plugins=plugins)
    yield s
    s.stop()


def test_concurrent_requests_equal_their_solo_answers(batch_server):
    client = batch_server.client()
    params = [
        {"temperature": 0},
        {"temperature": 0.8, "seed": 3},
        {"temperature": 0, "frequency_penalty": 0.5},
        {"temperature": 0.7, "top_p": 0.9, "seed": 9, "max_tokens": 16},
        {"temperature": 0, "extra_body": {"repetition_penalty": 1.3}},
        {"temperature": 0, "extra_body": {"logits_processors": ["dry"]}},
    ]
    jobs = list(zip(QUESTIONS, params))
    alone = [ask(client, q, **dict(p)) for q, p in jobs]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda qp: ask(client, qp[0], **dict(qp[1])), jobs))
    for (q, _), a, t in zip(jobs, alone, together):
        assert same_until_near_tie(a, t), f"{q!r}: alone {a[0]!r} vs batched {t[0]!r}"
    stats = batch_server.http().get("/stats").json()["batch"]
    assert stats["max_batch"] == 8
    sizes = {b["rows"] for b in stats["by_batch_size"]}
    assert max(sizes) >= 3, f"requests were not batched: {stats}"
    assert stats["decode_tokens"] > 0 and stats["prefill_tokens"] > 0
    assert 0 < stats["batch_occupancy"] <= 1


def test_stats_and_health_answer_during_a_full_batch(batch_server):
    client = batch_server.client()
    http = batch_server.http()
    seen = {"running": 0, "waiting": 0}
    done = threading.Event()

    def watch():
        while not done.is_set():
            assert http.get("/health").status_code == 200
            b = http.get("/stats").json()["batch"]
            seen["running"] = max(seen["running"], b["running"])
            seen["waiting"] = max(seen["waiting"], b["waiting"])
            time.sleep(0.05)

    w = threading.Thread(target=watch)
    w.start()
    try:
        with cf.ThreadPoolExecutor(10) as pool:
            list(pool.map(lambda i: ask(client, QUESTIONS[i % len(QUESTIONS)], max_tokens=40), range(10)))
    finally:
        done.set()
        w.join()
    assert seen["running"] == 8, seen
    assert seen["waiting"] >= 1, seen


def test_a_disconnected_stream_leaves_the_batch_and_others_finish(batch_server):
    client = batch_server.client()
    http = batch_server.http()
    alone = ask(client, QUESTIONS[0], temperature=0)
    with httpx.Client(base_url=batch_server.url, timeout=60) as raw:
        with cf.ThreadPoolExecutor(2) as pool:
            other = pool.submit(ask, client, QUESTIONS[0], temperature=0)
            with raw.stream(
                "POST",
                "/v1/chat/completions",
                json={"messages": chat("Tell a long story."), "max_tokens": 400, "stream": True},
            ) as r:
                for i, _ in enumerate(r.iter_lines()):
                    if i > 4:
                        break  # the client goes away mid-stream
            assert same_until_near_tie(alone, other.result())
    deadline = time.time() + 30
    while time.time() < deadline and http.get("/stats").json()["batch"]["running"] > 0:
        time.sleep(0.1)
    assert http.get("/stats").json()["batch"]["running"] == 0, "the disconnected row was not retired"


def test_a_trapping_row_fails_alone(batch_server):
    client = batch_server.client()
    alone = ask(client, QUESTIONS[1], temperature=0)
    with cf.ThreadPoolExecutor(2) as pool:
        good = pool.submit(ask, client, QUESTIONS[1], temperature=0)
        bad = pool.submit(ask, client, QUESTIONS[2], extra_body={"sampler": "trap"})
        with pytest.raises(Exception) as err:
            bad.result()
        assert "trap" in str(err.value)
        assert same_until_near_tie(alone, good.result())


def test_queue_beyond_max_queue_gets_503_with_the_flag_named(batch_server):
    statuses = []
    with httpx.Client(base_url=batch_server.url, timeout=300) as h:

        def post(_):
            r = h.post("/v1/chat/completions", json={"messages": chat("Count to twenty."), "max_tokens": 48})
            return r.status_code, r.text

        with cf.ThreadPoolExecutor(20) as pool:
            statuses = list(pool.map(post, range(20)))
    codes = [s for s, _ in statuses]
    assert codes.count(200) >= 12 and 503 in codes, codes
    assert all("--max-queue" in t for s, t in statuses if s == 503)


def test_batch_1_serves_requests_one_after_another(tmp_path):
    plugins = plugin_folder(tmp_path, "standard", "openai")
    s = Server("--batch", "1", plugins=plugins)
    try:
        client = s.client()
        with cf.ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda q: ask(client, q, temperature=0, max_tokens=8), QUESTIONS[:3]))
        stats = s.http().get("/stats").json()["batch"]
        assert stats["max_batch"] == 1
        assert [b["rows"] for b in stats["by_batch_size"]] == [1]
    finally:
        s.stop()


def test_bad_batch_flags_are_named(tmp_path):
    from conftest import run_binary

    for flag in ("--batch", "--prefill-budget"):
        out = run_binary("serve", "--port", "0", flag, "0")
        assert out.returncode != 0 and flag in out.stderr, out.stderr
