"""Two agents in separate processes (the cluster's torch and MLX agents) do P/D over HTTP on
loopback: the tokens are those of the same pair in one process, in both first-token modes and
every page encoding, and what each handoff moved is reported. (Moved here from
tests/system/test_agent_pd.py, which started its own torch and MLX agents.)"""

from __future__ import annotations

import pytest

from engine_adapters.base import EngineRequest
from node_agent.inprocess import run_pair
from tandem_protocol.handoff import FirstTokenMode
from tandem_protocol.pages import ENCODINGS
from tandem_protocol.sampling import SamplingParams

from ..agents import pd_request, tokens_of
from ..conftest import collect, prompt, run

# A one-token prompt (commit-first only: recompute-last moves no page) and one past three page
# boundaries; 64 and 65 (one page, one page and a token) are the panel-level lengths of
# tests/integration/test_directions.py for these same agents. (It ran at 1, 64, 65, 193.)
LENGTHS = [1, 193]
SAMPLING = {"max_tokens": 16, "ignore_eos": True}
DIRECTIONS = [("torch", "mlx"), ("mlx", "torch"), ("torch", "torch"), ("mlx", "mlx")]


@pytest.mark.parametrize("direction", DIRECTIONS, ids=lambda d: "->".join(d))
@pytest.mark.parametrize("mode", list(FirstTokenMode), ids=lambda m: m.value)
def test_http_pd_equals_in_process_pd(cluster, engines, long_ids, direction, mode):
    """Over HTTP the tokens are exactly those of the same pair in one process (which the core
    tests hold equal to local runs for same-engine pairs and within agreement rules across)."""
    p, d = cluster[direction[0]], cluster[direction[1]]
    for n in LENGTHS:
        if mode is FirstTokenMode.RECOMPUTE_LAST and n == 1:
            continue
        ids = prompt(long_ids, n)
        lines = run(pd_request(p.url, d.url, ids, SAMPLING, mode.value))
        expected = run(
            collect(run_pair(engines[direction[0]], engines[direction[1]], ids, SamplingParams(**SAMPLING), mode))
        )
        assert tokens_of(lines) == expected, (direction, mode, n)
        done = lines[-1]
        moved = n - 1 if mode is FirstTokenMode.RECOMPUTE_LAST else n
        assert done["done"] and done["completion_tokens"] == 16 and done["kv_tokens"] == moved
        assert done["pages"] == -(-moved // 64)
    for agent in (p, d):
        s = agent.status()
        assert s["budget"]["reserved"] == 0 and s["open_handoffs"] == 0 and s["active_requests"] == 0


def test_compressed_pages_give_the_same_tokens_in_fewer_bytes(cluster, long_ids):
    """A pair that asks for compressed pages (byte planes + zstd) decodes exactly what raw FP16
    pages give, both directions and modes, with fewer bytes on the wire."""
    for p, d in (("torch", "mlx"), ("mlx", "torch")):
        for mode in FirstTokenMode:
            ids = prompt(long_ids, 193)
            raw = run(pd_request(cluster[p].url, cluster[d].url, ids, SAMPLING, mode.value))
            packed = run(pd_request(cluster[p].url, cluster[d].url, ids, SAMPLING, mode.value, page_encoding="zstd"))
            assert tokens_of(packed) == tokens_of(raw), (p, d, mode)
            assert packed[-1]["pages"] == raw[-1]["pages"] == (3 if mode is FirstTokenMode.RECOMPUTE_LAST else 4)
            assert packed[-1]["wire_bytes"] < 0.95 * raw[-1]["wire_bytes"], (packed[-1], raw[-1])
    with cluster["torch"].client() as c:
        assert "zstd" in c.get("/v1/info").json()["page_encodings"]


@pytest.mark.parametrize("encoding, ratio", [("fp8", 0.51), ("int8", 0.52)])
def test_lossy_pages_travel_in_about_half_the_bytes_and_decode_as_the_codec_says(
    cluster, engines, long_ids, encoding, ratio
):
    """A pair that asks for FP8 or INT8 pages: over HTTP, D decodes exactly what the same pair gives
    in one process with such frames (tandem_protocol/fp8.py, int8.py both ways), in about half the
    bytes of FP16."""
    for p, d in (("torch", "mlx"), ("mlx", "torch")):
        ids = prompt(long_ids, 193)
        raw = run(pd_request(cluster[p].url, cluster[d].url, ids, SAMPLING, "commit-first"))
        lossy = run(pd_request(cluster[p].url, cluster[d].url, ids, SAMPLING, "commit-first", page_encoding=encoding))
        params = SamplingParams(**SAMPLING)
        expected = run(
            collect(
                run_pair(engines[p], engines[d], ids, params, FirstTokenMode.COMMIT_FIRST, encoding=ENCODINGS[encoding])
            )
        )
        assert tokens_of(lossy) == expected, (p, d)
        assert lossy[-1]["pages"] == raw[-1]["pages"] == 4
        assert lossy[-1]["wire_bytes"] < ratio * raw[-1]["wire_bytes"], (lossy[-1], raw[-1])


def test_same_engine_http_pd_equals_local(cluster, engines, long_ids):
    for name in ("torch", "mlx"):
        ids = prompt(long_ids, 129)
        local = run(collect(engines[name].generate(EngineRequest("l", ids, SamplingParams(**SAMPLING)))))
        assert tokens_of(run(pd_request(cluster[name].url, cluster[name].url, ids, SAMPLING))) == local


def test_pages_arrive_before_prefill_finishes(cluster, long_ids):
    """A 600-token prompt prefills in 3 chunks; D must hold pages before P's prefill is over."""
    ids = (list(long_ids) * 3)[:600]
    done = run(pd_request(cluster["torch"].url, cluster["mlx"].url, ids, {"max_tokens": 2}))[-1]
    assert done["pages"] == 10
    print(
        f"\nfirst page at D {done['first_page_at']:.3f}, last page {done['last_page_at']:.3f}, "
        f"P prefill finished {done['prefill_finished_at']:.3f} (prefill took {done['prefill_seconds']:.3f} s)"
    )
    assert done["first_page_at"] < done["prefill_finished_at"], done
