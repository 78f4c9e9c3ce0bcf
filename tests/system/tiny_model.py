"""A tiny random-weight Llama for the agents of system tests whose assertions hold whatever the
weights: no text, no calibrated tolerance, no timing of the model's own compute."""

from __future__ import annotations

from pathlib import Path

from ..conftest import TINY_LLAMA, make_tiny_checkpoint


def tiny_model(folder: Path, smol_dir: Path) -> Path:
    """TINY_LLAMA with SmolLM2's tokenizer and chat template (tests/conftest.py) as a checkpoint an
    agent serves: a token costs 4 layers of one KV head, not SmolLM2's 30 of 3, and the agent loads
    and calibrates it in a moment. Seeded: the same weights, so the same answers, every run."""
    return make_tiny_checkpoint(folder, "llama", smol_dir, seed=5, max_position_embeddings=2048, **TINY_LLAMA)
