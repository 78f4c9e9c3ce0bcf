"""Reasoning models: the block a thinking template (Qwen3, DeepSeek-R1 and their kind) wraps a
model's reasoning in. A template may open it in the prompt itself (the answer then begins as
reasoning); a model may open it as its answer's first words. What is inside goes to
`reasoning_content`, never to `content`."""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def opens_reasoning(prompt: str) -> bool:
    """Whether the rendered prompt leaves a reasoning block open for the answer."""
    return prompt.rfind(OPEN) > prompt.rfind(CLOSE)
