"""The page link's benchmark: GET /v1/bench/pages serves synthetic pages (`tandem agent
bench-link`), POST /v1/bench/link pulls them from a peer (`tandem bench ttft --panel`)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import numpy as np
import xxhash
from fastapi import APIRouter

from engine_adapters.base import EngineAdapter
from tandem_protocol.api import BenchLinkBody
from tandem_protocol.client import AgentClient, TransportError
from tandem_protocol.errors import FrameError, RequestError
from tandem_protocol.handoff import PrefillDone
from tandem_protocol.http_server import PageStreamResponse
from tandem_protocol.pages import FrameExpectation, encode_frame, make_page
from tandem_protocol.wire import done_frame

from ..deps import KEYED, Agent

router = APIRouter(dependencies=KEYED)


def synthetic_frames(adapter: EngineAdapter, count: int) -> AsyncIterator[bytes]:
    g = adapter.geometry
    page = make_page(g, 0, np.random.default_rng(0).standard_normal(g.page_shape).astype("<f2"))
    hashed = xxhash.xxh3_64(page.data)  # one payload under many headers: hash it once
    contract = adapter.contract.fingerprint_bytes

    async def frames() -> AsyncIterator[bytes]:
        for i in range(count):
            page.index = i
            yield encode_frame(page, contract=contract, handoff_id=b"\0" * 16, tokens=b"\0" * 16, payload_state=hashed)
        yield done_frame(PrefillDone(first_token=0, kv_tokens=count * g.page_tokens, pages=count, prefill_seconds=0.0))

    return frames()


@router.get("/v1/bench/pages")
async def bench_pages(agent: Agent, count: int = 100):
    if not 1 <= count <= 100_000:
        raise RequestError("count must be in 1..100000")
    return PageStreamResponse(synthetic_frames(agent.slot.adapter, count))


async def round_trip(client: AgentClient) -> float:
    """The median of five /healthz round trips."""
    rtts = []
    for _ in range(5):
        t0 = time.perf_counter()
        await client.healthz()
        rtts.append(time.perf_counter() - t0)
    return sorted(rtts)[2]


@router.post("/v1/bench/link")
async def bench_link(body: BenchLinkBody, agent: Agent):
    """Pull synthetic pages from `peer` through the decoder's own receiver (every frame
    checked), as a decode pulls a handoff's pages: the link from that prefiller to this decoder."""
    adapter = agent.slot.adapter
    g = adapter.geometry
    client = agent.peer(body.peer, body.peer_fingerprint)
    expect = FrameExpectation(adapter.contract.fingerprint_bytes, b"\0" * 16, b"\0" * 16, g)
    try:
        rtt = await round_trip(client)
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
        "rtt_seconds": rtt,
        "page_bytes": g.page_bytes,
    }
