"""64 concurrent streaming requests through one pair whose prefiller's staging budget fits only a
few prompts, with each engine as that prefiller: tests/load.py says what is checked."""

from __future__ import annotations

import pytest

from ..conftest import write_report
from ..load import BUDGET_PAGES, PAGE_BYTES, check_load
from .cluster import pair_name

# torch and MLX batch concurrent requests exactly (tests/system/test_batching.py); vLLM and SGLang with
# kernels whose float results depend on the batch (check_load's batch_invariant)
LOAD_PAIRS = [("torch", "mlx", True), ("mlx", "torch", True), ("vllm", "vllm2", False), ("sglang", "sglang2", False)]


@pytest.mark.parametrize("p, d, invariant", LOAD_PAIRS, ids=[pair_name(p, d) for p, d, _ in LOAD_PAIRS])
def test_64_concurrent_streams_complete_or_get_429_and_none_is_mixed_up(cluster, smol_dir, p, d, invariant):
    """The prefiller's budget cut for the run (POST /v1/config: the same engine and model, so
    nothing reloads) and restored after."""
    agent = cluster[p]

    def budget(nbytes: int) -> None:
        with agent.client() as c:
            body = {"engine": agent.engine, "model_path": str(smol_dir), "staging_bytes": nbytes}
            r = c.post("/v1/config", json=body)
            assert r.status_code == 200 and not r.json().get("loading"), r.text

    original = agent.status()["budget"]["capacity"]
    budget(BUDGET_PAGES * PAGE_BYTES)
    try:
        figures = check_load(
            agent, cluster[d], cluster.panel.url, cluster.api_key, pair_name(p, d), cluster.panel_home, invariant
        )
    finally:
        budget(original)
    write_report(f"load_{p}_to_{d}", figures)
    cluster.idle(p, d)
