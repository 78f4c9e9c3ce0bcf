"""Same-engine P/D equals a local run token for token, in both first-token modes."""

from __future__ import annotations

import pytest

from engine_adapters.base import EngineRequest
from node_agent.inprocess import PairStats, run_pair
from tandem_protocol.errors import RequestError
from tandem_protocol.handoff import FirstTokenMode
from tandem_protocol.sampling import SamplingParams

from ..conftest import collect, prompt, run

LENGTHS = [1, 63, 64, 65, 66, 127, 128, 129, 130, 193]
# 16 steps, each attending over every imported page: a wrong page shows in the first of them
# (tests/system/test_decoders_consume_pages.py measures how far); 32 took a minute longer on two cores.
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def local_outputs(engines, long_ids):
    """Each engine's own greedy output for each prompt length, computed once."""
    return {
        (name, n): run(collect(engine.generate(EngineRequest(f"local-{n}", prompt(long_ids, n), GREEDY))))
        for name, engine in engines.items()
        for n in LENGTHS
    }


@pytest.mark.parametrize("engine", ["torch", "mlx"])
@pytest.mark.parametrize("mode", list(FirstTokenMode), ids=lambda m: m.value)
@pytest.mark.parametrize("n", LENGTHS)
def test_pd_equals_local(engines, long_ids, local_outputs, engine, mode, n):
    adapter = engines[engine]
    ids = prompt(long_ids, n)
    if mode is FirstTokenMode.RECOMPUTE_LAST and n == 1:
        with pytest.raises(RequestError, match="at least 2 tokens"):
            run(collect(run_pair(adapter, adapter, ids, GREEDY, mode)))
        return
    stats = PairStats()
    out = run(collect(run_pair(adapter, adapter, ids, GREEDY, mode, stats)))
    assert len(out) == GREEDY.max_tokens
    assert out == local_outputs[(engine, n)]
    moved = n - 1 if mode is FirstTokenMode.RECOMPUTE_LAST else n
    assert stats.kv_tokens == moved and stats.pages == -(-moved // 64)
    assert stats.wire_bytes == stats.pages * (88 + adapter.geometry.page_bytes)
