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


def test_each_tokens_bytes_join_into_the_text_even_inside_a_character(engines):
    """Log-probability entries show tokens one by one: a token that is part of a character decodes
    to U+FFFD alone, yet its bytes are its own, so the entries' bytes spell the answer exactly."""
    adapter = engines["torch"]
    text = "Ünïcödé — 日本語 🚀🎉 👩‍👩‍👧 and Paris."
    ids = adapter.encode(text)
    pieces = adapter.token_pieces([*ids, 2])
    assert b"".join(raw for _, raw in pieces[:-1]).decode() == text
    assert any(t == "\ufffd" for t, _ in pieces)  # the case this is for does occur in this text
    assert pieces[-1] == ("<|im_end|>", b"<|im_end|>")  # a special token shows as itself
    assert [t for t, _ in adapter.token_pieces(adapter.encode(" Paris"))] == [" Paris"]
