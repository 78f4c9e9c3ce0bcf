"""Tiny random-weight Qwen2 and Qwen3 checkpoints round-trip through both adapters."""

from __future__ import annotations

import numpy as np
import pytest

from engine_adapters import load_adapter
from engine_adapters.base import EngineRequest
from node_agent.inprocess import run_pair
from tandem_protocol.handoff import FirstTokenMode
from tandem_protocol.pages import KVPage
from tandem_protocol.sampling import SamplingParams

from ..conftest import collect, make_tiny_checkpoint, max_abs_diff, run
from ..integration.rules import first_step_logits

SAMPLING = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def tiny_engines(request, tmp_path_factory, smol_dir):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param) / "m", request.param, smol_dir, seed=3)
    engines = {name: load_adapter(name, path, context_length=512) for name in ("torch", "mlx")}
    yield request.param, engines
    for engine in engines.values():
        engine.close()


def ids_of(n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(n).integers(20, 49000, size=n)]


async def pages_of(engine, ids):
    req = EngineRequest(f"pages-{engine.name}", ids, SamplingParams(max_tokens=1))
    return [p for p in await collect(engine.prefill(req)) if isinstance(p, KVPage)]


@pytest.mark.parametrize("n", [1, 64, 70, 130])
def test_same_engine_round_trip(tiny_engines, n):
    _, engines = tiny_engines
    for engine in engines.values():
        local = run(collect(engine.generate(EngineRequest("local", ids_of(n), SAMPLING))))
        for mode in FirstTokenMode:
            if mode is FirstTokenMode.RECOMPUTE_LAST and n == 1:
                continue
            assert run(collect(run_pair(engine, engine, ids_of(n), SAMPLING, mode))) == local, (engine.name, mode)


def test_both_engines_export_the_same_pages(tiny_engines):
    model_type, engines = tiny_engines
    ids = ids_of(130)
    torch_pages, mlx_pages = run(pages_of(engines["torch"], ids)), run(pages_of(engines["mlx"], ids))
    assert [p.valid_tokens for p in torch_pages] == [p.valid_tokens for p in mlx_pages] == [64, 64, 2]
    for a, b in zip(torch_pages, mlx_pages):
        scale = float(np.max(np.abs(a.kv.astype(np.float32))))
        assert max_abs_diff(a.kv, b.kv) <= 2e-3 * scale, model_type


@pytest.mark.parametrize("direction", [("torch", "mlx"), ("mlx", "torch")], ids=lambda d: "->".join(d))
def test_cross_engine_logits(tiny_engines, direction):
    _, engines = tiny_engines
    imported, local = run(first_step_logits(engines[direction[0]], engines[direction[1]], ids_of(100)))
    assert max_abs_diff(imported, local) <= 1e-2 * float(np.max(np.abs(local)))
