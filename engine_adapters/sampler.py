"""One sampler shared by every in-process engine (torch, MLX).

Sampling runs in numpy on the final-position logits, so torch and MLX pick tokens the same way.
Each sampled token consumes exactly one uniform draw from the request's generator, so a decoder
that continues after a prefiller's first token can skip that draw and stay on the same random
sequence as a single-engine run with the same seed. A request that asks for log-probabilities
gets each sampled token's, from the same logits, in the list it hands the sampler.
"""

from __future__ import annotations

import llguidance
import llguidance.numpy
import numpy as np

from tandem_protocol.errors import RequestError
from tandem_protocol.grammar import json_schema_grammar
from tandem_protocol.sampling import SamplingParams, TokenLogprobs


class Sampler:
    def __init__(self, params: SamplingParams, logprobs: list[TokenLogprobs] | None = None, grammar_tokenizer=None):
        """`logprobs`: where each sampled token's TokenLogprobs is appended, when `params.logprobs`
        asks for them (the request's list: its stream reads them as its tokens come out).
        `grammar_tokenizer`: the model's llguidance tokenizer, needed when `params.json_schema`
        constrains the output (`EngineAdapter.grammar_tokenizer`)."""
        self.params = params
        self.logprobs = logprobs if params.logprobs is not None else None
        self.matcher = None
        if params.json_schema is not None:
            self.matcher = llguidance.LLMatcher(grammar_tokenizer, json_schema_grammar(params.json_schema))
            self._mask = llguidance.numpy.allocate_token_bitmask(1, grammar_tokenizer.vocab_size)
            self._consume_failed()
        # the bias added in one vectorized step per token (OpenAI allows 300 entries)
        ids, bias = zip(*params.logit_bias) if params.logit_bias else ((), ())
        self._bias_ids, self._bias = np.array(ids, dtype=np.int64), np.array(bias, dtype=np.float32)
        # numpy seeds are non-negative: a negative seed (OpenAI allows them) is taken modulo 2**64
        self._rng = np.random.default_rng(None if params.seed is None else params.seed % 2**64)

    def skip(self, token: int) -> None:
        """Consume the draw of `token`, which another engine sampled (a prefiller's first), and
        move the grammar past it."""
        self._rng.random()
        self._advance(token)

    def __call__(self, logits: np.ndarray) -> int:
        token = self._sample(logits if self.matcher is None else self._allowed(logits))
        if self.logprobs is not None:  # the model's own distribution, before the grammar's cut
            self.logprobs.append(token_logprobs(logits, token, self.params.logprobs))
        self._advance(token)
        return token

    def _advance(self, token: int) -> None:
        """Move the grammar, if any, past `token`."""
        if self.matcher is not None:
            self.matcher.consume_token(token)
            self._consume_failed()

    def _allowed(self, logits: np.ndarray) -> np.ndarray:
        """The logits with every token the grammar forbids next at -inf."""
        llguidance.numpy.fill_next_token_bitmask(self.matcher, self._mask)
        keep = np.flatnonzero(np.unpackbits(self._mask.view(np.uint8), bitorder="little")[: len(logits)])
        allowed = np.full(len(logits), -np.inf, dtype=np.float32)
        allowed[keep] = logits[keep]
        return allowed

    def _consume_failed(self) -> None:
        if self.matcher.is_error():
            raise RequestError(f"the output cannot follow the JSON schema: {self.matcher.get_error()}")

    def _sample(self, logits: np.ndarray) -> int:
        u = self._rng.random()
        p = self.params
        if p.logit_bias:
            logits = logits.copy()
            np.add.at(logits, self._bias_ids, self._bias)
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


def token_logprobs(logits: np.ndarray, token: int, top: int) -> TokenLogprobs:
    """`token`'s log-probability under the raw logits, and the `top` most likely tokens'."""
    x = logits.astype(np.float64)
    x = x - x.max()
    logp = x - np.log(np.exp(x).sum())
    best = np.argpartition(-logp, top)[:top] if 0 < top < len(logp) else np.arange(len(logp) if top else 0)
    best = best[np.argsort(-logp[best], kind="stable")]
    return TokenLogprobs(float(logp[token]), tuple((int(t), float(logp[t])) for t in best))
