"""The node agent's HTTP API (FastAPI). One engine, pages in and out, tokens out.

Routes (all but /healthz and /v1/identity need `Authorization: Bearer <cluster key>`), one
module of `node_agent/api/` per resource:

    GET    /healthz                        liveness, no key                                 info.py
    POST   /v1/identity                    no key: proof of holding it (tandem_protocol/auth.py)
    GET    /v1/info                        node, engine, model contract, protocol version, modes
    GET    /v1/status                      info + budget + open handoffs + totals (JSON)
    GET    /metrics                        the same as Prometheus text
    GET    /v1/openapi.json                the API's OpenAPI document
    GET    /v1/models/local                checkpoints in this node's model roots          config.py
    POST   /v1/config                      switch engine, model, context length, staging budget
    POST   /v1/tokenize                    chat messages or text -> token ids             tokenize.py
    POST   /v1/handoffs                    P: reserve budget, start prefill of a handoff      handoffs.py
    GET    /v1/handoffs/{handoff_id}/pages P: the handoff's page stream (one reader)
    DELETE /v1/handoffs/{handoff_id}       P: cancel a handoff (idempotent)
    POST   /v1/decode                      D: the one request of a P/D pair: D creates    decode.py
                                           the handoff on the prefiller, pulls its pages, streams tokens
    POST   /v1/generate                    this engine alone: prefill + decode, stream tokens
    DELETE /v1/requests/{request_id}       cancel a running decode/generate (idempotent)
    GET    /v1/bench/pages                 synthetic page stream for `tandem agent bench-link` bench.py
    POST   /v1/bench/link                  pull synthetic pages from a peer: the peer->this link's
                                           page throughput and round trip (`tandem bench ttft --panel`)

How a P/D request goes between panel, decoder and prefiller: ARCHITECTURE.md, "One request".
Token streams are NDJSON (`token_stream.py`). Errors before a stream starts are JSON
`{"error": {"type", "message"}}` with a fitting status code (`errors.py`).
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI

from engine_adapters.base import EngineAdapter
from tandem_protocol.auth import key_matches
from tandem_protocol.gate import Gate
from tandem_protocol.pages import PROTOCOL_VERSION

from .api import bench, config, decode, handoffs, info, tokenize
from .engine_slot import Loader
from .errors import add_error_handlers, refusal
from .state import AgentConfig, AgentState

log = logging.getLogger("tandem.agent")

# A control request is JSON (token ids, settings): 8 MiB holds a prompt of over a million tokens.
# Pages never travel in a request body (the decoder pulls them with a GET).
MAX_BODY_BYTES = 8 << 20
OPEN_PATHS = ("/healthz", "/v1/identity")  # the routes that need no cluster key

# The order of the routes in the OpenAPI document
ROUTERS = (
    info.open_router,
    info.router,
    config.router,
    tokenize.router,
    handoffs.router,
    handoffs.pages_router,
    decode.router,
    bench.router,
)


def create_app(adapter: EngineAdapter, config: AgentConfig, discovery=None, loader: Loader | None = None) -> FastAPI:
    """The agent's ASGI app. `discovery` (optional) is started and stopped with the app; `loader`
    (optional) lets a panel switch this node's engine or model (POST /v1/config)."""
    state = AgentState(adapter, config, discovery, loader)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.start()
        log.info("tandem agent %s ready on %s", config.name, config.url)
        try:
            yield
        finally:
            await state.aclose()

    # The OpenAPI document is served behind the key (/v1/openapi.json): only /healthz is open.
    app = FastAPI(
        title="Tandem node agent",
        version=str(PROTOCOL_VERSION),
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.agent = state
    # the cluster key and the body's size, checked before a byte of the body is read
    app.add_middleware(
        Gate,
        limit=MAX_BODY_BYTES,
        # a page stream's credential is its handoff's read token, which the route checks (no body)
        keyed=lambda path: path not in OPEN_PATHS and not handoffs.PAGES_PATH.match(path),
        key_valid=lambda token: key_matches(token, config.cluster_key),
        refusal=refusal,
    )
    add_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    return app
