"""gpt-oss on the tiny random-weight fixtures (tests/fixtures/models/gpt-oss-tiny and
gpt-oss-tiny-mxfp4, made by benches/make_gpt_oss_tiny.py: attention sinks, a 16-token sliding
window alternating with full layers, 8 experts, mxfp4 experts in the second) served over HTTP:
greedy decode of token-id prompts equals mlx-lm 0.32.2's own greedy decode (its cached path,
`mlx-lm-greedy.jsonl`) up to the first near-tie, alone and with the rows sent together (one
batch, their tokens routed to different experts in the same steps); a conversation resent with
one more turn reuses its prefix from RAM and, after a restart, from the SSD tier.
"""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import ROOT, Server
from test_ssd_cache import ssd_stats, wait_written

FIXTURES = ["gpt-oss-tiny", "gpt-oss-tiny-mxfp4"]
# Both sides compute in float32 (scores within 2e-5 nats of mlx-lm, tests/tests/gpt_oss.rs), so
# tokens must agree wherever mlx-lm's top two are further apart than float32 noise.
NEAR_TIE = 1e-3


def greedy_cases(name):
    path = ROOT / "tests/fixtures/models" / name / "mlx-lm-greedy.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def complete_ids(c, ids, n):
    r = c.post("/v1/completions", json={"prompt": ids, "max_tokens": n, "temperature": 0,
                                        "logprobs": 1, "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()


def ids_of(body):
    return [int(t.removeprefix("token_id:")) for t in body["choices"][0]["logprobs"]["tokens"]]


# The fixtures' EOS (tokenizer_config.json's `eos_token`, byte 1): the server ends the reply
# there and does not return it; mlx-lm's recorded decode runs past it.
EOS = 1


def assert_greedy_matches(case, ours):
    want = case["greedy_ids"]
    if EOS in want:
        want = want[:want.index(EOS)]
    for k, (o, w, margin) in enumerate(zip(ours, want, case["margins"])):
        if margin < NEAR_TIE:
            return
        assert o == w, f"step {k}: ours {ours} vs mlx-lm {want}"
    assert len(ours) == len(want), (ours, want)


@pytest.fixture(scope="module", params=FIXTURES)
def served(request):
    s = Server("--model", str(ROOT / "tests/fixtures/models" / request.param))
    yield request.param, s
    s.stop()


def test_greedy_decode_equals_mlx_lm_alone_and_batched(served):
    name, s = served
    cases = greedy_cases(name)
    with s.http() as c:
        alone = [ids_of(complete_ids(c, case["prompt_ids"], len(case["greedy_ids"])))
                 for case in cases]
    for case, ours in zip(cases, alone):
        assert_greedy_matches(case, ours)

    def one(case):
        with s.http() as c:
            return ids_of(complete_ids(c, case["prompt_ids"], len(case["greedy_ids"])))

    with ThreadPoolExecutor(len(cases)) as pool:
        together = list(pool.map(one, cases))
    for case, ours in zip(cases, together):
        assert_greedy_matches(case, ours)


# Past the window and the sliding layers' 256-position rollback margin: they drop positions.
LONG = [(i * 37 + 11) % 256 for i in range(900)]


def test_a_long_conversation_is_reused_from_ram_and_after_a_restart_from_ssd(tmp_path):
    model = str(ROOT / "tests/fixtures/models/gpt-oss-tiny")
    ssd = tmp_path / "ssd"
    s = Server("--model", model, "--ssd-cache", str(ssd))
    try:
        with s.http() as c:
            first = complete_ids(c, LONG, 12)
            resent = LONG + ids_of(first) + [7, 8, 9]
            warm = complete_ids(c, resent, 12)
            assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(LONG)
            wait_written(c)
    finally:
        s.stop()
    s = Server("--model", model, "--ssd-cache", str(ssd))
    try:
        with s.http() as c:
            restored = complete_ids(c, resent, 12)
            assert restored["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(LONG)
            st = ssd_stats(c)
            assert st["hits"] == 1 and st["quarantined"] == 0, st
    finally:
        s.stop()
    cold_server = Server("--model", model, "--prompt-cache", "0")
    try:
        with cold_server.http() as c:
            cold = complete_ids(c, resent, 12)
            assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        cold_server.stop()
    for warm_run in (warm, restored):
        lc, lw = cold["choices"][0]["logprobs"], warm_run["choices"][0]["logprobs"]
        for tc, tw, pc, pw in zip(lc["tokens"], lw["tokens"], lc["token_logprobs"],
                                  lw["token_logprobs"]):
            assert abs(pc - pw) < 1e-3, (tc, pc, tw, pw)
            assert tc == tw
