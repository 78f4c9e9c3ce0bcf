"""Many at once through the panel on the batching engines (issue 19): 64 concurrent streams on
torch->torch, MLX->MLX, torch->MLX and MLX->torch pairs, each prompt's answer checked against
its decoder alone (torch and MLX batch exactly: tests/system/test_batching.py).

- At the default budgets every stream completes with its own answer and none gets 429.
- With a decode KV budget that fits a few requests, the excess waits its turn and then completes
  or gets 429 with Retry-After: never a 5xx, never a lost or mixed-up answer.
Afterwards every budget on both agents is back to 0."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from ..agents import AgentProcess, PanelProcess, log_rows, settle
from ..load import CONCURRENT, alone, one, panel_client, prompts

PAIRS = {"torch-to-torch": ("torch", "torch2"), "mlx-to-mlx": ("mlx", "mlx2"), "torch-to-mlx": ("torch", "mlx2")}
PAIRS["mlx-to-torch"] = ("mlx", "torch2")
ENGINES = {"torch": "torch", "torch2": "torch", "mlx": "mlx", "mlx2": "mlx"}
SMALL_KV = 4 * 400 * 23_040  # room for about four of the prompts below with their 8 output tokens


@pytest.fixture(scope="module")
def desk(smol_dir, tmp_path_factory):
    """Two torch and two MLX agents and a panel with the four pairs."""
    home = tmp_path_factory.mktemp("serving")
    agents = {name: AgentProcess(engine, smol_dir, home / name) for name, engine in ENGINES.items()}
    try:
        for agent in agents.values():
            agent.wait_ready(300)
        pairs = [
            a
            for name, (p, d) in PAIRS.items()
            for a in ("--pair", f"{name}={agents[p].url},{agents[d].url},threshold=1")
        ]
        with PanelProcess(home / "panel", *pairs) as panel:
            yield agents, panel, home / "panel"
    finally:
        for agent in agents.values():
            agent.stop()


_ANSWERS: dict = {}


def prompts_and_answers(d: AgentProcess) -> tuple[list[list[int]], list]:
    """The load's prompts and the decoder's own answer to each, asked once per decoder agent: the
    pairs into one decoder, and both tests, share them (torch and MLX answer alone the same way
    every time)."""
    if d.url not in _ANSWERS:
        ids = prompts(d)
        _ANSWERS[d.url] = ids, [alone(d, x) for x in ids]
    return _ANSWERS[d.url]


def burst(panel: PanelProcess, model: str, ids: list[list[int]]) -> list[dict]:
    order = [i % len(ids) for i in range(CONCURRENT)]

    async def main():
        async with panel_client(panel.url, panel.api_key, limits=httpx.Limits(max_connections=CONCURRENT)) as client:
            return await asyncio.gather(*(one(client, model, ids[i]) for i in order))

    return list(zip(order, asyncio.run(main()), strict=True))


def idle(*agents: AgentProcess) -> None:
    settle(*agents)
    for agent in agents:
        s = agent.status()
        assert (s["budget"]["reserved"], s["decode"]["kv_reserved"], s["decode"]["running"]) == (0, 0, 0), s
        assert (s["budget"]["waiting"], s["decode"]["waiting"]) == (0, 0), s


@pytest.mark.parametrize("model", list(PAIRS))
def test_64_streams_at_the_default_budgets_all_complete_with_their_own_answers(desk, model):
    agents, panel, panel_home = desk
    p, d = (agents[n] for n in PAIRS[model])
    ids, expected = prompts_and_answers(d)
    before = len(log_rows(panel_home))
    results = burst(panel, model, ids)
    assert [r["status"] for _, r in results] == [200] * CONCURRENT, [r for _, r in results if r["status"] != 200]
    assert [(r["text"], r["finish"]) for _, r in results] == [expected[i] for i, _ in results]
    idle(p, d)
    rows = log_rows(panel_home)[before:]
    assert len(rows) == CONCURRENT and all(r.outcome == "ok" for r in rows), rows


def configure(agent: AgentProcess, smol_dir, **body) -> None:
    with agent.client() as c:
        r = c.post("/v1/config", json={"engine": agent.engine, "model_path": str(smol_dir), **body})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("model", ["torch-to-mlx"])  # admission is the agent's, whatever its engine
def test_past_a_small_decode_budget_streams_wait_then_complete_or_get_429(desk, smol_dir, model):
    agents, panel, _ = desk
    p, d = (agents[n] for n in PAIRS[model])
    ids, expected = prompts_and_answers(d)
    default = d.status()["decode"]["kv_capacity"]
    configure(d, smol_dir, decode_kv_bytes=SMALL_KV)
    try:
        results = burst(panel, model, ids)
    finally:
        configure(d, smol_dir, decode_kv_bytes=default)
    completed = [(i, r) for i, r in results if r["status"] == 200]
    refused = [r for _, r in results if r["status"] == 429]
    assert len(completed) + len(refused) == CONCURRENT, [r for _, r in results if r["status"] not in (200, 429)]
    assert [(r["text"], r["finish"]) for _, r in completed] == [expected[i] for i, _ in completed]
    for r in refused:
        assert float(r["retry_after"]) >= 1 and r["error"]["type"] == "rate_limit_exceeded", r
        assert "decode KV budget stayed busy" in r["error"]["message"], r
    assert len(completed) > 4  # the first few ran at once, and others after them
    print(f"\n{model} with a {SMALL_KV:,}-byte decode budget: {len(completed)} completed, {len(refused)} got 429")
    idle(p, d)
