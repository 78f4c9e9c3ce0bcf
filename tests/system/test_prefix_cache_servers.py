"""Prefix caches of the server engines (vLLM's, SGLang's decode radix cache) under a torch
prefiller: a later turn imports only the pages the engine lacks and answers as with no cache,
in process and through the panel. (Apart from tests/system/test_prefix_cache.py, which runs in
process only, because these need engine servers of their own: the engine-server lane,
tests/conftest.py.)"""

from __future__ import annotations

import asyncio

import pytest

from engine_adapters.base import EngineRequest
from tandem_protocol.handoff import kv_tokens
from tandem_protocol.sampling import SamplingParams

from ..agents import wait_for
from ..conftest import collect, run, write_report
from .conftest import fresh_salt
from .conversation import ANSWER, SYSTEM, TURNS, common_pages, common_prefix, pair_conversation

# How many leading tokens of each turn's answer must equal the answer with no cache. SGLang: all
# (3 of 3 turns token for token, every run). vLLM: not every token — the KV of its own earlier
# answer, which its cache serves, was computed by its decode steps and differs in rounding from
# torch's pages of the same tokens: with vLLM on one thread turn 2 diverged at token 43 of 64
# (the other turns equal; on two threads all equal; 64 of 64 in every turn with the reference on
# the same server, salted); held to half of that.
AGREE_AT_LEAST = {"sglang": ANSWER.max_tokens, "vllm": 21}


# each engine's shared server (its cache on), named as a parameter and taken with
# getfixturevalue, so that each case waits for its own alone (tests/system/conftest.py)
SERVERS = {"sglang": "sglang_server", "vllm": "vllm_server"}


