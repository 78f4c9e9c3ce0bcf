"""The node agent's HTTP API (FastAPI). One engine, pages in and out, tokens out.

Routes (all but /healthz and /v1/identity need `Authorization: Bearer <cluster key>`):

    GET    /healthz                        liveness, no key
    POST   /v1/identity                    no key: proof of holding it (tandem_protocol/auth.py)
    GET    /v1/info                        node, engine, model contract, protocol version, modes
    GET    /v1/status                      info + budget + open handoffs + totals (JSON)
    GET    /metrics                        the same as Prometheus text
    POST   /v1/tokenize                    chat messages or text -> token ids (this node's tokenizer)
    POST   /v1/handoffs                    P: reserve budget, start prefill of a room
    GET    /v1/handoffs/{room}/pages       P: the room's page stream (one reader)
    DELETE /v1/handoffs/{room}             P: cancel a room (idempotent)
    POST   /v1/decode                      D: the one request of a P/D pair: D creates the handoff on
                                           the prefiller, pulls its pages, streams tokens
    POST   /v1/generate                    this engine alone: prefill + decode, stream tokens
    DELETE /v1/requests/{request_id}       cancel a running decode/generate (idempotent)
    GET    /v1/bench/pages                 synthetic page stream for `tandem agent bench-link`
    POST   /v1/bench/link                  pull synthetic pages from a peer: the peer->this link's
                                           page throughput and round trip (`tandem bench ttft --panel`)
    GET    /v1/openapi.json                the API's OpenAPI document

How a P/D request goes between panel, decoder and prefiller: ARCHITECTURE.md, "One request".
Token streams are NDJSON: {"token", "text"} lines, then one {"done": true, ...} line or one
{"error": {...}} line. Errors before a stream starts are JSON `{"error": {"type", "message"}}`
with a fitting status code.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field

import numpy as np
import psutil
import xxhash
from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from engine_adapters import ADAPTERS
from engine_adapters.base import EngineAdapter, EngineRequest
from tandem_protocol.api import (
    PREFILLER_FAILED,
    BenchLinkBody,
    ConfigBody,
    DecodeBody,
    GenerateBody,
    HandoffBody,
    HandoffCreated,
    TokenizeAnswer,
    TokenizeBody,
)
from tandem_protocol.auth import (
    IDENTITY_PATH,
    IdentityAnswer,
    IdentityChallenge,
    canonical_address,
    identity_answer,
    key_matches,
)
from tandem_protocol.client import AgentClient, AgentHTTPError, TransportError
from tandem_protocol.contract import HashCache, compute_contract
from tandem_protocol.errors import Cancelled, ContractMismatch, FrameError, RequestError, TandemError, UnsupportedModel
from tandem_protocol.handoff import PrefillDone
from tandem_protocol.http_server import PageStreamResponse
from tandem_protocol.pages import ENCODINGS, PROTOCOL_VERSION, FrameExpectation, encode_frame, make_page
from tandem_protocol.settings import hash_cache_path
from tandem_protocol.wire import PeerError, done_frame

from .budget import BudgetExceeded, BudgetTimeout, StagingBudget
from .engine_slot import EngineBusy, EngineLoading, EngineSlot, Loader
from .handoffs import HandoffError, HandoffManager
from .handshake import Handshake, PrefillerFailed, PrefillerRefused
from .metrics import Metrics
from .model_roots import ModelPathError, check_model, list_models

log = logging.getLogger("tandem.agent")


@dataclass
class AgentConfig:
    node_id: str
    name: str
    cluster_key: str
    staging_bytes: int = 512 << 20
    handoff_ttl: float = 60.0
    model_name: str = ""
    url: str = ""  # where this agent listens (for logs)
    model_roots: list = field(default_factory=list)  # directories POST /v1/config may load models from
    # A page stream that moves no byte for this long is broken (a cable pulled, a peer frozen):
    # the decoder gives up reading it and the prefiller gives up writing it, and both let go of
    # what they hold. It must exceed the longest gap between two pages (one prefill chunk).
    stall_timeout: float = 60.0


class ConfigError(RequestError):
    """A node configuration the node cannot take; `field` names the form field at fault."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


