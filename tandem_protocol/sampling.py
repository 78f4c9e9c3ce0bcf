"""Sampling parameters: what a request may ask of an engine, and their bounds.

The in-process engines sample with `engine_adapters.sampler.Sampler`; the server engines (vLLM,
SGLang) are handed these fields under the same names.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields

from .errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    # Applied by the engines that run as servers (vLLM, SGLang), not by `Sampler` below: an
    # engine that cannot apply one refuses the request (EngineAdapter.sampling).
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # on prompt and output tokens (vLLM's and SGLang's meaning)
    presence_penalty: float = 0.0  # on output tokens only
    frequency_penalty: float = 0.0  # on output tokens only

    def non_default(self) -> set[str]:
        """The fields this request sets away from their defaults (what an engine must honour)."""
        return non_default_fields({f.name: getattr(self, f.name) for f in fields(self)})

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            problems.append(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _finite(self.temperature) or self.temperature < 0:
            problems.append(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            problems.append(f"top_k must be an integer >= 0, got {self.top_k!r}")
        # OpenAI documents seed as a signed 64-bit integer; engines get it as such (vLLM, SGLang)
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**63):
            problems.append(f"seed must be an integer in -2**63..2**63-1, got {self.seed!r}")
        if not _finite(self.min_p) or not 0 <= self.min_p <= 1:
            problems.append(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _finite(self.repetition_penalty) or not 0 < self.repetition_penalty <= 2:
            problems.append(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _finite(value) or not -2 <= value <= 2:
                problems.append(f"{name} must be in [-2, 2], got {value!r}")
        if problems:
            raise RequestError("; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


# What `Sampler` applies, and the penalties that only look at output tokens (so they cannot
# change the first token, which an engine samples right after the prompt).
SAMPLER_FIELDS = frozenset({"max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos"})
OUTPUT_ONLY_FIELDS = frozenset({"presence_penalty", "frequency_penalty"})

ALL_FIELDS = frozenset(f.name for f in fields(SamplingParams))
# the parameters only the server engines apply, passed to them under these same names
SERVER_FIELDS = tuple(f.name for f in fields(SamplingParams) if f.name not in SAMPLER_FIELDS)

_DEFAULTS = {
    f.name: (f.default_factory() if f.default_factory is not MISSING else f.default) for f in fields(SamplingParams)
}


def non_default_fields(sampling: dict) -> set[str]:
    """The fields a sampling dict sets away from their defaults (SamplingParams.non_default, and
    the panel's router, which holds the dict and refuses before anything is scheduled)."""
    return {
        name
        for name, value in sampling.items()
        if name in _DEFAULTS and value != _DEFAULTS[name] and not (name == "stop_token_ids" and not value)
    }
