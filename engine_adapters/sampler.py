"""One sampler shared by every in-process engine (torch, MLX).

Sampling runs in numpy on the final-position logits, so torch and MLX pick tokens the same way.
Each sampled token consumes exactly one uniform draw from the request's generator, so a decoder
that continues after a prefiller's first token can skip that draw and stay on the same random
sequence as a single-engine run with the same seed.
"""

from __future__ import annotations

import numpy as np

from tandem_protocol.sampling import SamplingParams


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        # numpy seeds are non-negative: a negative seed (OpenAI allows them) is taken modulo 2**64
        self._rng = np.random.default_rng(None if params.seed is None else params.seed % 2**64)

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