# ---- errors ----------------------------------------------------------------------------------
_STATUS = [
    (BudgetExceeded, 413),
    (BudgetTimeout, 429),
    (ContractMismatch, 409),
    (UnsupportedModel, 400),
    (RequestError, 400),
    (Cancelled, 499),
    (FrameError, 502),
    (PeerError, 502),
    (EngineBusy, 409),
    (EngineLoading, 503),
]


def error_body(e: Exception) -> dict:
    body = {"type": type(e).__name__, "message": str(e)}
    if isinstance(e, ContractMismatch):
        body["fields"] = e.fields
    if isinstance(e, PeerError):
        body["peer_code"] = e.code
    if isinstance(e, ConfigError):
        body["field"] = e.field
    if isinstance(e, PrefillerRefused):  # the prefiller's own error type and details, passed on
        body = {**e.detail, **body, "type": e.kind}
    if isinstance(e, PrefillerFailed):
        body[PREFILLER_FAILED] = True
    return {"error": body}


def status_of(e: Exception) -> int:
    if isinstance(e, (HandoffError, AgentHTTPError, PrefillerFailed, PrefillerRefused)):
        return e.status
    return next((code for cls, code in _STATUS if isinstance(e, cls)), 500)


class _Incremental:
    """Text deltas from a growing token list, decoding only a short window of recent tokens
    (the offsets scheme of Hugging Face's TextStreamer and vLLM's detokenizer), so a long answer
    costs O(n), not O(n^2). A partial UTF-8 character is held back until it completes."""

    def __init__(self, adapter: EngineAdapter):
        self.adapter, self.ids, self.prefix, self.read = adapter, [], 0, 0

    def add(self, token: int) -> str:
        self.ids.append(token)
        before = self.adapter.detokenize(self.ids[self.prefix : self.read])
        text = self.adapter.detokenize(self.ids[self.prefix :])
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before) :]


def process_memory() -> dict:
    """This agent's resident bytes, and those of the processes it started (an engine that runs as
    its own server: vLLM, SGLang, with their workers), for soak runs and diagnostics."""
    me = psutil.Process()
    children = 0
    for child in me.children(recursive=True):
        try:
            children += child.memory_info().rss
        except psutil.Error:  # gone between the listing and the reading
            pass
    return {"rss_bytes": me.memory_info().rss, "children_rss_bytes": children}


