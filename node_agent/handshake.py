"""The decoder's side of a P/D request: it creates the handoff on the prefiller, feeds the
prefiller's pages to its engine, and lets go of the handoff however the request ends.
The exchange is drawn in ARCHITECTURE.md ("One request")."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

from engine_adapters.base import EngineAdapter, EngineRequest
from tandem_protocol.client import AgentClient, AgentHTTPError, TransportError
from tandem_protocol.contract import token_digest
from tandem_protocol.errors import FrameError, TandemError
from tandem_protocol.handoff import PrefillDone
from tandem_protocol.page_receiver import PageStream
from tandem_protocol.pages import FrameExpectation, KVPage

from .metrics import Metrics


class PrefillerFailed(TandemError):
    """The prefiller is unreachable or failed to start the handoff: nothing was computed here, so
    the panel may serve the request on this decoder alone."""

    status = 502


class PrefillerUnreachable(PrefillerFailed):
    pass


class PrefillerRefused(TandemError):
    """The prefiller refused the handoff (4xx): its status, and its Retry-After for a busy budget."""

    def __init__(self, url: str, e: AgentHTTPError):
        super().__init__(f"the prefiller {url} refused the handoff: {e}")
        self.status, self.retry_after, self.kind, self.detail = e.status, e.retry_after, e.kind, e.detail


# Handoff cancels still running after their request ended (a task nobody references may be
# collected before it runs).
_releases: set[asyncio.Task] = set()


class Handshake:
    """One P/D request on the decoder: `open` the handoff, iterate `pages`, then `release`."""

    def __init__(self, adapter: EngineAdapter, prefiller: AgentClient, url: str, metrics: Metrics):
        self.adapter, self.prefiller, self.url, self.metrics = adapter, prefiller, url, metrics
        self.handoff_id = uuid.uuid4().hex
        self._attached = AsyncExitStack()  # the page stream, from `open` until the pages end
        self._stream: PageStream | None = None
        self.failed = False  # the page stream failed (the prefiller's side or the link)
        self.finished = False  # the prefiller sent its last frame: it has let go of the handoff
        self.stats = {
            "pages": 0,
            "wire_bytes": 0,
            "kv_tokens": 0,
            "prefill_seconds": None,
            "first_page_at": None,
            "last_page_at": None,
            "prefill_finished_at": None,
            "have_pages": 0,  # pages this decoder held already: not sent (a delta handoff)
            "prefill_cached_tokens": 0,  # prompt tokens the prefiller took from its cache
        }

    async def open(self, req: EngineRequest, page_encoding: str) -> None:
        """Create the handoff on the prefiller with this decoder's own contract and mode, then
        attach as its reader at once: the prefiller's lease (pages nobody reads) ends there, and
        the first pages come in while this engine gets ready. A refusal (4xx) or a failure is
        raised before any token stream starts."""
        self.stats["have_pages"] = req.have_pages
        try:
            # One attempt: the contract sent is this engine's live one, so a 409 (another model
            # contract, or the prefiller switching engines) would be the same on a second try.
            created = await self.prefiller.create_handoff(
                handoff_id=self.handoff_id,
                token_ids=req.token_ids,
                sampling=req.sampling.model_dump(mode="json"),
                mode=req.mode.value,
                contract=self.adapter.contract.fingerprint,
                page_encoding=page_encoding,
                have_pages=req.have_pages,
                # P's cache serves and keeps the prompt under the request's salt (none: unsalted,
                # and the body as an agent without salts takes it)
                **({"cache_salt": req.cache_salt} if req.cache_salt else {}),
            )
        except AgentHTTPError as e:
            if e.status < 500:
                raise PrefillerRefused(self.url, e) from None
            raise PrefillerFailed(f"prefiller failed: {e}") from None
        except TransportError as e:
            raise PrefillerUnreachable(f"prefiller unreachable: {self.url}: {type(e).__name__}: {e}") from None
        expect = FrameExpectation(
            self.adapter.contract.fingerprint_bytes,
            bytes.fromhex(self.handoff_id),
            token_digest(req.token_ids),
            self.adapter.geometry,
            keep_coded=self.adapter.decodes_coded,
        )
        try:
            stream = self.prefiller.page_stream(self.handoff_id, expect, token=created["read_token"])
            self._stream = await self._attached.enter_async_context(stream)
        except (AgentHTTPError, *TransportError) as e:
            self.release()  # the handoff was created: end it now rather than at its lease
            raise PrefillerFailed(f"the page stream from {self.url} did not start: {type(e).__name__}: {e}") from None

    async def pages(self) -> AsyncIterator[KVPage | PrefillDone]:
        """The handoff's pages, each checked against what this decoder expects, then PrefillDone."""
        stats, stream = self.stats, self._stream
        try:
            async with self._attached:  # the connection closes when the pages end, or the request
                async for item in stream:
                    self.metrics.bytes_received.inc(stream.bytes_read - stats["wire_bytes"])
                    stats["wire_bytes"] = stream.bytes_read
                    if isinstance(item, KVPage):
                        stats["pages"] += 1
                        stats["last_page_at"] = time.time()
                        stats["first_page_at"] = stats["first_page_at"] or stats["last_page_at"]
                        self.metrics.pages_received.inc()
                        self.metrics.imported_tokens.inc(item.valid_tokens)
                    else:
                        self.finished = True
                        stats.update(
                            kv_tokens=item.kv_tokens,
                            prefill_seconds=item.prefill_seconds,
                            prefill_finished_at=item.finished_at,
                            prefill_cached_tokens=item.cached_tokens,
                        )
                    yield item
        except TransportError as e:
            self.failed = True
            raise FrameError(
                f"the page stream from {self.url} broke off ({type(e).__name__}: {e}) "
                f"after {stats['pages']} whole page(s): nothing was decoded"
            ) from e
        except (TandemError, AgentHTTPError):  # a damaged page, the prefiller's error frame, a 404
            self.failed = True
            raise

    def release(self) -> None:
        """Close the page stream if it is still open, and cancel the handoff on the prefiller
        unless it already ended. Called once: by `open` when the stream does not start, else by
        the response once it ends (token_stream.NDJSONResponse). Runs in its own task: the
        request's task may be the one being cancelled (its client hung up)."""
        task = asyncio.get_running_loop().create_task(self._release())
        _releases.add(task)
        task.add_done_callback(_releases.discard)

    async def _release(self) -> None:
        await self._attached.aclose()  # nothing left to close once the pages were read
        if self.finished:
            return
        try:
            await self.prefiller.cancel_handoff(self.handoff_id)
        except (AgentHTTPError, *TransportError):
            pass  # a prefiller that is gone holds nothing; one that lives ends the handoff at its lease
