"""Prefix caches on the in-process engines (engine_adapters/prefix_cache.py): a conversation's
next turn imports the pages the engine kept of the last one (its prompt and its answer) and
computes only what is new, and answers token for token as it would with no cache; a prefiller
sends the same pages from its cache as it computed.

An engine with a cache against the same engine without one is the engine against itself bit for
bit: the conversations, the eviction and the empty cache run on the tiny random-weight Llama
(`tiny_engines`), whose answers, like SmolLM2's, differ from turn to turn. The prefiller's pages
(a last token within a calibrated rounding bound, then P/D against the other engine alone) and
the turn through the panel (whose answers go back as text) run on the embedded model."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from engine_adapters.base import EngineRequest
from node_agent.inprocess import PairStats, run_pair
from tandem_protocol.pages import KVPage

from ..conftest import collect, run
from .conversation import ANSWER, SYSTEM, TURNS, GiB, common_pages, common_prefix, pair_conversation


def reused(held: list[list[int]], prompt: list[int], page_tokens: int) -> int:
    """The tokens of `prompt` a prefix cache holding `held` serves: its shared whole pages, then
    what the tail of a held sequence that ends right after them shares."""
    common = [len(common_prefix(h, prompt)) for h in held]
    pages = max(c // page_tokens for c in common)
    tails = [
        min(c, len(h)) - pages * page_tokens
        for h, c in zip(held, common, strict=True)
        if len(h) // page_tokens == pages and c >= pages * page_tokens
    ]
    return pages * page_tokens + max(tails, default=0)


def conversation(adapter, tag: str) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Each turn's prompt, answer and cached prompt tokens; every answer goes back into the chat as
    the ids the engine gave, then the template's text up to the next answer: a random model's
    answer need not survive a trip through text, and the cache reuses ids, not text."""
    messages, prompts, answers, cached = [{"role": "system", "content": SYSTEM}], [], [], []
    for i, turn in enumerate(TURNS):
        messages.append({"role": "user", "content": turn})
        if answers:
            said = adapter.chat_prompt(messages[:-2]) + messages[-2]["content"]
            rest = adapter.chat_prompt(messages)
            assert rest.startswith(said), (said, rest)
            ids = prompts[-1] + answers[-1] + adapter.encode(rest[len(said) :])
        else:
            ids = adapter.chat_token_ids(messages)
        req = EngineRequest(f"{tag}-{i}", ids, ANSWER)
        answer = run(collect(adapter.generate(req)))
        prompts.append(ids)
        answers.append(answer)
        cached.append(req.cached_tokens)
        messages.append({"role": "assistant", "content": adapter.detokenize(answer)})
    return prompts, answers, cached


@pytest.mark.parametrize("engine", ["torch", "mlx"])
def test_a_later_turn_computes_only_what_is_new_and_answers_as_without_cache(tiny_engines, cache_bytes, engine):
    adapter = tiny_engines[engine]
    P = adapter.geometry.page_tokens
    cache_bytes(adapter, 0)
    prompts, uncached, none = conversation(adapter, f"off-{engine}")
    assert none == [0] * len(TURNS) and adapter.prefix_cache.bytes == 0
    assert len(prompts[0]) > 10 * P, len(prompts[0])
    assert len({tuple(a) for a in uncached}) == len(TURNS)  # the answers depend on the prompt

    cache_bytes(adapter, GiB)
    before = adapter.prefix_cache_status()
    prompts_again, answers, cached = conversation(adapter, f"on-{engine}")
    assert prompts_again == prompts and answers == uncached  # token for token, every turn
    # Turn k reuses what earlier turns left in the engine, their prompts and their answers but
    # the last token (whose KV was never computed), within prompt k but its last token (computed
    # for its logits): every whole page it shares with them, then as many tokens as the partly
    # filled page one of them ended in (its tail) shares.
    held = [prompts[k] + answers[k][:-1] for k in range(len(TURNS))]
    expected = [0] + [reused(held[:k], prompts[k][:-1], P) for k in range(1, len(TURNS))]
    assert cached == expected
    assert any(c % P for c in cached[1:]), cached  # token for token, not whole pages only
    after = adapter.prefix_cache_status()
    assert after["hit_tokens"] - before["hit_tokens"] == sum(cached)
    assert after["lookup_tokens"] - before["lookup_tokens"] == sum(len(p) - 1 for p in prompts)


