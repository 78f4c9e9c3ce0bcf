"""Tokens out: /v1/decode (the one request of a P/D pair, or this engine alone), /v1/generate
(this engine alone) and cancelling either (DELETE /v1/requests/{request_id})."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter

from engine_adapters.base import EngineRequest
from tandem_protocol.api import DecodeBody, GenerateBody
from tandem_protocol.errors import RequestError

from ..admission import Ticket
from ..deps import KEYED, Agent, Slot
from ..handshake import Handshake
from ..state import AgentState
from ..token_stream import NDJSONResponse, token_lines

router = APIRouter(dependencies=KEYED)


@router.post("/v1/generate")
async def generate(body: GenerateBody, agent: Agent):
    adapter = agent.slot.adapter
    req = EngineRequest(body.request_id or uuid.uuid4().hex, body.token_ids, body.sampling, cache_salt=body.cache_salt)
    adapter.validate(req, generates=True)
    return alone(agent, req, await admit(agent, req))


async def admit(agent: AgentState, req: EngineRequest) -> Ticket:
    """The request's KV (prompt plus max_tokens) and a sequence slot on this decoder: 400 if it can
    never fit, a FIFO wait, then 429 (admission.py)."""
    token_bytes = agent.slot.adapter.geometry.token_bytes
    return await agent.admission.admit((len(req.token_ids) + req.sampling.max_tokens) * token_bytes)


def alone(agent: AgentState, req: EngineRequest, ticket: Ticket) -> NDJSONResponse:
    """This engine's own answer: it computes the prompt itself."""
    adapter = agent.slot.adapter
    lines = token_lines(adapter, agent.metrics, req, adapter.generate(req), "generate", time.perf_counter(), {})
    return NDJSONResponse(lines, release=ticket.release)


@router.post("/v1/decode")
async def decode(body: DecodeBody, agent: Agent):
    """The one request of a P/D pair: checked here, then the handoff is created on the
    prefiller and its pages pulled as they come (ARCHITECTURE.md, "One request")."""
    adapter = agent.slot.adapter
    mode = body.mode or adapter.decoder_modes[0]
    if mode not in adapter.decoder_modes:
        raise RequestError(f"{adapter.name} cannot decode in {mode.value} mode")
    req = EngineRequest(
        body.request_id or uuid.uuid4().hex, body.token_ids, body.sampling, mode, cache_salt=body.cache_salt
    )
    adapter.validate(req, generates=True)  # context length, sampling fields: refused before P computes
    ticket = await admit(agent, req)  # P is asked only once this decoder has room for the request
    if body.prefill_url is None:
        return alone(agent, req, ticket)
    t0 = time.perf_counter()
    handshake = Handshake(
        adapter, agent.peer(body.prefill_url, body.prefill_fingerprint), body.prefill_url, agent.metrics
    )
    try:
        await adapter.hold_prefix(req)  # pages this engine kept are not sent again (a delta handoff)
        await handshake.open(req, body.page_encoding)  # a 4xx/429/502 here, before any stream
    except BaseException:
        adapter.release_prefix(req)
        ticket.release()
        raise
    tokens = adapter.decode(req, handshake.pages())
    lines = token_lines(adapter, agent.metrics, req, tokens, "decode", t0, handshake.stats, handshake)

    def release() -> None:  # the one place all are released once the stream opened
        handshake.release()
        adapter.release_prefix(req)  # held still only if the stream was never read
        ticket.release()

    return NDJSONResponse(lines, release=release)


@router.delete("/v1/requests/{request_id}")
async def cancel_request(request_id: str, slot: Slot):
    return {"request_id": request_id, "cancelled": slot.adapter.cancel(request_id)}
