"""What a node is and how it is doing: /healthz and /v1/identity (open), /v1/info, /v1/status,
/metrics and /v1/openapi.json (behind the cluster key)."""

from __future__ import annotations

import time

import psutil
from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from tandem_protocol.auth import IDENTITY_PATH, IdentityAnswer, IdentityChallenge, canonical_address, identity_answer

from ..deps import KEYED, Agent, AgentMetrics, Config
from ..metrics import Metrics
from ..state import AgentState

open_router = APIRouter()
router = APIRouter(dependencies=KEYED)


@open_router.get("/healthz")
async def healthz():
    return {"ok": True}


@open_router.post(IDENTITY_PATH)
async def identity(body: IdentityChallenge, request: Request, config: Config) -> IdentityAnswer:
    """No key: a panel checks, before it sends the key here, that this is the node it knows."""
    host, port = request.scope["server"][:2]  # this connection's own socket: a client cannot choose it
    address = body.address if body.address in config.advertised else canonical_address(host, port)
    return identity_answer(config.cluster_key, body.nonce, config.node_id, address, config.tls_fingerprint)


@router.get("/v1/info")
async def get_info(agent: Agent):
    return agent.info()


@router.get("/v1/openapi.json")
async def openapi(request: Request):
    return request.app.openapi()


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


def totals(agent: AgentState) -> dict:
    v, metrics = Metrics.value, agent.metrics
    return {
        "prefills_started": agent.handoffs.prefill_calls,
        "handoffs_created": v(metrics.handoffs_created),
        "pages_sent": v(metrics.pages_sent),
        "bytes_sent": v(metrics.bytes_sent),
        "pages_received": v(metrics.pages_received),
        "bytes_received": v(metrics.bytes_received),
        "imported_tokens": v(metrics.imported_tokens),
        "generated_tokens": v(metrics.generated_tokens),
    }


@router.get("/v1/status")
async def get_status(agent: Agent):
    budget, handoffs, adapter = agent.budget, agent.handoffs, agent.slot.adapter
    return {
        **agent.info(),
        "uptime_seconds": round(time.time() - agent.started, 1),
        "budget": {
            "capacity": budget.capacity,
            "reserved": budget.reserved,
            "staged": handoffs.staged_bytes(),  # pages in host memory now, within `reserved`
            "waiting": budget.waiting,
            "waiting_bytes": budget.waiting_bytes,
        },
        "decode": agent.admission.status(),
        "prefix_cache": adapter.prefix_cache_status(),
        "open_handoffs": len(handoffs.handoffs),
        "handoffs": handoffs.describe(),
        "active_requests": adapter.active_requests,
        "engine_stats": await adapter.engine_stats(),
        "process": process_memory(),
        "totals": totals(agent),
    }


@router.get("/metrics")
async def get_metrics(metrics: AgentMetrics):
    return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")