def create_app(adapter: EngineAdapter, config: AgentConfig, discovery=None, loader: Loader | None = None) -> FastAPI:
    """The agent's ASGI app. `discovery` (optional) is started and stopped with the app; `loader`
    (optional) lets a panel switch this node's engine or model (POST /v1/config)."""
    metrics = Metrics()
    budget = StagingBudget(config.staging_bytes)
    slot = EngineSlot(adapter, loader)
    handoffs = HandoffManager(slot, budget, metrics, ttl=config.handoff_ttl)
    metrics.bind(
        capacity=lambda: budget.capacity,
        reserved=lambda: budget.reserved,
        waiting=lambda: budget.waiting,
        open_handoffs=lambda: len(handoffs.handoffs),
        active=lambda: slot.adapter.active_requests if slot.ready else 0,
    )
    peers: dict[str, AgentClient] = {}  # one pooled HTTP client per prefiller: connections are reused
    started = time.time()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if discovery is not None:
            await discovery.start()
        log.info("tandem agent %s ready on %s", config.name, config.url)
        try:
            yield
        finally:
            if discovery is not None:
                await discovery.stop()
            await handoffs.close()
            for client in peers.values():
                await client.aclose()

    # The OpenAPI document is served behind the key (/v1/openapi.json): only /healthz is open.
    app = FastAPI(
        title="Tandem node agent",
        version=str(PROTOCOL_VERSION),
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.slot, app.state.budget, app.state.handoffs, app.state.metrics = slot, budget, handoffs, metrics

    @app.exception_handler(TandemError)
    async def tandem_error(request: Request, e: TandemError):
        retry = getattr(e, "retry_after", None)
        headers = {"Retry-After": str(int(np.ceil(retry)))} if retry else None
        return JSONResponse(error_body(e), status_code=status_of(e), headers=headers)

    @app.exception_handler(AgentHTTPError)
    async def peer_http_error(request: Request, e: AgentHTTPError):
        return JSONResponse(error_body(e), status_code=e.status)

    class _Unauthorized(Exception):
        pass

    @app.exception_handler(HTTPException)
    async def framework_error(request: Request, e: HTTPException):
        # What FastAPI raises itself (a body that is not UTF-8, an unknown path or method): the
        # agent's error shape, like every other refusal, instead of FastAPI's {"detail": ...}
        kind = "RequestError" if e.status_code == 400 else "HTTPError"
        return JSONResponse(
            {"error": {"type": kind, "message": str(e.detail)}}, status_code=e.status_code, headers=e.headers
        )

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, e: RequestValidationError):
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())
        return JSONResponse(
            {"error": {"type": "RequestError", "message": f"invalid request: {problems}"}}, status_code=400
        )

    async def require_key(authorization: str | None = Header(None), x_tandem_protocol: int | None = Header(None)):
        token = authorization[7:] if authorization and authorization.startswith("Bearer ") else None
        if not key_matches(token, config.cluster_key):
            raise _Unauthorized()
        if x_tandem_protocol is not None and x_tandem_protocol != PROTOCOL_VERSION:
            raise RequestError(
                f"peer speaks Tandem protocol {x_tandem_protocol}, this agent speaks "
                f"{PROTOCOL_VERSION}: run the same Tandem version on both machines"
            )

    @app.exception_handler(_Unauthorized)
    async def unauthorized(request: Request, e: _Unauthorized):
        return JSONResponse(
            {"error": {"type": "Unauthorized", "message": "missing or wrong cluster key"}},
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )

    @app.get("/healthz")
    async def healthz():
        return {"ok": True}

    @app.post(IDENTITY_PATH)
    async def identity(body: IdentityChallenge, request: Request) -> IdentityAnswer:
        """No key: a panel checks, before it sends the key here, that this is the node it knows."""
        host, port = request.scope["server"][:2]  # this connection's own socket: a client cannot choose it
        return identity_answer(config.cluster_key, body.nonce, config.node_id, canonical_address(host, port))

    api = APIRouter(dependencies=[Depends(require_key)])

    def info() -> dict:
        base = {
            "node_id": config.node_id,
            "name": config.name,
            "protocol_version": PROTOCOL_VERSION,
            "state": "ready" if slot.ready else "loading",
            "model_roots": [str(r) for r in config.model_roots],
            "switchable": loader is not None,
        }
        if not slot.ready:
            return {
                **base,
                "engine": None,
                "model": slot.loading,
                "contract": None,
                "decoder_modes": [],
                "accelerator": {},
                "page_bytes": 0,
                "context_length": 0,
                "last_error": slot.last_error,
            }
        a = slot.adapter
        return {
            **base,
            "engine": a.name,
            "model": config.model_name or a.model_dir.name,
            "model_path": str(a.model_dir),
            "contract": a.contract.to_dict(),
            "decoder_modes": [m.value for m in a.decoder_modes],
            "first_token_sampling": sorted(a.first_token_sampling),
            "sampling": sorted(a.sampling),
            "accelerator": a.accelerator(),
            "page_bytes": a.geometry.page_bytes,
            "context_length": a.context_length,
            "vocab_size": a.info.vocab_size,
            "page_encodings": sorted(ENCODINGS),
        }

    def idle() -> bool:
        return (
            not handoffs.handoffs
            and not handoffs.waiting
            and budget.reserved == 0
            and budget.waiting == 0
            and slot.adapter.active_requests == 0
        )

    @api.get("/v1/info")
    async def get_info():
        return info()

    @api.get("/v1/openapi.json")
    async def openapi():
        return app.openapi()

    @api.get("/v1/status")
    async def get_status():
        v = Metrics.value
        return {
            **info(),
            "uptime_seconds": round(time.time() - started, 1),
            "budget": {
                "capacity": budget.capacity,
                "reserved": budget.reserved,
                "waiting": budget.waiting,
                "waiting_bytes": budget.waiting_bytes,
            },
            "open_handoffs": len(handoffs.handoffs),
            "handoffs": handoffs.describe(),
            "active_requests": slot.adapter.active_requests,
            "engine_stats": await slot.adapter.engine_stats(),
            "process": process_memory(),
            "totals": {
                "prefills_started": handoffs.prefill_calls,
                "handoffs_created": v(metrics.handoffs_created),
                "pages_sent": v(metrics.pages_sent),
                "bytes_sent": v(metrics.bytes_sent),
                "pages_received": v(metrics.pages_received),
                "bytes_received": v(metrics.bytes_received),
                "imported_tokens": v(metrics.imported_tokens),
                "generated_tokens": v(metrics.generated_tokens),
            },
        }

    @api.get("/v1/models/local")
    async def local_models():
        """Checkpoints in this node's model roots, for a panel's model picker."""
        return {
            "roots": [str(r) for r in config.model_roots],
            "models": await asyncio.to_thread(list_models, config.model_roots),
        }

    @api.post("/v1/config")
    async def configure(body: ConfigBody):
        """Check, and unless `dry_run` apply, an engine, model path, context length and staging budget.

        The model path is confined to this node's model roots and checked before anything loads;
        a switch waits for nothing: it is refused (409) while the node has work in flight."""
        if body.engine not in ADAPTERS:
            raise ConfigError(f"unknown engine {body.engine!r} (known: {', '.join(ADAPTERS)})", "engine")
        try:
            model = await asyncio.to_thread(check_model, body.model_path, config.model_roots)
        except ModelPathError as e:
            raise ConfigError(str(e), "model_path") from None
        if body.context_length is not None and not 1 <= body.context_length <= model.max_context:
            raise ConfigError(
                f"context length {body.context_length} is outside 1..{model.max_context} for {model.path.name}",
                "context_length",
            )
        context_length = body.context_length or model.max_context  # blank: the model's own
        if body.dry_run:  # the contract the node would have, so a panel compares pairs before loading
            contract = await asyncio.to_thread(compute_contract, model, context_length, HashCache(hash_cache_path()))
            return {
                "ok": True,
                "changed": False,
                "model_path": str(model.path),
                "max_context": model.max_context,
                "contract": contract.to_dict(),
            }
        changed = await slot.replace(body.engine, model.path, context_length, idle)
        if changed:
            config.model_name = model.path.name
            if discovery is not None:
                a, accel = slot.adapter, slot.adapter.accelerator()
                await discovery.update(
                    engine=a.name,
                    model=config.model_name,
                    contract=a.contract.fingerprint,
                    accel=accel["kind"],
                    accel_name=accel.get("name", ""),
                )
        if body.staging_bytes is not None and body.staging_bytes != budget.capacity:
            budget.resize(body.staging_bytes)
            changed = True
        return {"ok": True, "changed": changed, **info()}

    @api.get("/metrics")
    async def get_metrics():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @api.post("/v1/tokenize")
    async def tokenize(body: TokenizeBody) -> TokenizeAnswer:
        if (body.messages is None) == (body.prompt is None):
            raise RequestError("give exactly one of `messages` (chat) or `prompt` (plain text)")
        try:
            ids = (
                slot.adapter.chat_token_ids(body.messages)
                if body.messages is not None
                else slot.adapter.encode(body.prompt)
            )
        except Exception as e:  # template errors name the problem
            raise RequestError(f"cannot tokenize: {e}") from e
        return TokenizeAnswer(token_ids=ids)

    @api.post("/v1/handoffs", status_code=201)
    async def create_handoff(body: HandoffBody) -> HandoffCreated:
        if body.protocol_version != PROTOCOL_VERSION:
            raise RequestError(
                f"decoder speaks Tandem protocol {body.protocol_version}, this prefiller speaks {PROTOCOL_VERSION}"
            )
        if body.contract != slot.adapter.contract.fingerprint:
            raise ContractMismatch(
                ["contract fingerprint"],
                f"decoder's {body.contract[:16]}… differs from this "
                f"prefiller's {slot.adapter.contract.fingerprint[:16]}…: compare /v1/info of both nodes",
            )
        h = await handoffs.create(
            body.room,
            body.token_ids,
            body.sampling,
            body.mode,
            body.wait_timeout,
            encoding=ENCODINGS[body.page_encoding],
        )
        pages, nbytes = handoffs.page_bytes_for(len(body.token_ids), body.mode)
        return HandoffCreated(room=h.room, pages=pages, reserved_bytes=nbytes)

    @api.get("/v1/handoffs/{room}/pages")
    async def handoff_pages(room: str):
        frames = await handoffs.stream(room)
        return PageStreamResponse(frames)

    @api.delete("/v1/handoffs/{room}")
    async def cancel_handoff(room: str):
        return {"room": room, "cancelled": await handoffs.cancel(room)}

    async def token_lines(
        req: EngineRequest,
        tokens: AsyncIterator[int],
        kind: str,
        t0: float,
        extra: dict,
        handshake: Handshake | None = None,
    ) -> AsyncIterator[bytes]:
        text = _Incremental(slot.adapter)
        outcome, count, ttft, last = "error", 0, None, None
        try:
            async with aclosing(tokens) as stream:
                async for token in stream:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    count, last = count + 1, token
                    metrics.generated_tokens.inc()
                    yield (json.dumps({"token": token, "text": text.add(token)}) + "\n").encode()
            stops = set(req.sampling.stop_token_ids) | (
                set() if req.sampling.ignore_eos else slot.adapter.eos_token_ids
            )
            finish = "stop" if last in stops or count < req.sampling.max_tokens else "length"
            outcome = "ok"
            yield (
                json.dumps(
                    {
                        "done": True,
                        "finish_reason": finish,
                        "prompt_tokens": len(req.token_ids),
                        "completion_tokens": count,
                        "ttft_seconds": ttft,
                        **extra,
                    }
                )
                + "\n"
            ).encode()
        except (TandemError, AgentHTTPError) as e:
            outcome = "cancelled" if isinstance(e, Cancelled) else "failed"
            body = error_body(e)
            if count == 0 and handshake is not None and handshake.failed:
                body["error"][PREFILLER_FAILED] = True  # nothing was sent: the panel may serve D alone
            yield (json.dumps(body) + "\n").encode()
        except Exception as e:  # a bug or an engine failing in a way nobody foresaw: still a last line
            log.exception("%s request %s failed", kind, req.request_id)
            outcome = "failed"
            yield (
                json.dumps({"error": {"type": "engine_error", "message": f"{type(e).__name__}: {e}"}}) + "\n"
            ).encode()
        finally:
            metrics.requests.labels(kind=kind, outcome=outcome).inc()
            if handshake is not None:
                handshake.release()

    @api.post("/v1/generate")
    async def generate(body: GenerateBody):
        req = EngineRequest(body.request_id or uuid.uuid4().hex, body.token_ids, body.sampling)
        slot.adapter.validate(req, generates=True)
        return StreamingResponse(
            token_lines(req, slot.adapter.generate(req), "generate", time.perf_counter(), {}),
            media_type="application/x-ndjson",
        )

    def peer(url: str) -> AgentClient:
        url = url.rstrip("/")
        if url not in peers:
            peers[url] = AgentClient(url, config.cluster_key, stall_timeout=config.stall_timeout)
        return peers[url]

    @api.post("/v1/decode")
    async def decode(body: DecodeBody):
        """The one request of a P/D pair: checked here, then the handoff is created on the
        prefiller and its pages pulled as they come (ARCHITECTURE.md, "One request")."""
        a = slot.adapter
        mode = body.mode or a.decoder_modes[0]
        if mode not in a.decoder_modes:
            raise RequestError(f"{a.name} cannot decode in {mode.value} mode")
        req = EngineRequest(body.request_id or uuid.uuid4().hex, body.token_ids, body.sampling, mode)
        a.validate(req, generates=True)  # context length, sampling fields: refused before P computes
        if body.prefill_url is None:
            return StreamingResponse(
                token_lines(req, a.generate(req), "generate", time.perf_counter(), {}),
                media_type="application/x-ndjson",
            )
        t0 = time.perf_counter()
        handshake = Handshake(a, peer(body.prefill_url), body.prefill_url, metrics)
        await handshake.open(req, body.page_encoding)  # a 4xx/429/502 here, before any stream
        return StreamingResponse(
            token_lines(req, a.decode(req, handshake.pages(req)), "decode", t0, handshake.stats, handshake),
            media_type="application/x-ndjson",
        )

    @api.delete("/v1/requests/{request_id}")
    async def cancel_request(request_id: str):
        return {"request_id": request_id, "cancelled": slot.adapter.cancel(request_id)}

    @api.get("/v1/bench/pages")
    async def bench_pages(count: int = 100):
        if not 1 <= count <= 100_000:
            raise RequestError("count must be in 1..100000")
        g = slot.adapter.geometry
        page = make_page(g, 0, np.random.default_rng(0).standard_normal(g.page_shape).astype("<f2"))
        hashed = xxhash.xxh3_64(page.data)  # one payload under many headers: hash it once
        contract = slot.adapter.contract.fingerprint_bytes

        async def frames() -> AsyncIterator[bytes]:
            for i in range(count):
                page.index = i
                yield encode_frame(page, contract=contract, room=b"\0" * 16, tokens=b"\0" * 16, payload_state=hashed)
            yield done_frame(
                PrefillDone(first_token=0, kv_tokens=count * g.page_tokens, pages=count, prefill_seconds=0.0)
            )

        return PageStreamResponse(frames())

    @api.post("/v1/bench/link")
    async def bench_link(body: BenchLinkBody):
        """Pull synthetic pages from `peer` through the decoder's own receiver (every frame
        checked), as a decode pulls a room: the link from that prefiller to this decoder."""
        g = slot.adapter.geometry
        client = peer(body.peer)
        expect = FrameExpectation(slot.adapter.contract.fingerprint_bytes, b"\0" * 16, b"\0" * 16, g)
        try:
            rtts = []
            for _ in range(5):
                t0 = time.perf_counter()
                await client.healthz()
                rtts.append(time.perf_counter() - t0)
            count = -(-body.megabytes * 1_000_000 // g.page_bytes)
            t0 = time.perf_counter()
            async with client.page_stream("", expect, path=f"/v1/bench/pages?count={count}") as stream:
                async for _ in stream:
                    pass
            seconds = time.perf_counter() - t0
        except TransportError as e:
            raise FrameError(f"could not pull pages from {body.peer}: {type(e).__name__}: {e}") from e
        return {
            "peer": body.peer,
            "bytes": stream.bytes_read,
            "seconds": seconds,
            "bytes_per_second": stream.bytes_read / seconds,
            "rtt_seconds": sorted(rtts)[2],
        }

    app.include_router(api)
    return app
