"""A prefill/decode pair inside one process: two adapters joined by framed pages in a queue.

This is the data path of a real P/D request without the network: P's pages are framed with
the wire codec, checked on receipt (checksum, contract, handoff_id, token digest, geometry) and fed
to D while P is still computing later chunks. `make run` uses it until the agent's HTTP
transport exists, and the tests use it to check engines against each other.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from engine_adapters.base import EngineAdapter, EngineRequest
from tandem_protocol.contract import token_digest
from tandem_protocol.handoff import FirstTokenMode, PrefillDone
from tandem_protocol.pages import RAW, FrameExpectation, KVPage, decode_frame, frame_bytes
from tandem_protocol.sampling import SamplingParams

_QUEUE_PAGES = 64


@dataclass
class PairStats:
    pages: int = 0  # pages sent
    have_pages: int = 0  # pages the decoder held already, not sent (a delta handoff)
    wire_bytes: int = 0
    kv_tokens: int = 0
    prefill_seconds: float = 0.0
    ttft_seconds: float | None = None
    page_arrivals: list[float] = field(default_factory=list)  # perf_counter() as each page was imported
    token_logprobs: list = field(default_factory=list)  # the decoder's, where `sampling.logprobs` asks


async def run_pair(
    prefiller: EngineAdapter,
    decoder: EngineAdapter,
    token_ids: list[int],
    sampling: SamplingParams,
    mode: FirstTokenMode | None = None,
    stats: PairStats | None = None,
    encoding: int = RAW,
    cache_salt: str | None = None,
) -> AsyncIterator[int]:
    """Stream the tokens of a P/D request: `prefiller` runs the prompt, `decoder` the answer;
    `encoding`: how the pages travel (pages.ENCODINGS); `cache_salt`: both prefix caches' namespace."""
    decoder.contract.check_same(prefiller.contract)
    mode = mode or decoder.decoder_modes[0]
    stats = stats if stats is not None else PairStats()
    request_id = uuid.uuid4().hex
    handoff_id, digest = uuid.uuid4().bytes, token_digest(token_ids)
    expect = FrameExpectation(
        contract=decoder.contract.fingerprint_bytes,
        handoff_id=handoff_id,
        tokens=digest,
        geometry=decoder.geometry,
        keep_coded=decoder.decodes_coded,
    )
    # Distinct ids per role: one engine may serve both roles of a pair.
    p_req = EngineRequest(f"{request_id}-p", list(token_ids), sampling, mode, cache_salt=cache_salt)
    d_req = EngineRequest(f"{request_id}-d", list(token_ids), sampling, mode, cache_salt=cache_salt)
    d_req.token_logprobs = stats.token_logprobs
    wire: asyncio.Queue = asyncio.Queue(_QUEUE_PAGES)
    t0 = time.perf_counter()
    await decoder.hold_prefix(d_req)  # a delta handoff: P sends only the pages D lacks
    p_req.have_pages = stats.have_pages = d_req.have_pages

    async def produce() -> None:
        try:
            async with aclosing(prefiller.prefill(p_req)) as items:
                async for item in items:
                    if isinstance(item, KVPage) and item.index < p_req.have_pages:
                        continue  # as the agent does: D holds it
                    if isinstance(item, KVPage):
                        frame = frame_bytes(
                            item,
                            contract=prefiller.contract.fingerprint_bytes,
                            handoff_id=handoff_id,
                            tokens=digest,
                            encoding=encoding,
                        )
                        stats.wire_bytes += len(frame)
                        await wire.put(frame)
                    else:
                        await wire.put(item)
        except Exception as e:  # handed to the decoder, which fails the request with it
            await wire.put(e)
        finally:
            await wire.put(None)

    async def receive() -> AsyncIterator[KVPage | PrefillDone]:
        while (item := await wire.get()) is not None:
            if isinstance(item, Exception):
                raise item
            if isinstance(item, PrefillDone):
                stats.prefill_seconds, stats.kv_tokens = item.prefill_seconds, item.kv_tokens
                yield item
                continue
            _, page = decode_frame(item, expect)
            stats.pages += 1
            yield page
            stats.page_arrivals.append(time.perf_counter())

    producer = asyncio.create_task(produce())
    try:
        async with aclosing(decoder.decode(d_req, receive())) as tokens:
            async for token in tokens:
                if stats.ttft_seconds is None:
                    stats.ttft_seconds = time.perf_counter() - t0
                yield token
    finally:
        decoder.release_prefix(d_req)  # held still only if the decode never ran
        prefiller.cancel(p_req.request_id)
        if not producer.done():
            producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