def test_a_prefiller_sends_from_its_cache_the_pages_it_computed(engines, cache_bytes, long_ids):
    torch_engine, mlx_engine = engines["torch"], engines["mlx"]
    cache_bytes(torch_engine, GiB)
    ids = [7, 8, 9] + long_ids  # a prompt no other test has cached

    async def prefill(tag: str) -> tuple[list[KVPage], int]:
        req = EngineRequest(tag, ids, ANSWER)
        items = await collect(torch_engine.prefill(req))
        return [p for p in items if isinstance(p, KVPage)], req.cached_tokens

    computed, none = run(prefill("first"))
    cached_pages, cached = run(prefill("second"))
    assert none == 0 and cached == len(ids) - 1  # the whole pages and the tail: all but the last token
    assert len(cached_pages) == len(computed)
    for a, b in zip(computed, cached_pages, strict=True):
        assert a.index == b.index and a.valid_tokens == b.valid_tokens
    # Every cached token's KV bit for bit; the last token's was computed again, alone rather than
    # inside a chunk, so it agrees to rounding: 0.0039 apart at most on values up to 17.7 when
    # measured, bound twice that.
    whole = [np.concatenate([p.kv for p in pages], axis=2) for pages in (computed, cached_pages)]
    first, again = (kv[:, :, :-1] for kv in whole)
    assert np.array_equal(first.view(np.uint16), again.view(np.uint16))
    last, last_again = (kv[:, :, -1].astype(np.float32) for kv in whole)
    assert np.abs(last - last_again).max() <= 0.008
    local = run(collect(mlx_engine.generate(EngineRequest("alone", ids, ANSWER))))
    assert run(collect(run_pair(torch_engine, mlx_engine, ids, ANSWER))) == local


@pytest.mark.parametrize("decoder", ["torch", "mlx"])
def test_an_eviction_during_a_handoff_leaves_the_request_whole(
    tiny_engines, cache_bytes, long_ids, monkeypatch, decoder
):
    """D holds its cached pages, then its whole cache is evicted while P prefills and sends the
    rest: the request still imports what it held (held by reference) and answers as uncached."""
    P, D = tiny_engines["torch"], tiny_engines[decoder]
    ids = [21, 22, 23, 24] + long_ids  # a prompt no other test has cached
    for adapter in (P, D):
        cache_bytes(adapter, 0)
    uncached = run(collect(run_pair(P, D, ids, ANSWER)))
    for adapter in (P, D):
        cache_bytes(adapter, GiB)
    run(collect(D.generate(EngineRequest(f"warm-{decoder}", ids, ANSWER))))  # D caches the prompt
    hold = D.hold_prefix

    async def hold_then_evict(req: EngineRequest) -> None:
        await hold(req)
        D.set_prefix_cache_bytes(0)  # everything evicted while the handoff runs

    monkeypatch.setattr(D, "hold_prefix", hold_then_evict)
    stats = PairStats()
    assert run(collect(run_pair(P, D, ids, ANSWER, stats=stats))) == uncached
    assert stats.have_pages == len(ids) // D.geometry.page_tokens and D.prefix_cache.bytes == 0


def test_a_cache_of_no_bytes_keeps_nothing(tiny_engines, cache_bytes, long_ids):
    adapter = tiny_engines["torch"]
    cache_bytes(adapter, GiB)
    run(collect(adapter.generate(EngineRequest("fill", long_ids, ANSWER))))
    assert adapter.prefix_cache.bytes > 0
    cache_bytes(adapter, 0)
    assert adapter.prefix_cache_status()["bytes"] == 0
    again = EngineRequest("again", long_ids, ANSWER)
    asyncio.run(collect(adapter.generate(again)))
    assert again.cached_tokens == 0 and adapter.prefix_cache.bytes == 0


