"""Every direction through the panel's OpenAI API: at each of the core issue's prompt lengths (around
page boundaries) the P/D completion equals the decoder alone (the decoder's node through the same
panel) and reports its usage. At one length, a page exactly, the P/D completion is asked streaming
(with its usage chunk) instead: the streamed answer equals the decoder alone's whole one there, as
the whole P/D answers do at the other lengths (the stream is the same tokens framed differently:
asking both at a length, or at every length, would only repeat it). The chat answer ("Paris",
streaming equal to not streaming on the same route) is checked on every direction by
tests/integration/test_api_fields.py, and text completions' streamed tokens equal to whole ones
by its test_text_completions_report_the_legacy_shape."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from ..conftest import lane_first, prompt, write_report
from .cluster import AGENTS, DIRECTIONS, for_each, pair_name

LENGTHS = [64, 65, 66, 128, 129, 130, 193]
STREAMED = 64  # the length asked streaming (the others whole)
MAX_TOKENS = 16


def test_every_pair_and_node_is_listed(cluster):
    names = {m.id for m in cluster.client.models.list()}
    nodes = {f"node/{engine}-{name}" for name, (engine, _) in AGENTS.items()}
    assert {pair_name(*x) for x in DIRECTIONS} | nodes <= names, names


@pytest.fixture(scope="module")
def answers(cluster, long_ids) -> dict:
    """Every direction's P/D answers at every length, and each decoder's own, asked per decoder:
    into a torch or MLX decoder all at once (they decode a batch as one request: the load test's
    64 streams), into vLLM and SGLang one at a time (their CPU kernels depend on the batch). The
    decoders are asked side by side, with both cores (tests/conftest.py FIRST_LOCK).
    {(p, d): {length: {"pd", "streamed", "usage", "alone_equal"}}}"""
    client = cluster.client

    def pd(pair: str, n: int) -> dict:
        args = dict(model=pair, prompt=prompt(long_ids, n), max_tokens=MAX_TOKENS, temperature=0)
        if n == STREAMED:
            chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
            text, usage = "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage
        else:
            answer = client.completions.create(**args)
            text, usage = answer.choices[0].text, answer.usage
        return {"pd": text, "streamed": n == STREAMED, "usage": (usage.prompt_tokens, usage.completion_tokens)}

    def into(d: str) -> dict:
        directions = [(p, x) for p, x in DIRECTIONS if x == d]
        asks = [(pair_name(p, d), n) for p, _ in directions for n in LENGTHS] + [(None, n) for n in LENGTHS]
        got = for_each(
            d, lambda ask: pd(*ask) if ask[0] else cluster.alone(d, prompt(long_ids, ask[1]), MAX_TOKENS), asks
        )
        own = dict(zip(LENGTHS, got[-len(LENGTHS) :], strict=True))
        rows = {}
        for k, direction in enumerate(directions):
            rows[direction] = dict(zip(LENGTHS, got[k * len(LENGTHS) : (k + 1) * len(LENGTHS)], strict=True))
            for n, row in rows[direction].items():
                row["alone_equal"] = row["pd"] == own[n]
        return rows

    decoders = sorted({d for _, d in DIRECTIONS})
    with lane_first(), ThreadPoolExecutor(len(decoders)) as pool:
        return {k: v for part in pool.map(into, decoders) for k, v in part.items()}


@pytest.mark.parametrize("p, d", DIRECTIONS, ids=[pair_name(*x) for x in DIRECTIONS])
def test_pd_equals_the_decoder_alone_at_every_length(cluster, answers, p, d):
    rows, pair = answers[p, d], pair_name(p, d)
    write_report(f"direction_{pair}", rows)
    agree = sum(r["alone_equal"] for r in rows.values())
    print(f"\n{p}->{d}: greedy agreement with {d} alone {agree}/{len(LENGTHS)}")
    assert all(r["usage"][0] == n and 0 < r["usage"][1] <= MAX_TOKENS for n, r in rows.items()), rows
    assert agree == len(LENGTHS), rows
    cluster.idle(p, d)
