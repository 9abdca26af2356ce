"""Gemma 3 270M (base model, Q4_K_M GGUF, sliding-window attention with a 512-token window)
served over HTTP: greedy text equals llama.cpp's up to the first near-tie, and a conversation of
more than 600 tokens resent with one more turn reuses its cached prefix (the sliding-window
layers are trimmed back within their rollback margin) with the same tokens as a cold run, from
RAM and, after a restart, from the SSD tier. The same for Gemma 4 on the tiny random-weight
fixture (tests/fixtures/models/gemma4-tiny: a 16-token window, KV-shared layers, per-layer
inputs), over token-id prompts.

Needs `mlxhost models pull gemma3-270m` (scripts/test.sh does it) for the Gemma 3 tests.
"""

import json

import pytest

from conftest import ROOT, Server, steps_before_near_tie
from test_ssd_cache import ssd_stats, wait_written

FIXTURE = json.loads((ROOT / "tests/fixtures/models/gemma3-270m.llama-cpp.json").read_text())
NEAR_TIE = 0.15
LONG = max(FIXTURE["cases"], key=lambda c: len(c["prompt_ids"]))
TURN = "\n<start_of_turn>user\nThank you. Now say it again in one short sentence.<end_of_turn>\n<start_of_turn>model\n"


def comparable_steps(case):
    return steps_before_near_tie(case, NEAR_TIE)


@pytest.fixture(scope="module")
def gemma():
    s = Server("--model", "gemma3-270m")
    yield s
    s.stop()


def complete(c, prompt, n=24):
    r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0,
                                        "logprobs": 1})
    assert r.status_code == 200, r.text
    return r.json()


def same_tokens(a, b):
    """semantics.md's "same": equal tokens until a near-tie, logprobs within 0.1."""
    la, lb = a["choices"][0]["logprobs"], b["choices"][0]["logprobs"]
    for ta, tb, pa, pb, top in zip(la["tokens"], lb["tokens"], la["token_logprobs"],
                                   lb["token_logprobs"], la["top_logprobs"]):
        assert abs(pa - pb) < 0.1, (ta, pa, tb, pb)
        if ta != tb:
            return
        assert ta == tb


@pytest.mark.parametrize("index", range(len(FIXTURE["cases"])))
def test_greedy_text_equals_llama_cpp_up_to_the_first_near_tie(gemma, index):
    case = FIXTURE["cases"][index]
    k = comparable_steps(case)
    if k == 0:
        pytest.skip("opens on a near-tie")
    # Text prompts: the server puts Gemma's BOS first, as llama.cpp did.
    with gemma.http() as c:
        r = c.post("/v1/completions", json={
            "prompt": case["prompt_text"], "max_tokens": len(case["greedy_ids"]), "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(case["prompt_ids"])
    assert body["choices"][0]["text"].startswith(case["greedy_prefix_texts"][k - 1])


def test_a_long_conversation_resent_with_one_more_turn_reuses_its_prefix():
    assert len(LONG["prompt_ids"]) > 600
    s = Server("--model", "gemma3-270m")
    try:
        with s.http() as c:
            first = complete(c, LONG["prompt_text"])
            assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            resent = LONG["prompt_text"] + first["choices"][0]["text"] + TURN
            warm = complete(c, resent)
            cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= len(LONG["prompt_ids"]), warm["usage"]
            assert c.get("/stats").json()["prompt_cache"]["hits"] == 1
    finally:
        s.stop()
    # A cold server gives the same tokens for the resent conversation.
    cold_server = Server("--model", "gemma3-270m", "--prompt-cache", "0")
    try:
        with cold_server.http() as c:
            cold = complete(c, resent)
            assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        cold_server.stop()
    same_tokens(cold, warm)


def test_the_ssd_tier_restores_a_long_gemma_conversation_after_a_restart(tmp_path):
    ssd = tmp_path / "ssd"
    s = Server("--model", "gemma3-270m", "--ssd-cache", str(ssd))
    try:
        with s.http() as c:
            first = complete(c, LONG["prompt_text"])
            wait_written(c)
    finally:
        s.stop()
    resent = LONG["prompt_text"] + first["choices"][0]["text"] + TURN
    s = Server("--model", "gemma3-270m", "--ssd-cache", str(ssd))
    try:
        with s.http() as c:
            warm = complete(c, resent)
            cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= len(LONG["prompt_ids"]), warm["usage"]
            st = ssd_stats(c)
            assert st["hits"] == 1 and st["quarantined"] == 0, st
    finally:
        s.stop()
    cold = Server("--model", "gemma3-270m", "--prompt-cache", "0")
    try:
        with cold.http() as c:
            same_tokens(complete(c, resent), warm)
    finally:
        cold.stop()


def test_concurrent_requests_equal_their_solo_answers(gemma):
    """The long prompt is prefilled in chunks beside the short ones' decode steps."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [c["prompt_text"] for c in FIXTURE["cases"]]
    with gemma.http() as c:
        solo = [complete(c, p, n=16) for p in prompts]

    def one(p):
        with gemma.http() as c:
            return complete(c, p, n=16)

    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(one, prompts))
    for a, b in zip(solo, together):
        same_tokens(a, b)


GEMMA4_TINY = ROOT / "tests/fixtures/models/gemma4-tiny"
# Past the window and the sliding layers' 256-position rollback margin: they drop positions.
GEMMA4_LONG = [(i * 37 + 11) % 256 for i in range(900)]


def complete_ids(c, ids, n=12):
    r = c.post("/v1/completions", json={"prompt": ids, "max_tokens": n, "temperature": 0,
                                        "logprobs": 1, "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()


def ids_of(body):
    return [int(t.removeprefix("token_id:")) for t in body["choices"][0]["logprobs"]["tokens"]]


def test_a_long_gemma4_conversation_is_reused_from_ram_and_after_a_restart_from_ssd(tmp_path):
    ssd = tmp_path / "ssd"
    s = Server("--model", str(GEMMA4_TINY), "--ssd-cache", str(ssd))
    try:
        with s.http() as c:
            first = complete_ids(c, GEMMA4_LONG)
            assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            resent = GEMMA4_LONG + ids_of(first) + [7, 8, 9]
            warm = complete_ids(c, resent)
            cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= len(GEMMA4_LONG), warm["usage"]
            wait_written(c)
    finally:
        s.stop()
    s = Server("--model", str(GEMMA4_TINY), "--ssd-cache", str(ssd))
    try:
        with s.http() as c:
            restored = complete_ids(c, resent)
            cached = restored["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= len(GEMMA4_LONG), restored["usage"]
            st = ssd_stats(c)
            assert st["hits"] == 1 and st["quarantined"] == 0, st
    finally:
        s.stop()
    cold_server = Server("--model", str(GEMMA4_TINY), "--prompt-cache", "0")
    try:
        with cold_server.http() as c:
            cold = complete_ids(c, resent)
            assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        cold_server.stop()
    same_tokens(cold, warm)
    same_tokens(cold, restored)
