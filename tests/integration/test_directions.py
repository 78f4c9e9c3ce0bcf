"""Every direction through the panel's OpenAI API: at each of the core issue's prompt lengths (around
page boundaries) the P/D completion equals the decoder alone (the decoder's node through the same
panel) and reports its usage; streaming equals not streaming at one length on each side of a page
boundary (the stream is the same tokens framed differently: every length would only repeat it).
The chat answer ("Paris", streaming and not) is checked on every direction by
tests/integration/test_api_fields.py."""

from __future__ import annotations

import functools

import pytest

from ..agents import complete
from ..conftest import prompt, write_report
from .cluster import AGENTS, DIRECTIONS, for_each, pair_name

LENGTHS = [64, 65, 66, 128, 129, 130, 193]
STREAMED = (64, 193)  # lengths also asked for streaming
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def alone(cluster, long_ids):
    """The decoder's own answer at a length, asked once per decoder and length."""
    return functools.cache(lambda decoder, n: cluster.alone(decoder, prompt(long_ids, n)))


def test_every_pair_and_node_is_listed(cluster):
    names = {m.id for m in cluster.client.models.list()}
    nodes = {f"node/{engine}-{name}" for name, (engine, _) in AGENTS.items()}
    assert {pair_name(*x) for x in DIRECTIONS} | nodes <= names, names


@pytest.mark.parametrize("p, d", DIRECTIONS, ids=[pair_name(*x) for x in DIRECTIONS])
def test_pd_equals_the_decoder_alone_at_every_length(cluster, long_ids, alone, p, d):
    """Into a torch or MLX decoder every length goes at once (they decode a batch exactly as one
    request: tests/system/test_batching.py); into vLLM and SGLang one at a time."""
    client, pair = cluster.client, pair_name(p, d)

    def row(n: int) -> dict:
        ids = prompt(long_ids, n)
        answer = client.completions.create(model=pair, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
        whole, usage = answer.choices[0].text, answer.usage
        out = {
            "pd": whole,
            "alone_equal": whole == alone(d, n),
            "usage": (usage.prompt_tokens, usage.completion_tokens),
        }
        if n in STREAMED:
            out["streamed_equal"] = complete(client, pair, ids, True, MAX_TOKENS) == whole
        return out

    rows = dict(zip(LENGTHS, for_each(d, row, LENGTHS), strict=True))
    write_report(f"direction_{pair}", rows)
    agree = sum(r["alone_equal"] for r in rows.values())
    print(f"\n{p}->{d}: greedy agreement with {d} alone {agree}/{len(LENGTHS)}")
    assert all(r["streamed_equal"] for r in rows.values() if "streamed_equal" in r), rows
    assert sum("streamed_equal" in r for r in rows.values()) == len(STREAMED), rows
    assert all(r["usage"][0] == n and 0 < r["usage"][1] <= MAX_TOKENS for n, r in rows.items()), rows
    assert agree == len(LENGTHS), rows
    cluster.idle(p, d)
