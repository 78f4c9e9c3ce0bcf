"""The readers an answer's text goes through on the panel, as it streams (tool calls, a reasoning
block), cost time linear in it (issue 43): each answer text below cost quadratic or cubic time
before (measured on a loaded 2-core machine: 200 distinct calls 48 s, 800 items of a forced call
4.2 s, 4,000 spaces inside a call's block 0.15 s, 32,000 newlines before anything 0.37 s)."""

from __future__ import annotations

import pytest

from control_panel.api.reasoning import ReasoningText
from control_panel.api.tool_calls import ToolCallText
from tandem_protocol.tools import parse_calls

from .cost import cpu_seconds

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def calls(n: int) -> list[str]:
    """n distinct calls, as a model's tokens give them."""
    return [t for i in range(n) for t in ("<tool_call>", f'{{"name": "f", "arguments": {{"i": {i}}}}}', "</tool_call>")]


def items(n: int) -> list[str]:
    """A forced call's array of n distinct items, as a model's tokens give it."""
    return ["["] + [f'{{"name": "f", "parameters": {{"i": {i}}}}},' for i in range(n)]


ANSWERS = {  # what reads it, and its tokens at a size n
    "distinct calls": (lambda: ToolCallText(TOOLS, "auto", False), calls, 100),
    "a forced call's items": (lambda: ToolCallText(TOOLS, "required", True), items, 400),
    "newlines before anything": (lambda: ReasoningText(False), lambda n: ["\n"] * n, 8000),
}


@pytest.mark.parametrize("answer", ANSWERS)
def test_an_answer_s_readers_cost_linear_time(answer):
    reader, tokens, n = ANSWERS[answer]

    def reading(size: int) -> float:
        read, given = reader(), tokens(size)
        return cpu_seconds(lambda: [read.feed(t) for t in given])

    assert reading(n) < 0.5  # once first: the old readers fail here, before the 8x size
    small = large = float("inf")
    for _ in range(5):  # in turn: whatever slows the machine for a while weighs on both
        small, large = min(small, reading(n)), min(large, reading(8 * n))
    assert large < 0.5 and large / small < 16, (small, large)


def test_a_call_s_block_of_whitespace_is_read_in_linear_time():
    def parse(spaces: int) -> float:
        return cpu_seconds(lambda: parse_calls("<tool_call>x" + " " * spaces + "y", TOOLS))

    assert parse(8192) < 0.05  # the old pattern: ~0.6 s
    small = large = float("inf")
    for _ in range(5):
        small, large = min(small, parse(8192)), min(large, parse(65536))
    assert large < 0.05 and large / small < 16, (small, large)
