"""The prefiller's side of a P/D request: a decoder creates a handoff, reads its page stream and
cancels it (the decoder's side: `node_agent/handshake.py`)."""

from __future__ import annotations

import re

from fastapi import APIRouter, Header

from tandem_protocol.api import HandoffBody, HandoffCreated
from tandem_protocol.auth import bearer_token
from tandem_protocol.errors import ContractMismatch, RequestError
from tandem_protocol.http_server import PageStreamResponse
from tandem_protocol.pages import ENCODINGS, PROTOCOL_VERSION

from ..deps import KEYED, SAME_PROTOCOL, Handoffs, Slot
from ..errors import Unauthorized

router = APIRouter(dependencies=KEYED)
# The page stream's credential is the handoff's own read token, not the cluster key.
pages_router = APIRouter(dependencies=SAME_PROTOCOL)
PAGES_PATH = re.compile(r"^/v1/handoffs/[^/]+/pages$")


@router.post("/v1/handoffs", status_code=201)
async def create_handoff(body: HandoffBody, slot: Slot, handoffs: Handoffs) -> HandoffCreated:
    if body.protocol_version != PROTOCOL_VERSION:
        raise RequestError(
            f"decoder speaks Tandem protocol {body.protocol_version}, this prefiller speaks {PROTOCOL_VERSION}"
        )
    adapter = slot.adapter
    if body.contract != adapter.contract.fingerprint:
        raise ContractMismatch(
            ["contract fingerprint"],
            f"decoder's {body.contract[:16]}… differs from this "
            f"prefiller's {adapter.contract.fingerprint[:16]}…: compare /v1/info of both nodes",
        )
    h = await handoffs.create(
        body.handoff_id,
        body.token_ids,
        body.sampling,
        body.mode,
        body.wait_timeout,
        encoding=ENCODINGS[body.page_encoding],
        have_pages=body.have_pages,
        cache_salt=body.cache_salt,
    )
    return HandoffCreated(
        handoff_id=h.handoff_id, pages=h.pages, reserved_bytes=h.reservation.nbytes, read_token=h.read_token
    )


@pages_router.get("/v1/handoffs/{handoff_id}/pages")
async def handoff_pages(handoff_id: str, handoffs: Handoffs, authorization: str | None = Header(None)):
    if not handoffs.may_read(handoff_id, bearer_token(authorization)):
        raise Unauthorized(f"no open handoff {handoff_id} with this read token (wrong, expired or already read)")
    frames = await handoffs.stream(handoff_id)
    return PageStreamResponse(frames)


@router.delete("/v1/handoffs/{handoff_id}")
async def cancel_handoff(handoff_id: str, handoffs: Handoffs):
    return {"handoff_id": handoff_id, "cancelled": await handoffs.cancel(handoff_id)}
