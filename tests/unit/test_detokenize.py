"""Streamed text deltas add up to exactly the decoded text, multi-byte characters included."""

from __future__ import annotations

import pytest

from node_agent.token_stream import IncrementalDetokenizer


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! Ünïcödé — 日本語のテキスト 🚀🎉 and a family 👩‍👩‍👧",
        "  leading spaces\n\nnew lines\ttabs and trailing space ",
        "The capital of France is Paris.",
    ],
)
def test_deltas_add_up(engines, text):
    adapter = engines["torch"]
    ids = adapter.encode(text) + [2]  # ends with <|im_end|>, which decodes to nothing
    inc = IncrementalDetokenizer(adapter)
    deltas = [inc.add(t) for t in ids]
    assert "".join(deltas) == adapter.detokenize(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_window_stays_short(engines):
    adapter = engines["torch"]
    inc = IncrementalDetokenizer(adapter)
    for t in adapter.encode("word " * 300):
        inc.add(t)
    assert len(inc.ids) - inc.prefix <= 4  # decoding cost does not grow with the answer
