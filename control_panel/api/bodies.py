"""The request bodies of /v1/chat/completions and /v1/completions, and what is checked in them
before any agent is asked anything."""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tandem_protocol.grammar import ANY_JSON_OBJECT, json_schema_problem
from tandem_protocol.sampling import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SERVER_FIELDS, SamplingParams
from tandem_protocol.template_switches import TemplateSwitchError, check_template_switches
from tandem_protocol.tools import forced_schema

from .errors import OpenAIError


class StreamOptions(BaseModel):
    include_usage: bool = False


# The sampling parameters an OpenAI request may carry, under SamplingParams' names: OpenAI's own
# and the extensions vLLM and others accept (top_k, min_p, repetition_penalty). Their bounds are
# SamplingParams', checked once when the request is mapped onto it.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "ignore_eos", *SERVER_FIELDS)
OPENAI_TEMPERATURE = 1.0  # OpenAI's default (Tandem's own is greedy)
DEFAULT_MAX_TOKENS = 256
MAX_STOPS = 4  # OpenAI's bound on stop strings
# A stop string's length: the answer holds back up to that much text of each choice, and matches
# it as the text streams (control_panel/api/answer.py); a stop string is a word or a marker
MAX_STOP_CHARS = 256
MAX_CHOICES = 16  # `n`: each choice is a request on the route (control_panel/api/choices.py)


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
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None

    # parameters OpenAI defines that Tandem does not implement: refused, never silently ignored
    UNSUPPORTED: ClassVar[tuple[str, ...]] = (
        "functions",
        "function_call",
        "echo",
        "suffix",
        "best_of",
        "audio",
        "modalities",
        "prediction",
    )

    def check(self) -> None:
        if not 1 <= self.n <= MAX_CHOICES:
            raise OpenAIError(400, f"`n`: 1 to {MAX_CHOICES} choices (got {self.n})", param="n")
        if len(self.stops) > MAX_STOPS:
            raise OpenAIError(400, f"`stop`: at most {MAX_STOPS} stop strings (got {len(self.stops)})", param="stop")
        longest = max(map(len, self.stops), default=0)
        if longest > MAX_STOP_CHARS:
            raise OpenAIError(
                400, f"`stop`: a stop string has at most {MAX_STOP_CHARS} characters (got {longest})", param="stop"
            )
        if self.logit_bias is not None and len(self.logit_bias) > MAX_LOGIT_BIAS:  # OpenAI's 300
            raise OpenAIError(
                400,
                f"`logit_bias`: at most {MAX_LOGIT_BIAS} entries (got {len(self.logit_bias)})",
                param="logit_bias",
            )
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
        if self.logit_bias:  # OpenAI's keys are token ids as strings
            try:
                given["logit_bias"] = tuple((int(token), bias) for token, bias in self.logit_bias.items())
            except ValueError:
                raise OpenAIError(400, "`logit_bias`: its keys must be token ids", param="logit_bias") from None
        schema = self.json_schema()
        if schema is not None:
            given["json_schema"] = schema
        logprobs_name, logprobs = self.logprobs_asked()
        if logprobs is not None:
            given["logprobs"] = logprobs
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
            if name == "json_schema":
                raise OpenAIError(400, f"`response_format`: {error['msg']}", param="response_format") from None
            name = {"max_tokens": max_name, "logprobs": logprobs_name}.get(name, name)
            value = max_tokens if name == max_name else logprobs if name == logprobs_name else given.get(name)
            raise OpenAIError(400, f"`{name}`: {error['msg']} (got {value!r})", param=name) from None

    def json_schema(self) -> str | None:
        """The JSON schema `response_format` holds the output to, as JSON text (OpenAI's
        `json_object`: any JSON object), or None for free text."""
        fmt = self.response_format
        kind = None if fmt is None else fmt.get("type")
        if kind in (None, "text"):
            return None
        if kind == "json_object":
            return ANY_JSON_OBJECT
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise OpenAIError(
                    400, "`response_format`: json_schema.schema must be a JSON schema object", param="response_format"
                )
            return json.dumps(spec["schema"])
        raise OpenAIError(
            400,
            f"`response_format`: type must be text, json_object or json_schema (got {kind!r})",
            param="response_format",
        )

    def logprobs_asked(self) -> tuple[str, int | None]:
        """How many alternatives to each token's log-probability the request asks for (None: no
        log-probabilities), and the parameter that says so."""
        raise NotImplementedError

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatBody(_Common):
    messages: list[dict[str, Any]] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: passed to the template (enable_thinking)

    @property
    def tool_mode(self) -> str | None:
        """None (no tools, or `tool_choice` "none"), "auto" (the model may call: calls are read
        out of its text) or "forced" ("required" or a named function: the output is the calls)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return "auto" if self.tool_choice in (None, "auto") else "forced"

    def json_schema(self) -> str | None:
        if self.tool_mode != "forced":
            return super().json_schema()
        if super().json_schema() is not None:
            raise OpenAIError(
                400, "`response_format` and a forced tool call cannot both shape the output", param="response_format"
            )
        return json.dumps(forced_schema(self.tools, self.tool_choice, self.parallel_tool_calls))

    def logprobs_asked(self) -> tuple[str, int | None]:
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError(400, "`top_logprobs` needs `logprobs` set to true", param="top_logprobs")
        return "top_logprobs", (self.top_logprobs or 0) if self.logprobs else None

    def check(self) -> None:
        super().check()
        check_template_kwargs(self.chat_template_kwargs)
        self.messages = [text_message(i, m) for i, m in enumerate(self.messages)]
        check_tools(self.tools, self.tool_choice)
        check_tool_messages(self.messages)


def checked_sampling(body) -> SamplingParams:
    """`body.check()`, then its sampling parameters (a 400 if any is refused). Run in a thread
    (`asyncio.to_thread`): checking tools and a JSON schema compiles each schema (llguidance,
    ~0.1-0.4 s for a 0.2 MB one), which would hold every other request of the panel."""
    body.check()
    return body.sampling()


def check_template_kwargs(kwargs: dict | None) -> None:
    """Only a template's switches, with scalar values (tandem_protocol/template_switches.py): a
    template of the client's choosing never reaches an agent."""
    try:
        check_template_switches(kwargs)
    except TemplateSwitchError as e:
        raise OpenAIError(400, str(e), param="chat_template_kwargs") from None


