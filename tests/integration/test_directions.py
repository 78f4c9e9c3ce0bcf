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

import functools

import pytest

from ..conftest import prompt, write_report
from .cluster import AGENTS, DIRECTIONS, for_each, pair_name

LENGTHS = [64, 65, 66, 128, 129, 130, 193]
STREAMED = 64  # the length asked streaming (the others whole)
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
    """Into a torch or MLX decoder every length goes at once, with the decoder alone's answers not
    yet asked (they decode a batch exactly as one request: tests/system/test_batching.py); into
    vLLM and SGLang one at a time."""
    client, pair = cluster.client, pair_name(p, d)

    def pd(n: int) -> dict:
        args = dict(model=pair, prompt=prompt(long_ids, n), max_tokens=MAX_TOKENS, temperature=0)
        if n == STREAMED:
            chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
            text, usage = "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage
        else:
            answer = client.completions.create(**args)
            text, usage = answer.choices[0].text, answer.usage
        return {"pd": text, "streamed": n == STREAMED, "usage": (usage.prompt_tokens, usage.completion_tokens)}

    asks = [(pd, n) for n in LENGTHS] + [(functools.partial(alone, d), n) for n in LENGTHS]
    answers = for_each(d, lambda ask: ask[0](ask[1]), asks)
    rows = dict(zip(LENGTHS, answers[: len(LENGTHS)], strict=True))
    for n, own in zip(LENGTHS, answers[len(LENGTHS) :], strict=True):
        rows[n]["alone_equal"] = rows[n]["pd"] == own
    write_report(f"direction_{pair}", rows)
    agree = sum(r["alone_equal"] for r in rows.values())
    print(f"\n{p}->{d}: greedy agreement with {d} alone {agree}/{len(LENGTHS)}")
    assert all(r["usage"][0] == n and 0 < r["usage"][1] <= MAX_TOKENS for n, r in rows.items()), rows
    assert agree == len(LENGTHS), rows
    cluster.idle(p, d)
