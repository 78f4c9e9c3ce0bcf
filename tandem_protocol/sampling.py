"""Sampling parameters: what a request may ask of an engine, and their bounds.

One pydantic model, declared once: an agent's routes take it as their body field (so a bad value
is a 400 naming the field and its bound, and the OpenAPI document states the bounds), and the
panel's OpenAI API builds it from an OpenAI request. Each edge that receives a request validates
it once. The in-process engines sample with `engine_adapters.sampler.Sampler`; the server engines
(vLLM, SGLang) are handed these fields under the same names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .grammar import json_schema_problem

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs (vLLM's default max_logprobs too)
MAX_LOGIT_BIAS = 300  # OpenAI's bound on logit_bias entries (each is added at every sampled token)

# Strict: a number must be a JSON number (no "0.5", no true); no NaN or infinity (Python's json,
# and so a lenient client, sends them, and no sampler can use them).
_Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]
_Int = Annotated[int, Field(strict=True)]
_TokenId = Annotated[int, Field(strict=True, ge=0)]
_Bias = Annotated[float, Field(strict=True, ge=-100, le=100, allow_inf_nan=False)]


class SamplingParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")  # an unknown field is refused, never dropped

    max_tokens: _Int = Field(16, ge=1)
    temperature: _Float = Field(0.0, ge=0)
    top_p: _Float = Field(1.0, gt=0, le=1)
    top_k: _Int = Field(0, ge=0, description="0: no top-k cut")
    # OpenAI documents seed as a signed 64-bit integer; engines get it as such (vLLM, SGLang)
    seed: _Int | None = Field(None, ge=-(2**63), lt=2**63)
    stop_token_ids: tuple[_Int, ...] = ()
    ignore_eos: Annotated[bool, Field(strict=True)] = False
    logit_bias: tuple[tuple[_TokenId, _Bias], ...] = Field(
        (),
        max_length=MAX_LOGIT_BIAS,
        description="(token id, bias) pairs added to the logits before sampling (OpenAI's -100..100, "
        f"at most {MAX_LOGIT_BIAS})",
    )
    json_schema: str | None = Field(
        None, description="the output is one JSON value valid against this JSON schema (its JSON text)"
    )
    logprobs: _Int | None = Field(
        None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="report each output token's log-probability and this many most likely alternatives "
        "(None: no log-probabilities)",
    )
    # Applied by the engines that run as servers (vLLM, SGLang), not by `Sampler`: an engine that
    # cannot apply one refuses the request (EngineAdapter.sampling).
    min_p: _Float = Field(0.0, ge=0, le=1)
    repetition_penalty: _Float = Field(
        1.0, gt=0, le=2, description="on prompt and output tokens (vLLM's and SGLang's meaning)"
    )
    presence_penalty: _Float = Field(0.0, ge=-2, le=2, description="on output tokens only")
    frequency_penalty: _Float = Field(0.0, ge=-2, le=2, description="on output tokens only")

    @field_validator("json_schema")
    @classmethod
    def _compiles(cls, schema: str | None) -> str | None:
        problem = None if schema is None else json_schema_problem(schema)
        if problem:
            raise ValueError(f"the JSON schema cannot constrain an output: {problem}")
        return schema

    def non_default(self) -> set[str]:
        """The fields this request sets away from their defaults (what an engine must honour)."""
        return {name for name, f in type(self).model_fields.items() if getattr(self, name) != f.default}

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# What `Sampler` applies, and the penalties that only look at output tokens (so they cannot
# change the first token, which an engine samples right after the prompt).
SAMPLER_FIELDS = frozenset(
    {
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop_token_ids",
        "ignore_eos",
        "logit_bias",
        "json_schema",
        "logprobs",
    }
)
OUTPUT_ONLY_FIELDS = frozenset({"presence_penalty", "frequency_penalty"})

ALL_FIELDS = frozenset(SamplingParams.model_fields)
# the parameters only the server engines apply, passed to them under these same names
SERVER_FIELDS = tuple(name for name in SamplingParams.model_fields if name not in SAMPLER_FIELDS)


@dataclass(frozen=True)
class TokenLogprobs:
    """One output token's log-probability under the model's own distribution (the raw logits'
    log-softmax, before temperature or any cut: vLLM's default and OpenAI's meaning) and the
    `SamplingParams.logprobs` most likely tokens, most likely first, as (token id, logprob)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def to_json(self) -> list:
        return [self.logprob, [list(t) for t in self.top]]

    @classmethod
    def from_json(cls, obj: list) -> TokenLogprobs:
        logprob, top = obj
        return cls(float(logprob), tuple((int(t), float(lp)) for t, lp in top))