_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128  # OpenAI's bound on the tools of one request (each schema is compiled to check it)


def check_tools(tools: list[dict] | None, choice: str | dict | None) -> None:
    """Each tool a function with a valid name and an arguments schema that can constrain an
    output; `tool_choice` one of OpenAI's, naming an offered function."""
    if tools is not None and len(tools) > MAX_TOOLS:
        raise OpenAIError(400, f"`tools`: at most {MAX_TOOLS} tools (got {len(tools)})", param="tools")
    names = set()
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not _TOOL_NAME.match(fn["name"]):
            raise OpenAIError(
                400,
                f"tools[{i}]: a tool is {{type: function, function: {{name: [A-Za-z0-9_-]{{1,64}}, ...}}}}",
                param="tools",
            )
        if fn["name"] in names:
            raise OpenAIError(400, f"tools[{i}]: the function name {fn['name']!r} is given twice", param="tools")
        names.add(fn["name"])
        params = fn.get("parameters")
        problem = (
            "parameters must be a JSON schema object" if params is not None and not isinstance(params, dict) else None
        )
        problem = problem or (json_schema_problem(json.dumps(params)) if params else None)
        if problem:
            raise OpenAIError(400, f"tools[{i}] ({fn['name']}): {problem}", param="tools")
    if choice in (None, "none"):
        return
    if not tools:
        raise OpenAIError(400, "`tool_choice` needs `tools`", param="tool_choice")
    if choice in ("auto", "required"):
        return
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and name in names):
        raise OpenAIError(
            400,
            "`tool_choice` must be none, auto, required or {type: function, function: {name}} naming one of `tools`"
            f" (got {choice!r})",
            param="tool_choice",
        )


def check_tool_messages(messages: list[dict]) -> None:
    """A `tool` message answers a call an earlier assistant message made (by its tool_call_id)."""
    calls = set()
    for i, m in enumerate(messages):
        made = m.get("tool_calls") if m.get("role") == "assistant" else None
        if made is not None and not isinstance(made, list):
            raise OpenAIError(400, f"messages[{i}].tool_calls must be a list", param="messages")
        for call in made or []:
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise OpenAIError(400, f"messages[{i}].tool_calls: each call needs function.name", param="messages")
            if isinstance(call.get("id"), str):
                calls.add(call["id"])
        if m.get("role") == "tool" and not (isinstance(m.get("tool_call_id"), str) and m["tool_call_id"] in calls):
            raise OpenAIError(
                400,
                f"messages[{i}]: a `tool` message must answer a call an earlier assistant message made "
                f"(no call has tool_call_id {m.get('tool_call_id')!r})",
                param="messages",
            )


def text_message(index: int, message: dict[str, Any]) -> dict[str, Any]:
    """A message whose `content` is an array of parts (OpenAI's format, which vLLM's and OpenAI's
    own clients send) as the one string a chat template renders (`parts_text`)."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    return {**message, "content": parts_text(f"messages[{index}].content", content, ("text",), "image_url", "messages")}


def parts_text(where: str, parts: list, text_kinds: tuple[str, ...], image_kind: str, param: str) -> str:
    """Content parts as one string: their text parts joined by newlines, as vLLM joins them. Any
    other part (an image, audio, a file) is refused by name."""
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind == image_kind:
            raise OpenAIError(
                400, f"{where}: an `{kind}` part needs a model with vision; this model reads text only", param=param
            )
        if kind not in text_kinds or not isinstance(part.get("text"), str):
            raise OpenAIError(
                400, f"{where}: a part of type `{kind}` is not supported: Tandem takes text parts only", param=param
            )
        texts.append(part["text"])
    return "\n".join(texts)


class CompletionBody(_Common):
    prompt: str | list[str] | list[int]
    logprobs: int | None = Field(None, description=f"0..{MAX_TOP_LOGPROBS} alternatives per token (OpenAI's: 0..5)")

    def logprobs_asked(self) -> tuple[str, int | None]:
        return "logprobs", self.logprobs
