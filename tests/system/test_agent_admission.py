"""Admission on a real decoder (node_agent/admission.py): past its sequence cap requests wait
their turn and complete with their own answers; past the wait they get 429 with Retry-After; a
request that can never fit gets 400 before anything is computed; afterwards nothing is held."""

from __future__ import annotations

import asyncio

import pytest

from tandem_protocol.client import AgentClient, AgentHTTPError

from ..agents import TEST_KEY, AgentProcess, generate_request, pd_request, tokens_of, wait_for
from ..conftest import prompt, run

TOKEN_BYTES = 23_040  # SmolLM2's canonical KV a token
KV_BYTES = 8 << 20  # 364 tokens of prompt plus max_tokens
WAIT = 4.0
SHORT = {"max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def narrow(smol_dir, tmp_path_factory):
    """A torch agent that runs two requests at once, in 8 MiB of decode KV, and lets others wait 4 s."""
    with AgentProcess(
        "torch",
        smol_dir,
        tmp_path_factory.mktemp("narrow"),
        *("--max-sequences", "2", "--decode-kv-bytes", str(KV_BYTES), "--admission-wait", str(WAIT)),
    ) as agent:
        yield agent


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
    ids = prompt(long_ids, 193)  # 193 + 200 tokens: 9.05 MB > 8 MiB
    before = narrow.status()["totals"]
    for call in (generate_request, lambda url, ids, s: pd_request(url, url, ids, s)):
        with pytest.raises(AgentHTTPError) as e:
            run(call(narrow.url, ids, {"max_tokens": 200}))
        assert e.value.status == 400 and "whole KV budget is 8,388,608 bytes" in str(e.value), e.value
    after = narrow.status()["totals"]
    assert after["prefills_started"] == before["prefills_started"]
    assert after["generated_tokens"] == before["generated_tokens"]
    settled(narrow)


def test_past_the_cap_requests_wait_their_turn_and_get_their_own_answers(narrow, long_ids):
    # four at once past a cap of two: the last two wait one round, well inside the 4 s wait (six,
    # three rounds, waited past it in 2 of 7 runs beside other tests)
    prompts = [prompt(long_ids, n) for n in (40, 41, 42, 43)]
    alone = [tokens_of(run(generate_request(narrow.url, ids, SHORT))) for ids in prompts]
    assert len({tuple(a) for a in alone}) > 1

    async def at_once():
        seen = []

        async def watch():
            while True:
                seen.append(await asyncio.to_thread(held, narrow))
                await asyncio.sleep(0.05)

        watcher = asyncio.ensure_future(watch())
        try:
            return await asyncio.gather(*[generate_request(narrow.url, ids, SHORT) for ids in prompts]), seen
        finally:
            watcher.cancel()

    lines, seen = run(at_once())
    assert [tokens_of(x) for x in lines] == alone
    assert max(s["running"] for s in seen) == 2
    assert max(s["waiting"] for s in seen) >= 1  # some did wait
    settled(narrow)


def test_a_request_that_waits_too_long_gets_429_with_retry_after(narrow, long_ids):
    long = {"max_tokens": 150, "ignore_eos": True}

    async def go():
        client = AgentClient(narrow.url, TEST_KEY)
        body = [{"token_ids": prompt(long_ids, 30 + i), "sampling": long} for i in range(2)]
        holders = [client.lines("/v1/generate", b) for b in body]
        try:
            await asyncio.gather(*[anext(h) for h in holders])  # both are running: their first lines came
            with pytest.raises(AgentHTTPError) as e:
                await generate_request(narrow.url, prompt(long_ids, 50), SHORT)
            return e.value
        finally:
            for h in holders:  # their client goes: the agent ends them
                await h.aclose()
            await client.aclose()

    refused = run(go())
    assert refused.status == 429 and "sequence slots stayed busy for 4.0 s" in str(refused), refused
    assert refused.retry_after and refused.retry_after >= 1
    settled(narrow)
