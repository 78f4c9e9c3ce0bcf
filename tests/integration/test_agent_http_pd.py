"""Two agents in separate processes (the cluster's torch and MLX agents) do P/D over HTTP on
loopback: the tokens are those of the same pair in one process, in both first-token modes and
every page encoding, and what each handoff moved is reported. (Moved here from
tests/system/test_agent_pd.py, which started its own torch and MLX agents.)"""

from __future__ import annotations

import asyncio

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
PAIRS = [("torch", "mlx"), ("mlx", "torch")]
DIRECTIONS = PAIRS + [("torch", "torch"), ("mlx", "mlx")]


def at_once(cluster, requests: list[tuple[str, str, list[int], str, str]]) -> list[list[dict]]:
    """P/D requests (p, d, ids, mode, page encoding) over HTTP, all at once: torch and MLX decoders
    decode a batch exactly as one request."""

    async def main():
        calls = [
            pd_request(cluster[p].url, cluster[d].url, ids, SAMPLING, mode, page_encoding=enc)
            for p, d, ids, mode, enc in requests
        ]
        return list(await asyncio.gather(*calls))

    return run(main())


@pytest.mark.parametrize("mode", list(FirstTokenMode), ids=lambda m: m.value)
def test_http_pd_equals_in_process_pd(cluster, engines, long_ids, mode):
    """Over HTTP the tokens are exactly those of the same pair in one process (which the core
    tests hold equal to local runs for same-engine pairs and within agreement rules across).
    Every direction and length at once, over HTTP and in process: torch and MLX decode a batch
    exactly as one request (tests/system/test_batching.py)."""
    cases = [(p, d, n) for p, d in DIRECTIONS for n in LENGTHS if n > 1 or mode is FirstTokenMode.COMMIT_FIRST]

    async def in_process() -> list[list[int]]:
        params = SamplingParams(**SAMPLING)
        runs = [collect(run_pair(engines[p], engines[d], prompt(long_ids, n), params, mode)) for p, d, n in cases]
        return list(await asyncio.gather(*runs))

    answers = at_once(cluster, [(p, d, prompt(long_ids, n), mode.value, "raw") for p, d, n in cases])
    expected = run(in_process())
    for (p, d, n), lines, want in zip(cases, answers, expected, strict=True):
        assert tokens_of(lines) == want, (p, d, mode, n)
        done = lines[-1]
        moved = n - 1 if mode is FirstTokenMode.RECOMPUTE_LAST else n
        assert done["done"] and done["completion_tokens"] == 16 and done["kv_tokens"] == moved
        assert done["pages"] == -(-moved // 64)
    for name in ("torch", "mlx"):
        s = cluster[name].status()
        assert s["budget"]["reserved"] == 0 and s["open_handoffs"] == 0 and s["active_requests"] == 0


def test_compressed_pages_give_the_same_tokens_in_fewer_bytes(cluster, long_ids):
    """A pair that asks for compressed pages (byte planes + zstd) decodes exactly what raw FP16
    pages give, both directions and modes, with fewer bytes on the wire."""
    ids = prompt(long_ids, 193)
    cases = [(p, d, mode) for p, d in PAIRS for mode in FirstTokenMode]
    answers = at_once(cluster, [(p, d, ids, mode.value, enc) for p, d, mode in cases for enc in ("raw", "zstd")])
    for k, (p, d, mode) in enumerate(cases):
        raw, packed = answers[2 * k], answers[2 * k + 1]
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
    ids, mode, params = prompt(long_ids, 193), FirstTokenMode.COMMIT_FIRST, SamplingParams(**SAMPLING)
    answers = at_once(cluster, [(p, d, ids, mode.value, enc) for p, d in PAIRS for enc in ("raw", encoding)])

    async def in_process():
        codec = ENCODINGS[encoding]
        return await asyncio.gather(
            *(collect(run_pair(engines[p], engines[d], ids, params, mode, encoding=codec)) for p, d in PAIRS)
        )

    for k, ((p, d), expected) in enumerate(zip(PAIRS, run(in_process()), strict=True)):
        raw, lossy = answers[2 * k], answers[2 * k + 1]
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
