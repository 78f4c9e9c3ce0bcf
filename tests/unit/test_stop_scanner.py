"""Stop strings cut an answer as it streams (control_panel/api/answer.py, `StopScanner`): the text up
to the first stop string goes out, and only what could still become one is held back, at a cost
linear in the answer however long the stop strings (issue 43, L12)."""

from __future__ import annotations

import random

from control_panel.api.answer import StopScanner

from .cost import cpu_seconds


def held_back(text: str, stops: list[str]) -> int:
    """How much of the end of `text` could begin a stop string."""
    return max((n for stop in stops for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)


def cut(text: str, stops: list[str]) -> str | None:
    """`text` up to the stop string that ends first in it (the longest of those), None if none does."""
    ends = [(text.find(s) + len(s), -len(s)) for s in stops if s in text]
    if not ends:
        return None
    end, length = min(ends)
    return text[: end + length]


def test_the_text_goes_out_up_to_the_first_stop_string_holding_back_only_what_may_begin_one():
    rng = random.Random(43)
    for _ in range(3000):
        stops = ["".join(rng.choices("ab", k=rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
        text = "".join(rng.choices("abc", k=rng.randint(0, 40)))
        pieces, at = [], 0
        while at < len(text):  # tokens of 1 to 4 characters
            pieces.append(text[at : at + rng.randint(1, 4)])
            at += len(pieces[-1])
        scanner, out, seen = StopScanner(stops), "", ""
        for piece in pieces:
            out += scanner.feed(piece)
            seen += piece
            if scanner.hit:
                assert out == cut(seen, stops) and cut(seen[: -len(piece)], stops) is None, (stops, pieces)
                break
            assert out == seen[: len(seen) - held_back(seen, stops)], (stops, pieces)
        else:
            assert cut(text, stops) is None and out + scanner.flush() == text, (stops, pieces)


def test_a_stop_string_as_long_as_the_answer_costs_linear_time():
    """The attack: a stop string as long as an answer, which the answer begins (`logit_bias` can
    steer it there), so that all of it could still become one. The old scanner copied and searched
    everything it held at every token: 8x the tokens cost 30-33x its CPU time (measured on a loaded
    2-core machine; 64x in the limit). Now 7.4-7.7x, and 4,096 tokens of 64 characters take 5 ms
    of CPU (the stop string's set-up, linear in its length, is not timed)."""
    token, stop = "=" * 64, "=" * (64 * 4096) + "!"

    def feeding(tokens: int) -> float:
        scanner = StopScanner([stop])
        return cpu_seconds(lambda: [scanner.feed(token) for _ in range(tokens)])

    small = large = float("inf")
    for _ in range(5):  # in turn: whatever slows the machine for a while weighs on both
        small, large = min(small, feeding(512)), min(large, feeding(4096))
    assert large < 0.1 and large / small < 16, (small, large)
