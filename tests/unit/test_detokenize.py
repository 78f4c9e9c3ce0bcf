"""Streamed text deltas add up to exactly the decoded text, multi-byte characters included."""

from __future__ import annotations

import pytest

from node_agent.token_stream import IncrementalDetokenizer

from .cost import cpu_seconds


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


# (token, its text alone): a byte-level BPE vocabulary (GPT-2's, SmolLM2's) spells byte 0xE6,
# which begins a 3-byte character, "æ"; <|im_end|> is a special token, which decodes to nothing.
NO_TEXT = {"a character's first byte": ("æ", "\ufffd"), "a special token": ("<|im_end|>", "")}


@pytest.mark.parametrize("what", NO_TEXT)
def test_tokens_that_add_no_text_cost_linear_time(engines, what):
    """The attack (issue 43, L11): an answer steered (logit_bias, ignore_eos) to a token that leaves
    the text ending in a partial character, or adds none, again and again. The old detokenizer
    never moved its window then, so each token decoded all the earlier ones again: 8x the tokens
    cost 45x. Now the window moves on after a few (a character is at most 4 bytes): ~8x (measured
    on a loaded 2-core machine: 2,000 tokens in ~25 ms of CPU), and the deltas still add up to the
    text of the tokens they stand for (U+FFFD for bytes that make no character)."""
    adapter = engines["torch"]
    piece, alone = NO_TEXT[what]
    token = adapter.tokenizer.convert_tokens_to_ids(piece)
    assert adapter.detokenize([token]) == alone

    def detokenizing(tokens: int) -> tuple[float, IncrementalDetokenizer, list[str]]:
        inc, deltas = IncrementalDetokenizer(adapter), []
        return cpu_seconds(lambda: deltas.extend(inc.add(token) for _ in range(tokens))), inc, deltas

    small = large = float("inf")
    for _ in range(5):  # in turn: whatever slows the machine for a while weighs on both
        small = min(small, detokenizing(250)[0])
        cost, inc, deltas = detokenizing(2000)
        large = min(large, cost)
    assert large < 0.25 and large / small < 16, (small, large)
    assert "".join(deltas) == adapter.detokenize(inc.ids[: inc.read]) and len(inc.ids) - inc.read < 8


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


def test_a_schema_holds_whatever_the_model_says(engines):
    """Random logits at every step, greedy or sampled, under a JSON schema: the output is always
    one JSON value valid against it, ended by a stop token; a sampler continuing after another
    engine's first token (skip) keeps to the same grammar."""
    import json

    import numpy as np

    from engine_adapters.sampler import Sampler
    from tandem_protocol.sampling import SamplingParams

    adapter = engines["torch"]
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    vocab = adapter.info.vocab_size
    for seed in range(12):
        params = SamplingParams(json_schema=json.dumps(schema), temperature=float(seed % 2), seed=seed)
        rng = np.random.default_rng(seed)
        sampler, out = Sampler(params, None, adapter.grammar_tokenizer), []
        while not out or out[-1] not in adapter.eos_token_ids:
            out.append(sampler(rng.standard_normal(vocab).astype(np.float32) * 5))
            assert len(out) < 200, adapter.detokenize(out)
        value = json.loads(adapter.detokenize(out[:-1]))
        assert set(value) == {"name", "n"} and len(value["name"]) <= 8 and 0 <= value["n"] <= 9, value
    # the first token a fresh sampler opens the object with, then logits that want it above all:
    # a fresh sampler picks it again; one that skipped another engine's pick of it is past it,
    # where it cannot come again
    params = SamplingParams(json_schema=json.dumps(schema))
    first = Sampler(params, None, adapter.grammar_tokenizer)(np.zeros(vocab, np.float32))
    assert adapter.detokenize([first]).startswith("{")
    logits = np.zeros(vocab, np.float32)
    logits[first] = 100
    assert Sampler(params, None, adapter.grammar_tokenizer)(logits) == first
    continued = Sampler(params, None, adapter.grammar_tokenizer)
    continued.skip(first)
    assert continued(logits) != first
