"""Sampling parameters and one sampler shared by every in-process engine.

Sampling runs in numpy on the final-position logits, so torch and MLX pick tokens the same way.
Each sampled token consumes exactly one uniform draw from the request's generator, so a decoder
that continues after a prefiller's first token can skip that draw and stay on the same random
sequence as a single-engine run with the same seed.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields

import numpy as np

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

    def non_default(self) -> set[str]:
        """The fields this request sets away from their defaults (what an engine must honour)."""
        return {f.name for f in fields(self) if getattr(self, f.name) != _DEFAULTS[f.name]}

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
        if problems:
            raise RequestError("; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    def skip(self) -> None:
        """Consume the draw of a token that another engine sampled."""
        self._rng.random()

    def __call__(self, logits: np.ndarray) -> int:
        u = self._rng.random()
        p = self.params
        if p.greedy:
            return int(np.argmax(logits))
        x = logits.astype(np.float64) / p.temperature
        order = np.argsort(-x, kind="stable")
        if p.top_k:
            order = order[: p.top_k]
        x = x[order]
        probs = np.exp(x - x[0])
        probs /= probs.sum()
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
            probs = probs[:keep] / probs[:keep].sum()
        idx = min(int(np.searchsorted(np.cumsum(probs), u, side="right")), len(probs) - 1)
        return int(order[idx])


_DEFAULTS = {f.name: (f.default_factory() if f.default_factory is not MISSING else f.default)
             for f in fields(SamplingParams)}
