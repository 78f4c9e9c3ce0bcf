"""Same-engine P/D equals a local run token for token, in both first-token modes.

Bitwise equality of one engine with itself depends on the page plumbing (which tokens a page
holds, where it lands, the first-token hand-over), not on the weights: the grid of lengths runs
on a tiny random-weight Llama with SmolLM2's head_dim (64) and 3 query heads per KV head, and
one length runs on the embedded model itself (30 layers, 3 KV heads)."""

from __future__ import annotations

import pytest

from engine_adapters.base import EngineRequest
from node_agent.inprocess import PairStats, run_pair
from tandem_protocol.errors import RequestError
from tandem_protocol.handoff import FirstTokenMode
from tandem_protocol.sampling import SamplingParams

from ..conftest import collect, own_greedy, prompt, run

ENGINES = ["torch", "mlx"]
LENGTHS = [1, 63, 64, 65, 66, 127, 128, 129, 130, 193]
# 16 steps, each attending over every imported page: a wrong page shows in the first of them
# (tests/system/test_decoders_consume_pages.py measures how far); 32 took a minute longer on two cores.
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def local_outputs(tiny_engines, long_ids):
    """Each engine's own greedy output for each prompt length, computed once."""
    outputs = {
        (name, n): run(collect(engine.generate(EngineRequest(f"local-{n}", prompt(long_ids, n), GREEDY))))
        for name, engine in tiny_engines.items()
        for n in LENGTHS
    }
    # the random model's answers depend on the prompt (a page it did not see would change them)
    for name in ENGINES:
        assert len({tuple(outputs[name, n]) for n in LENGTHS}) == len(LENGTHS), name
    return outputs


def check_pd_equals_local(adapter, ids: list[int], mode: FirstTokenMode, local: list[int]) -> None:
    stats = PairStats()
    out = run(collect(run_pair(adapter, adapter, ids, GREEDY, mode, stats)))
    assert len(out) == GREEDY.max_tokens
    assert out == local
    moved = len(ids) - 1 if mode is FirstTokenMode.RECOMPUTE_LAST else len(ids)
    assert stats.kv_tokens == moved and stats.pages == -(-moved // 64)
    assert stats.wire_bytes == stats.pages * (88 + adapter.geometry.page_bytes)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("mode", list(FirstTokenMode), ids=lambda m: m.value)
@pytest.mark.parametrize("n", LENGTHS)
def test_pd_equals_local(tiny_engines, long_ids, local_outputs, engine, mode, n):
    adapter = tiny_engines[engine]
    ids = prompt(long_ids, n)
    if mode is FirstTokenMode.RECOMPUTE_LAST and n == 1:
        with pytest.raises(RequestError, match="at least 2 tokens"):
            run(collect(run_pair(adapter, adapter, ids, GREEDY, mode)))
        return
    check_pd_equals_local(adapter, ids, mode, local_outputs[(engine, n)])


@pytest.mark.parametrize(
    "engine, mode",
    [("torch", FirstTokenMode.RECOMPUTE_LAST), ("mlx", FirstTokenMode.COMMIT_FIRST)],
    ids=["torch-recompute-last", "mlx-commit-first"],
)
def test_pd_equals_local_on_the_embedded_model(engines, long_ids, engine, mode):
    """130 tokens: two full pages and a partial one (one token with recompute-last, two with
    commit-first); each engine once, each mode once (the grid above has every combination)."""
    adapter, ids = engines[engine], prompt(long_ids, 130)
    check_pd_equals_local(adapter, ids, mode, own_greedy(adapter, ids, GREEDY.max_tokens))
