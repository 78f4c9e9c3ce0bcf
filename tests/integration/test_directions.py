"""Every direction through the panel's OpenAI API: at each of the core issue's prompt lengths (around
page boundaries) the P/D completion equals the decoder alone (the decoder's node through the same
panel), and streaming equals not streaming; chat, streaming and not, answers "Paris"."""

from __future__ import annotations

import functools

import pytest

from ..agents import complete
from ..conftest import prompt, write_report
from .cluster import DIRECTIONS, pair_name

LENGTHS = [64, 65, 66, 128, 129, 130, 193]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def alone(cluster, long_ids):
    """The decoder's own answer at a length, asked once per decoder and length."""
    return functools.cache(lambda decoder, n: cluster.alone(decoder, prompt(long_ids, n)))


@pytest.mark.parametrize("p, d", DIRECTIONS, ids=[pair_name(*x) for x in DIRECTIONS])
def test_pd_equals_the_decoder_alone_at_every_length(cluster, long_ids, alone, p, d):
    client, pair, rows = cluster.client, pair_name(p, d), {}
    for n in LENGTHS:
        ids = prompt(long_ids, n)
        whole, streamed = complete(client, pair, ids, False), complete(client, pair, ids, True)
        rows[n] = {"pd": whole, "streamed_equal": streamed == whole, "alone_equal": whole == alone(d, n)}
    write_report(f"direction_{pair}", rows)
    agree = sum(r["alone_equal"] for r in rows.values())
    print(f"\n{p}->{d}: greedy agreement with {d} alone {agree}/{len(LENGTHS)}")
    assert all(r["streamed_equal"] for r in rows.values()), rows
    assert agree == len(LENGTHS), rows
    cluster.idle(p, d)


@pytest.mark.parametrize("p, d", DIRECTIONS, ids=[pair_name(*x) for x in DIRECTIONS])
def test_chat_answers_paris_streaming_or_not(cluster, p, d):
    client, pair = cluster.client, pair_name(p, d)
    whole = client.chat.completions.create(model=pair, messages=QUESTION, max_tokens=20, temperature=0)
    chunks = client.chat.completions.create(model=pair, messages=QUESTION, max_tokens=20, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert "Paris" in text, text
