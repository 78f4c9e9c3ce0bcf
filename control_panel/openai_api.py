"""The OpenAI-compatible API: /v1/models, /v1/chat/completions, /v1/completions (and its OpenAPI
document at /v1/openapi.json).

Streaming answers are SSE (`data: {...}` chunks, then `data: [DONE]`); a final usage chunk comes
when `stream_options.include_usage` is set. Errors use OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`: 400 for parameters Tandem cannot honour (or a
body that is not JSON), 401 for a missing or wrong API key, 404 for an unknown model, 413 for a
body over the panel's limit, 415 for a body not sent as JSON, 429 with Retry-After when the
prefiller's budget is busy past the deadline, 503 when no route is up.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, ClassVar

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy import Engine
from sqlmodel import Session, select

from tandem_protocol.sampling import SERVER_FIELDS, SamplingParams

from .db import cached_until_state_changes
from .models import Node, Pair, RequestLog
from .request_log import RequestLogWriter
from .router import RouteError, Router, RouteStats, Target
from .security import api_key_valid
from .services import model_names, node_by_model_name


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ):
        super().__init__(message)
        self.status, self.kind, self.param, self.code, self.retry_after = status, kind, param, code, retry_after

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(int(self.retry_after))} if self.retry_after else None
        return JSONResponse(
            {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}},
            status_code=self.status,
            headers=headers,
        )


class StreamOptions(BaseModel):
    include_usage: bool = False


# The sampling parameters an OpenAI request may carry, under SamplingParams' names: OpenAI's own
# and the extensions vLLM and others accept (top_k, min_p, repetition_penalty). Their bounds are
# SamplingParams', checked once when the request is mapped onto it.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", *SERVER_FIELDS)
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


class CompletionBody(_Common):
    prompt: str | list[str] | list[int]


def resolve_target(engine: Engine, model: str) -> Target:
    """A pair by its name, or a single node as `node/<name>`."""
    target = _find_target(engine, model)
    if target is None:
        raise OpenAIError(
            404, f"the model `{model}` does not exist (see GET /v1/models)", code="model_not_found", param="model"
        )
    return target


@cached_until_state_changes
def _find_target(engine: Engine, model: str) -> Target | None:
    with Session(engine) as s:
        pair = s.exec(select(Pair).where(Pair.name == model)).first()
        if pair is not None:
            p, d = s.get(Node, pair.prefill_node_id), s.get(Node, pair.decode_node_id)
            return Target(pair.name, d.url, p.url, pair.local_threshold, pair.fallback, pair.page_encoding)
        if model.startswith("node/"):
            node = node_by_model_name(s, model)
            if node is not None:
                return Target(model, node.url)
    return None


class _StopScanner:
    """Cuts the text at the first stop string, holding back what could still become one."""

    def __init__(self, stops: list[str]):
        self.stops, self.pending, self.hit = [s for s in stops if s], "", False
        self.hold = max((len(s) for s in self.stops), default=1) - 1

    def feed(self, text: str) -> str:
        self.pending += text
        for stop in self.stops:
            at = self.pending.find(stop)
            if at >= 0:
                self.hit = True
                out, self.pending = self.pending[:at], ""
                return out
        cut = max(0, len(self.pending) - self.hold)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def make_openai_router(engine: Engine, router: Router, request_log: RequestLogWriter) -> APIRouter:
    async def authorize(authorization: str | None = Header(None)) -> None:
        # A dependency: it runs before the body is validated, so a bad key is a 401 whatever the
        # body holds (only a body too large, or not JSON at all, is refused before the key is read).
        token = authorization[7:] if authorization and authorization.startswith("Bearer ") else None
        if not api_key_valid(engine, token):
            raise OpenAIError(
                401,
                "missing or wrong API key (create one in the panel's Settings)",
                kind="invalid_request_error",
                code="invalid_api_key",
            )

    async def json_only(request: Request) -> None:
        # FastAPI parses a body as JSON only under a JSON media type, and validates anything else
        # as one opaque value ("Input should be a valid dictionary"): say what is wrong instead.
        if request.method != "POST":
            return
        given = request.headers.get("content-type", "")
        media = given.split(";", 1)[0].strip().lower()
        if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
            raise OpenAIError(
                415,
                f"the body must be JSON sent with Content-Type: application/json (got {given or 'no Content-Type'})",
                code="unsupported_media_type",
            )

    api = APIRouter(dependencies=[Depends(authorize), Depends(json_only)])

    @api.get("/v1/openapi.json", include_in_schema=False)
    async def openapi(request: Request):
        """This API's OpenAPI document (behind the key, like the agent's /v1/openapi.json)."""
        return request.app.openapi()

    @api.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": n, "object": "model", "created": 0, "owned_by": "tandem"} for n in model_names(engine)],
        }

    async def serve(body: _Common, chat: bool, request: Request):
        body.check()
        sampling = body.sampling()  # refused here, before any agent is asked anything
        target = resolve_target(engine, body.model)
        if chat:
            ids = await router.tokenize(target, body.messages, None)
        elif isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], int):
            ids = list(body.prompt)
        else:
            prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
            if len(prompts) != 1:
                raise OpenAIError(400, "exactly one prompt per request is supported", param="prompt")
            ids = await router.tokenize(target, None, prompts[0])
        stats = RouteStats()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        logged = request_log.start(RequestLog(model=body.model, route="", prompt_tokens=len(ids)))
        events = router.run(target, ids, sampling, stats)
        scanner = _StopScanner(body.stops)

        def log(outcome: str, error: str = "") -> None:
            request_log.finish(
                logged,
                route=stats.route,
                reason=stats.reason,
                ttft_ms=stats.ttft_ms,
                output_tokens=stats.output_tokens,
                bytes_moved=stats.bytes_moved,
                outcome=outcome,
                error=error,
            )

        async def texts() -> AsyncIterator[str]:
            """Text deltas until the end, a stop string or an error (raised as RouteError)."""
            try:
                async for event in events:
                    if "error" in event:
                        raise RouteError(event["error"]["message"], 503)
                    if "token" in event:
                        delta = scanner.feed(event["text"])
                        if delta:
                            yield delta
                        if scanner.hit:
                            stats.finish_reason = "stop"
                            return
                rest = scanner.flush()
                if rest:
                    yield rest
            finally:
                await events.aclose()  # a stop string or a client gone: abort both roles now

        def usage() -> dict:
            return {
                "prompt_tokens": len(ids),
                "completion_tokens": stats.output_tokens,
                "total_tokens": len(ids) + stats.output_tokens,
            }

        def chunk(delta: str | None, finish: str | None) -> dict:
            if chat:
                d = {} if delta is None else {"content": delta}
                return {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": body.model,
                    "choices": [{"index": 0, "delta": d, "finish_reason": finish}],
                }
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": body.model,
                "choices": [{"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}],
            }

        if not body.stream:
            try:
                text = "".join([t async for t in texts()])
            except RouteError as e:
                log("error", str(e))
                raise OpenAIError(e.status, str(e), kind=e.kind, retry_after=e.retry_after) from e
            log("ok")
            choice = (
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": stats.finish_reason or "stop",
                }
                if chat
                else {"index": 0, "text": text, "logprobs": None, "finish_reason": stats.finish_reason or "stop"}
            )
            return {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": body.model,
                "choices": [choice],
                "usage": usage(),
            }

        # Streaming: pull the first event before answering, so routing errors are real HTTP errors.
        gen = texts()
        try:
            first = await gen.__anext__()
        except StopAsyncIteration:
            first = None
        except RouteError as e:
            log("error", str(e))
            raise OpenAIError(e.status, str(e), kind=e.kind, retry_after=e.retry_after) from e

        async def sse() -> AsyncIterator[bytes]:
            outcome, error = "cancelled", ""
            try:
                if chat:
                    head = chunk(None, None)
                    head["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                    yield _sse(head)
                if first is not None:
                    yield _sse(chunk(first, None))
                    async for delta in gen:
                        yield _sse(chunk(delta, None))
                yield _sse(chunk(None, stats.finish_reason or "stop"))
                if body.stream_options and body.stream_options.include_usage:
                    yield _sse(
                        {
                            "id": rid,
                            "object": "chat.completion.chunk" if chat else "text_completion",
                            "created": created,
                            "model": body.model,
                            "choices": [],
                            "usage": usage(),
                        }
                    )
                yield b"data: [DONE]\n\n"
                outcome = "ok"
            except RouteError as e:
                outcome, error = "error", str(e)
                yield _sse({"error": {"message": str(e), "type": e.kind, "param": None, "code": None}})
                yield b"data: [DONE]\n\n"
            finally:
                try:
                    await gen.aclose()
                finally:  # logged even when closing fails (the panel shutting down under it)
                    log(outcome, error)

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request):
        return await serve(body, True, request)

    @api.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        return await serve(body, False, request)

    return api


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"