@pytest.mark.parametrize("decoder", ["torch", "mlx"])
def test_a_later_turn_of_a_pair_sends_only_the_pages_the_decoder_lacks(tiny_engines, cache_bytes, decoder):
    P, D = tiny_engines["torch"], tiny_engines[decoder]
    page = D.geometry.page_tokens
    for adapter in (P, D):
        cache_bytes(adapter, 0)
    prompts, uncached, full = pair_conversation(P, D, f"pd-off-{decoder}")
    assert [s.have_pages for s in full] == [0] * len(TURNS)
    assert [s.pages for s in full] == [D.geometry.pages_for(len(ids)) for ids in prompts]  # commit-first: all
    assert len({tuple(a) for a in uncached}) == len(TURNS)  # the answers depend on the prompt

    for adapter in (P, D):
        cache_bytes(adapter, GiB)
    again, answers, delta = pair_conversation(P, D, f"pd-on-{decoder}")
    assert again == prompts and answers == uncached  # token for token, every turn
    # D holds what it decoded before: each earlier turn's prompt and answer but the last token.
    held = [prompts[k] + answers[k][:-1] for k in range(len(TURNS))]
    have = [0] + [max(common_pages(h, prompts[k], page) for h in held[:k]) // page for k in range(1, len(TURNS))]
    assert [s.have_pages for s in delta] == have
    assert all(h > 0 for h in have[1:])
    assert [s.pages for s in delta] == [D.geometry.pages_for(len(ids)) - h for ids, h in zip(prompts, have)]


def test_through_the_panel_a_second_turn_moves_only_the_delta(smol_dir, tmp_path):
    """torch P, MLX D, default budgets: turn 2 reports its cached prompt tokens in `usage`, P sends
    only the pages D lacks, and a budget of 0 set by /v1/config empties the cache."""
    import openai

    from ..agents import AgentProcess, PanelProcess, settle, side_by_side

    with (
        side_by_side(
            lambda: AgentProcess("torch", smol_dir, tmp_path / "p", prefix_cache="default"),
            lambda: AgentProcess("mlx", smol_dir, tmp_path / "d", prefix_cache="default"),
        ) as (p, d),
        PanelProcess(tmp_path / "panel", "--pair", f"pd={p.url},{d.url},threshold=1") as panel,
    ):
        client = openai.OpenAI(base_url=panel.url + "/v1", api_key=panel.api_key, max_retries=0)
        messages = [{"role": "system", "content": SYSTEM}]
        turns = []
        for question in TURNS[:2]:
            messages.append({"role": "user", "content": question})
            sent = p.status()["totals"]["bytes_sent"]
            answer = client.chat.completions.create(model="pd", messages=messages, max_tokens=8, temperature=0)
            turns.append((answer.usage, p.status()["totals"]["bytes_sent"] - sent))
            messages.append({"role": "assistant", "content": answer.choices[0].message.content})
        settle(p, d)
        (first, first_bytes), (second, second_bytes) = turns
        page_frame = first_bytes // -(-first.prompt_tokens // 64)  # every page of turn 1 went
        assert first.prompt_tokens_details.cached_tokens == 0
        # P computed turn 1's prompt, D also its answer (but the last token): every page of that
        # D holds, and P's cache serves at least turn 1's prompt
        assert second.prompt_tokens_details.cached_tokens >= first.prompt_tokens
        have = min(first.prompt_tokens + first.completion_tokens - 1, second.prompt_tokens) // 64
        assert second_bytes == page_frame * (-(-second.prompt_tokens // 64) - have)
        for agent in (p, d):
            status = agent.status()["prefix_cache"]
            assert status["bytes"] > 0 and status["hit_tokens"] > 0, status
            with agent.client() as c:
                metrics = dict(line.split(" ", 1) for line in c.get("/metrics").text.splitlines() if line[0] != "#")
                assert float(metrics["tandem_prefix_cache_bytes"]) == status["bytes"]
                assert float(metrics["tandem_prefix_cache_hit_tokens"]) == status["hit_tokens"]
                info = agent.info()
                body = {"engine": info["engine"], "model_path": info["model_path"], "prefix_cache_bytes": 0}
                assert c.post("/v1/config", json=body, timeout=60).json()["changed"] is True
            assert agent.status()["prefix_cache"]["bytes"] == 0
