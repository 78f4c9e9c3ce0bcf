"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}.

A Responses request runs as a chat completion (`ResponsesBody.chat_body`): its `input` items
become chat messages (messages, function calls and their outputs; earlier reasoning items are
dropped, as chat templates drop earlier reasoning), `instructions` a leading system message,
function tools and `text.format` the chat's `tools` and `response_format`; a
`previous_response_id` puts that response's stored conversation before the new input
(control_panel/response_store.py; its instructions are not carried over, as OpenAI's are not).
The answer comes back as output items — a reasoning item, a message with one `output_text` part,
function calls — whole, or streamed as Responses' typed SSE events (`response.created`, …,
`response.output_text.delta`, …, `response.completed`). Unless `store` is false, the answer and
its conversation are kept for later requests.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, ClassVar

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, ValidationError
from sqlalchemy import Engine

from tandem_protocol.tools import ToolCall

from .. import response_store
from ..deps import API_KEY, AgentRouter, CacheSalt, CallerKey, Db, KeySlot, RequestLogs
from ..router import RouteError
from .answer import Answer
from .bodies import MAX_TOOLS, OPENAI_TEMPERATURE, ChatBody, check_template_kwargs, parts_text
from .chat import chat_answer
from .errors import OpenAIError, route_failure

router = APIRouter(dependencies=API_KEY)

# `include` values Tandem honours: log-probabilities on output_text; reasoning comes back as
# plain text in reasoning items, so there is no encrypted reasoning to add
INCLUDABLE = ("message.output_text.logprobs", "reasoning.encrypted_content")
# the chat parameters' names as a Responses request spells them, for error messages
RENAMED = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesBody(BaseModel):
    model_config = ConfigDict(extra="allow")  # sampling extensions go on to the chat
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # a template's switches, as a chat's (enable_thinking)

    # parameters of the Responses API that Tandem does not implement: refused, never ignored
    UNSUPPORTED: ClassVar[tuple[str, ...]] = (
        "background",
        "conversation",
        "prompt",
        "max_tool_calls",
        "context_management",
        "stream_options",
        "n",  # one output per response: a chat's `n` has no place in it
    )

    def check(self) -> None:
        extra = self.model_extra or {}
        check_template_kwargs(self.chat_template_kwargs)  # as a chat's, before anything is read or asked
        for name in self.UNSUPPORTED:
            if extra.get(name) not in (None, False):
                raise OpenAIError(400, f"the parameter `{name}` is not supported by Tandem", param=name)
        for name in self.include or ():
            if name not in INCLUDABLE:
                raise OpenAIError(400, f"`include`: {name!r} is not supported by Tandem", param="include")
        if (self.reasoning or {}).get("effort") is not None:
            raise OpenAIError(
                400,
                "`reasoning.effort`: Tandem cannot set a model's reasoning effort "
                "(a template's switch goes in chat_template_kwargs, e.g. enable_thinking)",
                param="reasoning",
            )
        if self.truncation not in (None, "disabled"):
            raise OpenAIError(400, "`truncation`: only `disabled` is supported", param="truncation")
        if (self.text or {}).get("verbosity") not in (None, "medium"):
            raise OpenAIError(400, "`text.verbosity`: Tandem cannot set it", param="text")
        if self.metadata is not None and len(self.metadata) > 16:
            raise OpenAIError(400, "`metadata`: at most 16 keys", param="metadata")

    @property
    def logprobs(self) -> bool:
        return self.top_logprobs is not None or "message.output_text.logprobs" in (self.include or ())

    def chat_body(self, conversation: list[dict]) -> ChatBody:
        """The chat completion this request runs as, its conversation after the instructions."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        fields = {
            "model": self.model,
            "messages": system + conversation,
            "stream": self.stream,
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "tools": chat_tools(self.tools),
            "tool_choice": chat_tool_choice(self.tool_choice),
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": chat_format((self.text or {}).get("format")),
            "logprobs": self.logprobs,
            "top_logprobs": self.top_logprobs if self.logprobs else None,
            "user": self.user,
            "chat_template_kwargs": self.chat_template_kwargs,
            **{k: v for k, v in (self.model_extra or {}).items() if k not in self.UNSUPPORTED},
        }
        try:
            return ChatBody(**{k: v for k, v in fields.items() if v is not None})
        except ValidationError as e:
            error = e.errors()[0]
            where = ".".join(str(p) for p in error["loc"]) or "the body"
            raise OpenAIError(400, f"invalid request: {where}: {error['msg']}", param="input") from None


def renamed(e: OpenAIError) -> OpenAIError:
    """A chat parameter's error, naming the parameter as this request spelled it."""
    message = re.sub(r"messages\[\d+\]", "input", str(e))
    for chat_name, name in RENAMED.items():
        message = message.replace(f"`{chat_name}`", f"`{name}`")
    param = RENAMED.get(e.param or "", e.param)
    return OpenAIError(e.status, message, kind=e.kind, param=param, code=e.code, retry_after=e.retry_after)


