"""What a handoff is, on both sides: the first-token modes, how much KV moves, what a prefill reports."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .errors import RequestError
from .sampling import TokenLogprobs


class FirstTokenMode(str, Enum):
    RECOMPUTE_LAST = "recompute-last"
    COMMIT_FIRST = "commit-first"


def kv_tokens(prompt_tokens: int, mode: FirstTokenMode) -> int:
    """How many prompt tokens of KV move from prefiller to decoder in `mode`."""
    if mode is FirstTokenMode.RECOMPUTE_LAST:
        if prompt_tokens < 2:
            raise RequestError(
                "recompute-last mode needs a prompt of at least 2 tokens: the decoder recomputes the "
                "last prompt token, so a 1-token prompt leaves no KV to transfer (use commit-first)"
            )
        return prompt_tokens - 1
    return prompt_tokens


@dataclass
class PrefillDone:
    first_token: int
    kv_tokens: int
    pages: int
    prefill_seconds: float
    finished_at: float = 0.0  # wall-clock time.time() when prefill finished (for overlap timelines)
    cached_tokens: int = 0  # prompt tokens the prefiller took from its prefix cache instead of computing
    first_logprobs: TokenLogprobs | None = None  # the first token's, when the request asked for them