@pytest.mark.parametrize("server", list(SERVERS.values()), ids=list(SERVERS))
def test_a_later_turn_on_a_server_decoder_imports_only_the_pages_it_lacks(engines, cache_bytes, request, server):
    """torch P, vLLM or SGLang D: with the engine's own prefix cache on (vLLM's, SGLang's decode
    radix cache), each turn's decode is told by the engine's plugin how much of the prompt it
    holds, P sends only the pages after it, and every answer is the one of the same conversation
    with no cache (on the same server, each turn with a cache salt of its own: the cache serves
    such a turn nothing, tests/system/conftest.py)."""
    P, D = engines["torch"], request.getfixturevalue(server)
    server = D.name
    assert D.prefix_caching
    page, mode = D.geometry.page_tokens, D.decoder_modes[0]
    cache_bytes(P, 0)
    # with no cache: every turn salted afresh; with the cache below: no salt
    prompts, uncached, full = pair_conversation(P, D, f"pd-off-{server}", salt=fresh_salt(f"pd-off-{server}"))
    needs = [ids[: kv_tokens(len(ids), mode)] for ids in prompts]  # the KV a decode needs
    assert [s.have_pages for s in full] == [0] * len(TURNS)
    assert [s.pages for s in full] == [D.geometry.pages_for(len(n)) for n in needs]  # all

    before = D.prefix_cache_status()
    # the same prompts again (an answer that came out otherwise must not change the next turn)
    again, answers, delta = pair_conversation(P, D, f"pd-on-{server}", replay=prompts)
    write_report(
        f"prefix_cache_{server}",
        {
            "prompt_tokens": [len(ids) for ids in prompts],
            "pages_without_cache": [s.pages for s in full],
            "have_pages": [s.have_pages for s in delta],
            "pages_sent": [s.pages for s in delta],
            "answers_equal": [a == b for a, b in zip(answers, uncached)],
            "tokens_agreeing": [len(common_prefix(a, b)) for a, b in zip(answers, uncached)],
        },
    )
    assert again == prompts
    agree = [len(common_prefix(a, b)) for a, b in zip(answers, uncached)]
    assert all(n >= min(len(b), AGREE_AT_LEAST[server]) for n, b in zip(agree, uncached)), agree
    # The engine holds the whole pages of what it computed or loaded before: each earlier turn's
    # prompt and its answer but the last token.
    held = [prompts[k] + answers[k][:-1] for k in range(len(TURNS))]
    have = [0] + [max(common_pages(h, needs[k], page) for h in held[:k]) // page for k in range(1, len(TURNS))]
    assert [s.have_pages for s in delta] == have
    assert all(h > 0 for h in have[1:])
    assert [s.pages for s in delta] == [D.geometry.pages_for(len(n)) - h for n, h in zip(needs, have)]
    after = D.prefix_cache_status()
    assert after["hit_tokens"] - before["hit_tokens"] == sum(have) * page
    assert after["capacity"] > 0 and before["lookups"] + len(TURNS) == after["lookups"]

    # A decode held for a handshake that then fails (the prefiller refused it): released, the
    # engine drops the request it had scheduled, and nothing of it is left on either side.
    req = EngineRequest("held-then-dropped", prompts[-1], ANSWER, mode)

    async def hold_then_drop() -> int:
        await D.hold_prefix(req)
        held = D.active_requests
        D.release_prefix(req)
        await asyncio.sleep(0.1)  # the role (SGLang's) is let go of in a task
        return held

    assert run(hold_then_drop()) == 1 and req.have_pages > 0
    assert D.active_requests == 0 and not D.bridge.rooms
    wait_for(lambda: run(D.engine_stats())["running"] == 0, timeout=30, step=0.1)

    # As a prefiller and alone, the engine's own cache serves a prompt it has seen, and its
    # answers say so (PrefillDone.cached_tokens, the request's cached_tokens): whole pages. Three
    # pages and a token: not a prefix of anything the engine holds yet.
    ids = [5, 6] + prompts[0][: 3 * page - 1]
    counted, one = [], SamplingParams(max_tokens=1)
    for tag in ("prefill-once", "prefill-again"):
        items = run(collect(D.prefill(EngineRequest(tag, ids, one))))
        counted.append(items[-1].cached_tokens)
    for tag in ("alone-again",):
        alone = EngineRequest(tag, ids, one)
        run(collect(D.generate(alone)))
        counted.append(alone.cached_tokens)
    write_report(f"prefix_cache_{server}_counted", {"prompt_tokens": len(ids), "cached_tokens": counted})
    assert len(ids) == 3 * page + 1 and counted == [0, 3 * page, 3 * page]


# The answers are not compared, only counted (vLLM holds the first one's pages but its last
# token): a few tokens each.
ANSWER_TOKENS = 8


def test_through_the_panel_a_vllm_decoder_asks_only_for_what_vllm_lacks(smol_dir, tmp_path, vllm_agent_server):
    """torch P (no cache), vLLM D with its prefix cache (the agent's default): turn 2 moves only
    the pages vLLM lacks and reports the rest as cached in `usage`; with P gone, turn 3's held
    decode is let go of and the panel answers from vLLM alone, leaving nothing running. (D is
    started beside the session's other servers, tests/system/conftest.py, and used by this test
    alone.)"""
    import openai

    from ..agents import AgentProcess, PanelProcess, settle

    d = vllm_agent_server
    with (
        AgentProcess("torch", smol_dir, tmp_path / "p") as p,
        PanelProcess(tmp_path / "panel", "--pair", f"pd={p.url},{d.url},threshold=1") as panel,
    ):
        client = openai.OpenAI(base_url=panel.url + "/v1", api_key=panel.api_key, max_retries=0)
        messages = [{"role": "system", "content": SYSTEM}]
        turns = []
        for question in TURNS[:3]:
            if len(turns) == 2:
                p.stop()  # turn 3: the prefiller is gone
            messages.append({"role": "user", "content": question})
            sent = p.status()["totals"]["bytes_sent"] if len(turns) < 2 else 0
            answer = client.chat.completions.create(
                model="pd", messages=messages, max_tokens=ANSWER_TOKENS, temperature=0
            )
            turns.append((answer, p.status()["totals"]["bytes_sent"] - sent if len(turns) < 2 else None))
            messages.append({"role": "assistant", "content": answer.choices[0].message.content})
        (first, first_bytes), (second, second_bytes), (third, _) = turns
        page_frame = first_bytes // -(-(first.usage.prompt_tokens - 1) // 64)  # recompute-last: n-1
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        # vLLM holds turn 1's prompt and answer but its last token, in whole pages
        have = min(first.usage.prompt_tokens + first.usage.completion_tokens - 1, second.usage.prompt_tokens - 1) // 64
        assert second.usage.prompt_tokens_details.cached_tokens == have * 64 > 0
        assert second_bytes == page_frame * (-(-(second.usage.prompt_tokens - 1) // 64) - have)
        assert third.choices[0].message.content  # vLLM alone, after its held decode was let go of
        settle(d)
        wait_for(lambda: d.status()["engine_stats"]["running"] == 0, timeout=30, step=0.1)
        assert d.status()["prefix_cache"]["hit_tokens"] >= have * 64
