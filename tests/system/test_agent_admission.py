"""Admission on a real decoder (node_agent/admission.py): past its sequence cap requests wait
their turn and complete with their own answers; past the wait they get 429 with Retry-After; a
request that can never fit gets 400 before anything is computed; afterwards nothing is held."""

from __future__ import annotations

import asyncio
import time

import pytest

from tandem_protocol.client import AgentHTTPError

from ..agents import (
    AgentProcess,
    TamperProxy,
    generate_request,
    pd_request,
    settle,
    side_by_side,
    tokens_of,
    wait_for,
)
from ..conftest import LONG_TEXT, prompt, run

# Both agents serve the tiny random-weight Llama (`tiny_dir`, tests/conftest.py): what is asserted is
# admission's arithmetic and order and each request's answer against the same engine alone, none
# of which depends on the weights. Its canonical KV a token, FP16: 4 layers x K and V x 1 head x 64.
TOKEN_BYTES = 4 * 2 * 64 * 2
KV_BYTES = 364 * TOKEN_BYTES  # 364 tokens of prompt plus max_tokens (372,736 bytes)
# Waiters must get in within WAIT: one round of two requests, which took 21 s on SmolLM2 (8 tokens
# each) with the load average at 7 on two cores (4 s was waited past beside other tests). The 429
# test's holders hold for as long as it says, so its agent waits 1 s.
WAIT, SHORT_WAIT = 120.0, 1.0
SHORT = {"max_tokens": 8, "ignore_eos": True}
# A round of the tiny model's 8-token requests passes between two polls of the status: a round of
# 128 tokens (~0.4 s) is seen running two and with others waiting. Two of them fit the KV.
ROUND = {"max_tokens": 128, "ignore_eos": True}
CAPPED = ("--max-sequences", "2", "--decode-kv-bytes", str(KV_BYTES))


@pytest.fixture(scope="module")
def capped(tiny_dir, tmp_path_factory):
    """Two torch agents of the tiny model that run two requests at once, in 364 tokens of decode
    KV: `narrow` lets others wait 120 s, `impatient` 1 s. Started side by side."""
    home = tmp_path_factory.mktemp("admission")
    # one compute thread each, as tests/system/test_bad_input.py found: OpenMP threads that
    # spin-wait on a busy core make every forward pass several times slower
    env = {"OMP_NUM_THREADS": "1"}
    with side_by_side(
        lambda: AgentProcess("torch", tiny_dir, home / "narrow", *CAPPED, "--admission-wait", str(WAIT), env=env),
        lambda: AgentProcess(
            "torch", tiny_dir, home / "impatient", *CAPPED, "--admission-wait", str(SHORT_WAIT), env=env
        ),
    ) as agents:
        yield agents


@pytest.fixture(scope="module")
def long_ids(capped) -> list[int]:
    """The suite's long chat prompt (tests/conftest.py's `long_ids`), tokenized by an agent: the
    tiny model has SmolLM2's tokenizer, and no engine need load in this process."""
    with capped[0].client() as c:
        r = c.post("/v1/tokenize", json={"messages": [{"role": "user", "content": LONG_TEXT}]})
    r.raise_for_status()
    return r.json()["token_ids"]


@pytest.fixture
def narrow(capped) -> AgentProcess:
    return capped[0]


@pytest.fixture
def impatient(capped) -> AgentProcess:
    return capped[1]


def held(agent: AgentProcess) -> dict:
    return agent.status()["decode"]


def settled(agent: AgentProcess) -> None:
    wait_for(lambda: held(agent)["running"] == 0, 10)
    assert held(agent) == {
        "kv_capacity": KV_BYTES,
        "kv_reserved": 0,
        "max_sequences": 2,
        "running": 0,
        "waiting": 0,
    }


def test_a_request_that_can_never_fit_is_refused_before_any_compute(narrow, long_ids):
    ids = prompt(long_ids, 193)  # 193 + 200 tokens: 393 > 364 tokens of KV
    before = narrow.status()["totals"]
    for call in (generate_request, lambda url, ids, s: pd_request(url, url, ids, s)):
        with pytest.raises(AgentHTTPError) as e:
            run(call(narrow.url, ids, {"max_tokens": 200}))
        assert e.value.status == 400 and f"whole KV budget is {KV_BYTES:,} bytes" in str(e.value), e.value
    after = narrow.status()["totals"]
    assert after["prefills_started"] == before["prefills_started"]
    assert after["generated_tokens"] == before["generated_tokens"]
    settled(narrow)


def test_past_the_cap_requests_wait_their_turn_and_get_their_own_answers(narrow, long_ids):
    # four at once past a cap of two: the last two wait one round, inside the wait (with a
    # 4 s wait, six requests in three rounds waited past it in 2 of 7 runs beside other tests)
    prompts = [prompt(long_ids, n) for n in (40, 41, 42, 43)]
    alone = [tokens_of(run(generate_request(narrow.url, ids, ROUND))) for ids in prompts]
    assert len({tuple(a) for a in alone}) > 1

    async def at_once():
        seen = []

        async def watch():
            while True:
                seen.append(await asyncio.to_thread(held, narrow))
                await asyncio.sleep(0.05)

        watcher = asyncio.ensure_future(watch())
        try:
            t0 = time.monotonic()
            lines = await asyncio.gather(*[generate_request(narrow.url, ids, ROUND) for ids in prompts])
            print(f"\nfour requests past a cap of two in {time.monotonic() - t0:.2f} s")
            return lines, seen
        finally:
            watcher.cancel()

    lines, seen = run(at_once())
    assert [tokens_of(x) for x in lines] == alone
    assert max(s["running"] for s in seen) == 2
    assert max(s["waiting"] for s in seen) >= 1  # some did wait
    settled(narrow)


def test_a_request_that_waits_too_long_gets_429_with_retry_after(impatient, long_ids):
    """Two requests hold both slots for as long as the test says: P/D decodes whose pages a proxy
    before the prefiller keeps back (the decoder admits a request before it asks the prefiller),
    so the third one's wait runs out however fast the engine is; released, they complete."""
    proxy = TamperProxy(impatient.port)
    proxy.hold_pages()

    async def go():
        holders = [
            asyncio.ensure_future(
                pd_request(impatient.url, impatient.url, prompt(long_ids, 70 + i), SHORT, prefill_url=proxy.url)
            )
            for i in range(2)
        ]
        try:
            await asyncio.to_thread(wait_for, lambda: held(impatient)["running"] == 2, 60)  # both slots taken
            t0 = time.monotonic()
            with pytest.raises(AgentHTTPError) as e:
                await generate_request(impatient.url, prompt(long_ids, 50), SHORT)
            waited = time.monotonic() - t0
            assert not any(h.done() for h in holders)  # still held: the slots stayed busy throughout
            proxy.release_pages()
            return e.value, waited, [tokens_of(await h) for h in holders]
        finally:
            for h in holders:
                h.cancel()

    try:
        refused, waited, answers = run(go())
    finally:
        proxy.close()
    assert refused.status == 429 and "sequence slots stayed busy for 1.0 s" in str(refused), refused
    assert refused.retry_after and refused.retry_after >= 1
    assert waited >= SHORT_WAIT, waited  # refused after its wait, not before
    alone = [tokens_of(run(generate_request(impatient.url, prompt(long_ids, 70 + i), SHORT))) for i in range(2)]
    assert answers == alone
    settled(impatient)
    settle(impatient)