# ---- a Responses request's parts as a chat's ----------------------------------------------------
def part_text(where: str, content: object) -> str:
    """A message's content: a string, or text parts (as chat's, `parts_text`)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(400, f"{where}.content must be a string or a list of parts", param="input")
    return parts_text(where, content, ("input_text", "output_text", "text"), "input_image", "input")


def _field(where: str, item: dict, name: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise OpenAIError(400, f"{where}: `{name}` must be a string", param="input")
    return value


def input_messages(given: str | list[dict]) -> list[dict]:
    """The `input` as chat messages: a function call joins the assistant turn before it."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    out: list[dict] = []
    for i, item in enumerate(given):
        where, kind = f"input[{i}]", item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise OpenAIError(
                    400, f"{where}: role must be user, system, developer or assistant (got {role!r})", param="input"
                )
            out.append(
                {"role": "system" if role == "developer" else role, "content": part_text(where, item.get("content"))}
            )
        elif kind == "function_call":
            call = {
                "id": _field(where, item, "call_id"),
                "type": "function",
                "function": {"name": _field(where, item, "name"), "arguments": _field(where, item, "arguments")},
            }
            if out and out[-1]["role"] == "assistant":
                out[-1] = {**out[-1], "tool_calls": [*(out[-1].get("tool_calls") or []), call]}
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else part_text(where, output)
            out.append({"role": "tool", "tool_call_id": _field(where, item, "call_id"), "content": text})
        elif kind != "reasoning":
            raise OpenAIError(400, f"{where}: an item of type `{kind}` is not supported by Tandem", param="input")
    return out


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses' flat function tools in chat's shape ({type, function: {name, …}})."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise OpenAIError(
                400,
                f"tools[{i}]: a tool of type `{tool.get('type')}` is not supported: Tandem runs function tools",
                param="tools",
            )
        out.append(
            {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters") if k in tool}}
        )
    return out


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise OpenAIError(
        400,
        f"`tool_choice` must be none, auto, required or {{type: function, name}} (got {choice!r})",
        param="tool_choice",
    )


def chat_format(fmt: dict | None) -> dict | None:
    """`text.format` as chat's `response_format`."""
    if fmt is None or fmt.get("type") != "json_schema":
        return fmt
    spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


# ---- the answer as a response ------------------------------------------------------------------
class ResponseRun:
    """One /v1/responses answer: `whole` or `streamed`, then kept (unless `store` is false)."""

    def __init__(
        self, body: ResponsesBody, chat: ChatBody, answer: Answer, conversation: list[dict], db: Engine, key_id: int
    ):
        self.body, self.chat, self.answer, self.conversation, self.db = body, chat, answer, conversation, db
        self.key_id = key_id  # the API key it is kept for
        self.created = int(time.time())

    def response(self, status: str, output: list[dict], error: dict | None = None) -> dict:
        b, answer = self.body, self.answer
        usage = answer.usage()
        return {
            "id": answer.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": b.model,
            "output": output,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "metadata": b.metadata or {},
            "parallel_tool_calls": b.parallel_tool_calls,
            "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": b.store,
            "temperature": OPENAI_TEMPERATURE if b.temperature is None else b.temperature,
            "text": {"format": (b.text or {}).get("format") or {"type": "text"}},
            "tool_choice": b.tool_choice or "auto",
            "tools": b.tools or [],
            "top_logprobs": b.top_logprobs,
            "top_p": 1.0 if b.top_p is None else b.top_p,
            "truncation": "disabled",
            "user": b.user,
            "usage": {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": answer.reasoning_tokens},
                "total_tokens": usage["total_tokens"],
            },
        }

    @property
    def status(self) -> str:
        return "incomplete" if self.answer.finish_reason == "length" else "completed"

    def keep(self, response: dict, text: str, calls: list[ToolCall]) -> None:
        """Store the response and its conversation (with this answer) for a later request of this key."""
        if not self.body.store:
            return
        said: dict = {"role": "assistant", "content": text or None}
        if calls:
            said["tool_calls"] = [c.openai() for c in calls]
        response_store.save(self.db, self.key_id, response, [*self.conversation, said])

    async def whole(self) -> dict:
        pieces = await self.answer.pieces()
        text, reasoning = "".join(p[0] for p in pieces), "".join(p[2] for p in pieces)
        entries = [e for p in pieces for e in p[1]]
        output = []
        if reasoning:
            output.append(reasoning_item(new_id("rs"), reasoning))
        if text or not (reasoning or self.answer.calls):  # an empty answer is an empty message
            output.append(message_item(new_id("msg"), text, entries, "completed"))
        output += [call_item(call) for call in self.answer.calls]
        response = self.response(self.status, output)
        await asyncio.to_thread(self.keep, response, text, self.answer.calls)
        return response

    async def streamed(self):
        return await self.answer.streamed(self.sse)

    async def sse(self, gen: AsyncIterator[tuple[str, list[dict], str]], first: tuple | None) -> AsyncIterator[bytes]:
        outcome, error, events = "cancelled", "", Events()
        try:
            for kind in ("response.created", "response.in_progress"):
                yield events.event(kind, response=self.response("in_progress", []))
            async for content, entries, reasoning in gen if first is None else _chain(first, gen):
                for e in (events.add("reasoning", reasoning, []) if reasoning else []) + (
                    events.add("message", content, entries) if content or entries else []
                ):
                    yield e
            if events.item is None and not events.output and not self.answer.calls:  # an empty message
                for e in events.add("message", "", []):
                    yield e
            for e in events.close() + [e for call in self.answer.calls for e in events.call(call)]:
                yield e
            response = self.response(self.status, events.output)
            await asyncio.to_thread(self.keep, response, events.text(), self.answer.calls)
            yield events.event(f"response.{self.status}", response=response)
            outcome = "ok"
        except RouteError as e:
            outcome, error = "error", str(e)
            told = str(route_failure(e, self.answer.rid))
            failed = self.response("failed", events.output, error={"code": "server_error", "message": told})
            yield events.event("response.failed", response=failed)
        finally:
            try:
                await gen.aclose()
            finally:  # logged even when closing fails (the panel shutting down under it)
                self.answer.log(outcome, error)


class Events:
    """A streamed response's typed SSE events, numbered, and the output items they finished.
    Reasoning and message text stream into one item at a time (`item`), each with one part."""

    def __init__(self):
        self.sequence, self.output, self.item = 0, [], None
        self.pieces: list[str] = []  # the open item's text, joined as it closes (`+=` copied all of it at each token)

    def event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()

    def of_part(self, kind: str, **fields) -> bytes:
        return self.event(kind, item_id=self.item["id"], output_index=len(self.output), content_index=0, **fields)

    def add(self, kind: str, text: str, entries: list[dict]) -> list[bytes]:
        """Text for a "reasoning" or "message" item, opening one (and closing the other) if need be."""
        out = []
        if self.item is None or self.item["type"] != kind:
            out = self.close()
            new = (
                reasoning_item(new_id("rs"), "")
                if kind == "reasoning"
                else message_item(new_id("msg"), "", [], "in_progress")
            )
            self.item = new
            out.append(
                self.event("response.output_item.added", output_index=len(self.output), item={**new, "content": []})
            )
            out.append(self.of_part("response.content_part.added", part=new["content"][0]))
        part = self.item["content"][0]
        self.pieces.append(text)
        if kind == "reasoning":
            return [*out, self.of_part("response.reasoning_text.delta", delta=text)]
        part["logprobs"] += entries
        return [*out, self.of_part("response.output_text.delta", delta=text, logprobs=entries)]

    def close(self) -> list[bytes]:
        if self.item is None:
            return []
        part = self.item["content"][0]
        part["text"], self.pieces = "".join(self.pieces), []
        if self.item["type"] == "reasoning":
            out = [self.of_part("response.reasoning_text.done", text=part["text"])]
        else:
            out = [self.of_part("response.output_text.done", text=part["text"], logprobs=part["logprobs"])]
            self.item["status"] = "completed"
        out += [
            self.of_part("response.content_part.done", part=part),
            self.event("response.output_item.done", output_index=len(self.output), item=self.item),
        ]
        self.output.append(self.item)
        self.item = None
        return out

    def call(self, call: ToolCall) -> list[bytes]:
        done, index = call_item(call), len(self.output)
        self.output.append(done)
        return [
            self.event(
                "response.output_item.added",
                output_index=index,
                item={**done, "arguments": "", "status": "in_progress"},
            ),
            self.event(
                "response.function_call_arguments.delta", item_id=done["id"], output_index=index, delta=call.arguments
            ),
            self.event(
                "response.function_call_arguments.done",
                item_id=done["id"],
                output_index=index,
                name=call.name,
                arguments=call.arguments,
            ),
            self.event("response.output_item.done", output_index=index, item=done),
        ]

    def text(self) -> str:
        return "".join(i["content"][0]["text"] for i in self.output if i["type"] == "message")


async def _chain(first: tuple, rest: AsyncIterator[tuple]) -> AsyncIterator[tuple]:
    yield first
    async for piece in rest:
        yield piece


def message_item(item_id: str, text: str, entries: list[dict], status: str) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": entries}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def reasoning_item(item_id: str, text: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def call_item(call: ToolCall) -> dict:
    return {
        "type": "function_call",
        "id": "fc_" + call.id.removeprefix("call_"),
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": "completed",
    }


# ---- what a response keeps of its request ------------------------------------------------------
# The fields a response echoes, and the store keeps, that no template renders (so no context length
# bounds them), bounded as OpenAI bounds them: metadata (16 keys: `ResponsesBody.check`; keys of 64
# characters, values of 512: its documented bounds), `user` (64 characters: undocumented, what its
# API is reported to enforce, maximhq/bifrost#1000); the number of tools is bodies.MAX_TOOLS.
METADATA_KEY_CHARS, METADATA_VALUE_CHARS, USER_CHARS = 64, 512, 64
# the fields of a function tool, a `text.format` and a named `tool_choice` as OpenAI defines them
TOOL_FIELDS = ("type", "name", "description", "parameters", "strict")
FORMAT_FIELDS = ("type", "name", "description", "schema", "strict")
CHOICE_FIELDS = ("type", "name")


def bound_kept_fields(body: ResponsesBody) -> None:
    """Refuse (400 naming the field) what is over OpenAI's bounds, and keep only the known fields
    of tools, `text.format` and `tool_choice`: anything else in them would be stored as is."""
    for key, value in (body.metadata or {}).items():
        if len(key) > METADATA_KEY_CHARS:
            raise OpenAIError(
                400, f"`metadata`: a key is at most {METADATA_KEY_CHARS} characters (got {len(key)})", param="metadata"
            )
        if len(value) > METADATA_VALUE_CHARS:
            raise OpenAIError(
                400,
                f"`metadata.{key}`: a value is at most {METADATA_VALUE_CHARS} characters (got {len(value)})",
                param="metadata",
            )
    if body.user is not None and len(body.user) > USER_CHARS:
        raise OpenAIError(400, f"`user`: at most {USER_CHARS} characters (got {len(body.user)})", param="user")
    if body.tools is not None:
        if len(body.tools) > MAX_TOOLS:
            raise OpenAIError(400, f"`tools`: at most {MAX_TOOLS} tools (got {len(body.tools)})", param="tools")
        body.tools = [{k: tool[k] for k in TOOL_FIELDS if k in tool} for tool in body.tools]
    fmt = (body.text or {}).get("format")
    if isinstance(fmt, dict):
        body.text = {**(body.text or {}), "format": {k: fmt[k] for k in FORMAT_FIELDS if k in fmt}}
    if isinstance(body.tool_choice, dict):
        body.tool_choice = {k: body.tool_choice[k] for k in CHOICE_FIELDS if k in body.tool_choice}


# ---- the routes ----------------------------------------------------------------------------------
# A response is its key's alone. Another key's is answered exactly as an unknown id is, so a key
# cannot even learn that an id exists.


@router.post("/v1/responses")
async def create_response(
    body: ResponsesBody, db: Db, agents: AgentRouter, request_log: RequestLogs, slot: KeySlot, salt: CacheSalt
):
    body.check()
    bound_kept_fields(body)
    history: list[dict] = []
    if body.previous_response_id is not None:
        history = await asyncio.to_thread(response_store.conversation, db, slot.key_id, body.previous_response_id)
        if history is None:
            raise OpenAIError(
                404,
                f"no stored response has the id {body.previous_response_id!r} (it may have expired, been deleted "
                "or been made with store: false)",
                param="previous_response_id",
                code="response_not_found",
            )
    conversation = history + input_messages(body.input)
    if not conversation:
        raise OpenAIError(400, "`input`: give at least one item", param="input")
    chat = body.chat_body(conversation)
    try:
        answer = await chat_answer(chat, db, agents, request_log, rid=new_id("resp"), slot=slot, cache_salt=salt)
    except OpenAIError as e:
        raise renamed(e) from None
    run = ResponseRun(body, chat, answer, conversation, db, slot.key_id)
    return await (run.streamed() if body.stream else run.whole())


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, db: Db, key: CallerKey):
    response = await asyncio.to_thread(response_store.response, db, key.id, response_id)
    if response is None:
        raise OpenAIError(404, f"no stored response has the id {response_id!r}", code="response_not_found")
    return response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, db: Db, key: CallerKey):
    if not await asyncio.to_thread(response_store.forget, db, key.id, response_id):
        raise OpenAIError(404, f"no stored response has the id {response_id!r}", code="response_not_found")
    return {"id": response_id, "object": "response", "deleted": True}
