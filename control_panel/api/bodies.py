"""The request bodies of /v1/chat/completions and /v1/completions, and what is checked in them
before any agent is asked anything."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tandem_protocol.sampling import SERVER_FIELDS, SamplingParams

from .errors import OpenAIError


class StreamOptions(BaseModel):
    include_usage: bool = False


# The sampling parameters an OpenAI request may carry, under SamplingParams' names: OpenAI's own
# and the extensions vLLM and others accept (top_k, min_p, repetition_penalty). Their bounds are
# SamplingParams', checked once when the request is mapped onto it.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "ignore_eos", *SERVER_FIELDS)
OPENAI_TEMPERATURE = 1.0  # OpenAI's default (Tandem's own is greedy)
DEFAULT_MAX_TOKENS = 256


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None

    # parameters OpenAI defines that Tandem does not implement: refused, never silently ignored
    UNSUPPORTED: ClassVar[tuple[str, ...]] = (
        "logprobs",
        "top_logprobs",
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "logit_bias",
        "response_format",
        "echo",
        "suffix",
        "best_of",
        "parallel_tool_calls",
        "audio",
        "modalities",
        "prediction",
    )

    def check(self) -> None:
        if self.n != 1:
            raise OpenAIError(400, "n must be 1: Tandem returns one choice per request", param="n")
        extra = self.model_extra or {}
        for name in self.UNSUPPORTED:
            value = extra.get(name)
            if value not in (None, False, 0, "text", {"type": "text"}) and not (name == "best_of" and value == 1):
                raise OpenAIError(400, f"the parameter `{name}` is not supported by Tandem", param=name)
        unknown = set(extra) - set(self.UNSUPPORTED) - set(SAMPLING_FIELDS) - {"metadata", "store"}
        if unknown:
            raise OpenAIError(400, f"unknown parameter(s): {', '.join(sorted(unknown))}", param=sorted(unknown)[0])

    def sampling(self) -> SamplingParams:
        """The request's sampling, validated: a bad value is a 400 naming the parameter and its bound."""
        extra = self.model_extra or {}
        given = {name: extra[name] for name in SAMPLING_FIELDS if extra.get(name) is not None}
        max_name = "max_tokens" if self.max_tokens is not None else "max_completion_tokens"
        max_tokens = self.max_tokens if self.max_tokens is not None else self.max_completion_tokens
        try:
            return SamplingParams(
                **{
                    "temperature": OPENAI_TEMPERATURE,
                    **given,
                    "max_tokens": DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
                }
            )
        except ValidationError as e:
            error = e.errors()[0]
            name = str(error["loc"][0]) if error["loc"] else "sampling"
            name = max_name if name == "max_tokens" else name
            value = max_tokens if name == max_name else given.get(name)
            raise OpenAIError(400, f"`{name}`: {error['msg']} (got {value!r})", param=name) from None

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatBody(_Common):
    messages: list[dict[str, Any]] = Field(min_length=1)

    def check(self) -> None:
        super().check()
        self.messages = [text_message(i, m) for i, m in enumerate(self.messages)]


def text_message(index: int, message: dict[str, Any]) -> dict[str, Any]:
    """A message whose `content` is an array of parts (OpenAI's format, which vLLM's and OpenAI's
    own clients send) as the one string a chat template renders: its text parts joined by
    newlines, as vLLM joins them. Any other part (an image, audio, a file) is refused by name."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise OpenAIError(
                400,
                f"messages[{index}].content: a part of type `{kind}` is not supported: Tandem takes text parts only",
                param="messages",
            )
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}


class CompletionBody(_Common):
    prompt: str | list[str] | list[int]
