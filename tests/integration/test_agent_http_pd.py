"""Two agents in separate processes (the cluster's torch and MLX agents) do P/D over HTTP on
loopback: the tokens are those of the same pair in one process (same-engine pairs: the engine's
own local run), in both first-token modes and every page encoding, and what each handoff moved is
reported. (Moved here from tests/system/test_agent_pd.py, which started its own torch and MLX agents.)

Every HTTP request the file compares is asked once, in `http` (all at once: torch and MLX decoders
decode a batch exactly as one request, tests/system/test_batching.py), and every in-process run
once, in `expected`; the tests read them."""

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
LONG = 193
LENGTHS = [1, LONG]
SAMPLING = {"max_tokens": 16, "ignore_eos": True}
PAIRS = [("torch", "mlx"), ("mlx", "torch")]
DIRECTIONS = PAIRS + [("torch", "torch"), ("mlx", "mlx")]
RL, CF = FirstTokenMode.RECOMPUTE_LAST, FirstTokenMode.COMMIT_FIRST
LOSSY = {"fp8": 0.51, "int8": 0.52}  # encoding: its bytes at most this fraction of FP16's

# (p, d, prompt length, mode, page encoding): every P/D request the file compares
RAW = [(p, d, n, m, "raw") for m in FirstTokenMode for p, d in DIRECTIONS for n in LENGTHS if n > 1 or m is CF]
ZSTD = [(p, d, LONG, m, "zstd") for p, d in PAIRS for m in FirstTokenMode]
CODED = [(p, d, LONG, CF, enc) for p, d in PAIRS for enc in LOSSY]


@pytest.fixture(scope="module")
def http(cluster, long_ids) -> dict:
    """Each case's NDJSON lines over HTTP. The recompute-last requests go first, together; then
    the rest, together: by then each prefiller's prefix cache holds the prompt's three whole pages,
    which the rest read rather than each prefilling them again side by side."""

    async def ask(cases: list) -> list:
        calls = [
            pd_request(cluster[p].url, cluster[d].url, prompt(long_ids, n), SAMPLING, m.value, page_encoding=enc)
            for p, d, n, m, enc in cases
        ]
        return list(await asyncio.gather(*calls))

    first = [c for c in RAW if c[3] is RL]
    rest = [c for c in RAW + ZSTD + CODED if c not in first]
    return dict(zip(first + rest, run(ask(first)) + run(ask(rest)), strict=True))


@pytest.fixture(scope="module")
def expected(engines, long_ids) -> dict:
    """Each raw or lossy case's tokens in this process, all at once: the same pair in one process
    (a lossy one with such frames: tandem_protocol/fp8.py, int8.py both ways), or for a
    same-engine pair the engine's own local run (tests/system/test_same_engine_pd.py holds the
    same-engine pair in one process equal to it)."""
    params = SamplingParams(**SAMPLING)
    # a same-engine pair's cases of one length share one local run (either mode)
    runs = list(dict.fromkeys((p, d, n, m, enc) if p != d else (d, n) for p, d, n, m, enc in RAW + CODED))

    def tokens(key):
        if len(key) == 2:
            d, n = key
            return collect(engines[d].generate(EngineRequest(f"local-{d}-{n}", prompt(long_ids, n), params)))
        p, d, n, m, enc = key
        return collect(run_pair(engines[p], engines[d], prompt(long_ids, n), params, m, encoding=ENCODINGS[enc]))

    async def main():
        return await asyncio.gather(*(tokens(key) for key in runs))

    got = dict(zip(runs, run(main()), strict=True))
    return {(p, d, n, m, enc): got[(p, d, n, m, enc) if p != d else (d, n)] for p, d, n, m, enc in RAW + CODED}


@pytest.mark.parametrize("mode", list(FirstTokenMode), ids=lambda m: m.value)
def test_http_pd_equals_in_process_pd(cluster, http, expected, mode):
    """Over HTTP the tokens are exactly those of the same pair in one process (which the core
    tests hold within agreement rules across engines), and for a same-engine pair exactly the
    engine's local run (tests/system/test_same_engine_pd.py holds the in-process pair equal to it)."""
    for case in [c for c in RAW if c[3] is mode]:
        p, d, n, _, _ = case
        lines = http[case]
        assert tokens_of(lines) == expected[case], case
        done = lines[-1]
        moved = n - 1 if mode is RL else n
        assert done["done"] and done["completion_tokens"] == 16 and done["kv_tokens"] == moved
        assert done["pages"] == -(-moved // 64)
    for name in ("torch", "mlx"):
        s = cluster[name].status()
        assert s["budget"]["reserved"] == 0 and s["open_handoffs"] == 0 and s["active_requests"] == 0


def test_compressed_pages_give_the_same_tokens_in_fewer_bytes(cluster, http):
    """A pair that asks for compressed pages (byte planes + zstd) decodes exactly what raw FP16
    pages give, both directions and modes, with fewer bytes on the wire."""
    for p, d, n, mode, _ in ZSTD:
        raw, packed = http[p, d, n, mode, "raw"], http[p, d, n, mode, "zstd"]
        assert tokens_of(packed) == tokens_of(raw), (p, d, mode)
        assert packed[-1]["pages"] == raw[-1]["pages"] == (3 if mode is RL else 4)
        assert packed[-1]["wire_bytes"] < 0.95 * raw[-1]["wire_bytes"], (packed[-1], raw[-1])
    with cluster["torch"].client() as c:
        assert "zstd" in c.get("/v1/info").json()["page_encodings"]


@pytest.mark.parametrize("encoding, ratio", LOSSY.items())
def test_lossy_pages_travel_in_about_half_the_bytes_and_decode_as_the_codec_says(http, expected, encoding, ratio):
    """A pair that asks for FP8 or INT8 pages: over HTTP, D decodes exactly what the same pair gives
    in one process with such frames (tandem_protocol/fp8.py, int8.py both ways), in about half the
    bytes of FP16."""
    for p, d in PAIRS:
        raw, lossy = http[p, d, LONG, CF, "raw"], http[p, d, LONG, CF, encoding]
        assert tokens_of(lossy) == expected[p, d, LONG, CF, encoding], (p, d)
        assert lossy[-1]["pages"] == raw[-1]["pages"] == 4
        assert lossy[-1]["wire_bytes"] < ratio * raw[-1]["wire_bytes"], (lossy[-1], raw[-1])


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
