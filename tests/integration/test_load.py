"""64 concurrent streaming requests through one pair, checked against the decoder alone.

- A prefiller's staging budget that fits only a few prompts, with each engine as that prefiller:
  tests/load.py says what is checked.
- At the default budgets (torch -> MLX and MLX -> torch, the batching engines: issue 19) every
  stream completes with its own answer and none gets 429.
- With a decode KV budget that fits a few requests (and 32 streams, about three times as many), the
  excess waits its turn and then completes or gets 429 with Retry-After: never a 5xx, never a lost
  or mixed-up answer.
Afterwards both agents are idle, nothing waits for a budget, and every budget is back to its own
figure. (The default-budget and decode-budget loads were tests/system/test_serving_load.py, on four
agents of its own; its torch -> torch and MLX -> MLX pairs add no engine the two mixed pairs lack:
the property is the decoder engine's batching.)"""

from __future__ import annotations

import asyncio
from contextlib import contextmanager

import httpx
import pytest

from ..conftest import write_report
from ..load import (
    BUDGET_PAGES,
    CONCURRENT,
    PAGE_BYTES,
    TOKEN_BYTES,
    check_load,
    one,
    panel_client,
    prompts_and_answers,
)
from .cluster import pair_name

# torch and MLX batch concurrent requests exactly (tests/system/test_batching.py); vLLM and SGLang with
# kernels whose float results depend on the batch (check_load's batch_invariant)
BATCHING_PAIRS = [("torch", "mlx"), ("mlx", "torch")]
SERVER_PAIRS = [("vllm", "vllm2"), ("sglang", "sglang2")]
# Room for 480 tokens: four of the load's longest requests (110-token prompt and 8 output tokens), about
# ten of its shortest (36 + 8) at once
SMALL_KV = 480 * TOKEN_BYTES
SMALL_KV_STREAMS = 32  # about three times what fits at once: most wait their turn


@contextmanager
def configured(agent, smol_dir, field: str, value: int):
    """One budget of `agent` set for the block (POST /v1/config: the same engine and model, so
    nothing reloads), its own figure restored after."""

    def set_to(n: int) -> None:
        with agent.client() as c:
            body = {"engine": agent.engine, "model_path": str(smol_dir), field: n}
            r = c.post("/v1/config", json=body)
            assert r.status_code == 200 and not r.json().get("loading"), r.text

    status = agent.status()
    original = status["budget"]["capacity"] if field == "staging_bytes" else status["decode"]["kv_capacity"]
    set_to(value)
    try:
        yield
    finally:
        set_to(original)


def idle(cluster, *names: str) -> None:
    """cluster.idle, and nothing left waiting for either budget."""
    cluster.idle(*names)
    for name in names:
        s = cluster[name].status()
        assert (s["budget"]["waiting"], s["decode"]["waiting"], s["decode"]["running"]) == (0, 0, 0), s


def cut_budget_load(cluster, smol_dir, p: str, d: str, invariant: bool, barrier=None) -> None:
    with configured(cluster[p], smol_dir, "staging_bytes", BUDGET_PAGES * PAGE_BYTES):
        figures = check_load(
            cluster[p],
            cluster[d],
            cluster.panel.url,
            cluster.api_key,
            pair_name(p, d),
            cluster.panel_home,
            invariant,
            barrier=barrier,
        )
    write_report(f"load_{p}_to_{d}", figures)
    idle(cluster, p, d)


# (P, D, batch-invariant decoder)
LOAD_PAIRS = [(p, d, True) for p, d in BATCHING_PAIRS] + [(p, d, False) for p, d in SERVER_PAIRS]


@pytest.mark.parametrize("p, d, invariant", LOAD_PAIRS, ids=[pair_name(p, d) for p, d, _ in LOAD_PAIRS])
def test_64_concurrent_streams_complete_or_get_429_and_none_is_mixed_up(cluster, smol_dir, p, d, invariant):
    """The prefiller's budget cut to BUDGET_PAGES for the run. (The vLLM and SGLang pairs share no
    agent and could load at once, check_load's `barrier`; run so, the SGLang pair failed once in
    the one run tried, not yet understood: they run one after the other.)"""
    cut_budget_load(cluster, smol_dir, p, d, invariant)


def burst(cluster, model: str, ids: list[list[int]], n: int = CONCURRENT) -> list[tuple[int, dict]]:
    """`n` streams through `model` at once, each prompt in turn: (prompt index, result)."""
    order = [i % len(ids) for i in range(n)]

    async def main():
        limits = httpx.Limits(max_connections=n)
        async with panel_client(cluster.panel.url, cluster.api_key, limits=limits) as client:
            return await asyncio.gather(*(one(client, model, ids[i]) for i in order))

    return list(zip(order, asyncio.run(main()), strict=True))


@pytest.mark.parametrize("p, d", BATCHING_PAIRS, ids=[pair_name(*x) for x in BATCHING_PAIRS])
def test_64_streams_at_the_default_budgets_all_complete_with_their_own_answers(cluster, p, d):
    ids, expected = prompts_and_answers(cluster[d])
    before = len(cluster.log())
    results = burst(cluster, pair_name(p, d), ids)
    assert [r["status"] for _, r in results] == [200] * CONCURRENT, [r for _, r in results if r["status"] != 200]
    assert [(r["text"], r["finish"]) for _, r in results] == [expected[i] for i, _ in results]
    idle(cluster, p, d)
    rows = cluster.log()[before:]
    assert len(rows) == CONCURRENT and all(r.outcome == "ok" for r in rows), rows


def test_past_a_small_decode_budget_streams_wait_then_complete_or_get_429(cluster, smol_dir):
    """On torch -> MLX: admission is the decoder agent's, whatever its engine. SMALL_KV_STREAMS at
    once, more than fit: more complete than could run at once, so some waited their turn first. A
    stream that waits past the decoder's 30 s gets 429 (where the machine is slow enough for that,
    the 429's form is checked)."""
    p, d = BATCHING_PAIRS[0]
    model = pair_name(p, d)
    ids, expected = prompts_and_answers(cluster[d])
    at_once = SMALL_KV // TOKEN_BYTES // (min(len(x) for x in ids) + 8)  # of the shortest, the most
    assert max(len(x) for x in ids) + 8 <= SMALL_KV // TOKEN_BYTES // 4 and SMALL_KV_STREAMS >= 3 * at_once
    with configured(cluster[d], smol_dir, "decode_kv_bytes", SMALL_KV):
        results = burst(cluster, model, ids, SMALL_KV_STREAMS)
    completed = [(i, r) for i, r in results if r["status"] == 200]
    refused = [r for _, r in results if r["status"] == 429]
    assert len(completed) + len(refused) == SMALL_KV_STREAMS, [r for _, r in results if r["status"] not in (200, 429)]
    assert [(r["text"], r["finish"]) for _, r in completed] == [expected[i] for i, _ in completed]
    for r in refused:
        assert float(r["retry_after"]) >= 1 and r["error"]["type"] == "rate_limit_exceeded", r
        assert "decode KV budget stayed busy" in r["error"]["message"], r
    assert len(completed) > at_once  # the first few ran at once, and others after them
    print(f"\n{model} with a {SMALL_KV:,}-byte decode budget: {len(completed)} completed, {len(refused)} got 429")
    write_report("load_small_decode_budget", {"completed": len(completed), "refused_429": len(refused)})
    idle(cluster, p, d)
