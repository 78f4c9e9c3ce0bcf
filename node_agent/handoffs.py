"""Prefill-side handoffs: a prompt's pages, staged until the decoder has read them.

Life of a handoff (one "handoff_id"):

1. `create` checks the request (a prompt whose KV the engine itself cannot hold is refused at
   once), then reserves its *window* of the staging budget *before any compute*: room for
   `min(pages, budget)` pages, waited for in FIFO order up to a deadline when the budget is
   busy. The pages are those the decoder lacks: it names how many leading pages it holds
   already (`have_pages`, a delta handoff), and only later ones are sent. It then starts
   prefill in a task and a lease timer, which the decoder's arrival cancels (a lease bounds how
   long pages wait for a reader, not a prefill).
2. The task frames each page as prefill produces it and queues it; the decoder's `stream`
   call sends the queue as it fills (a heartbeat each second it stays empty), then the final
   frame (P's first token) or an error frame. The window (`engine_adapters.base.PageWindow`)
   bounds the pages between the engine and the wire: the engine takes a unit before it copies
   a page out of its KV memory, and the unit comes back once the page is in the socket (not when
   it is queued for a sender thread: what a sender holds counts). So a prompt of any size streams
   through the budget; a slow link pauses export while the engine computes on, its pages waiting
   in the engine's own KV memory.
3. `finish` ends the handoff on every path — read to the end, cancelled, decoder gone, lease
   expired: it stops prefill, waits for the engine's in-flight work to finish (so engine memory
   is released after it), drops staged pages and returns the reservation. It is idempotent.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future
from contextlib import aclosing
from dataclasses import dataclass, field

from engine_adapters import failpoints
from engine_adapters.base import EngineAdapter, EngineRequest, PageWindow
from tandem_protocol.auth import key_matches
from tandem_protocol.contract import token_digest
from tandem_protocol.errors import Cancelled, RequestError, TandemError
from tandem_protocol.handoff import FirstTokenMode, kv_tokens
from tandem_protocol.http_server import TrackedFrame
from tandem_protocol.pages import LOSSY, RAW, KVPage, codec_pool, encode_frame
from tandem_protocol.sampling import SamplingParams
from tandem_protocol.wire import DONE_MAGIC, HEARTBEAT_FRAME, HEARTBEAT_SECONDS, done_frame, error_frame

from .budget import BudgetExceeded, Reservation, StagingBudget
from .engine_slot import EngineSlot
from .metrics import Metrics

log = logging.getLogger("tandem.handoffs")


class HandoffError(TandemError):
    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


@dataclass
class Handoff:
    handoff_id: str
    request: EngineRequest
    reservation: Reservation  # the window's room in the staging budget
    window: PageWindow
    created: float = field(default_factory=time.monotonic)
    frames: asyncio.Queue = field(default_factory=asyncio.Queue)
    task: asyncio.Task | None = None
    lease: asyncio.TimerHandle | None = None
    reader_attached: bool = False
    state: str = "prefilling"
    pages_sent: int = 0
    bytes_sent: int = 0
    encoding: int = RAW  # how the pages travel (engine_adapters/pages.py)
    # The capability to read this handoff's pages (and nothing else), given to the decoder that
    # created it: the page stream's credential is not the cluster key.
    read_token: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    pages: int = 0  # pages it sends: those after the decoder's `have_pages`


class HandoffManager:
    def __init__(self, slot: EngineSlot, budget: StagingBudget, metrics: Metrics, ttl: float = 60.0):
        self.slot = slot
        self.budget = budget
        self.metrics = metrics
        self.ttl = ttl
        self.handoffs: dict[str, Handoff] = {}
        self.waiting: dict[str, asyncio.Task] = {}  # handoffs waiting for budget, cancellable by id
        self.prefill_calls = 0  # how many prefills reached the engine (tests assert on it)
        self._engine_bytes: tuple[EngineAdapter, int] | None = None  # the KV the engine can hold

    @property
    def adapter(self) -> EngineAdapter:
        return self.slot.adapter  # the engine cannot change while a handoff is open (EngineSlot)

    def pages_to_send(self, prompt_tokens: int, mode: FirstTokenMode, have_pages: int = 0) -> int:
        """The pages a handoff sends; RequestError if the decoder claims to hold more than the
        whole pages of the KV it needs."""
        g = self.adapter.geometry
        tokens = kv_tokens(prompt_tokens, mode)
        if have_pages > tokens // g.page_tokens:
            raise RequestError(
                f"have_pages {have_pages} exceeds the {tokens // g.page_tokens} whole pages of this "
                f"prompt's {tokens}-token KV (a partly filled page is always sent)"
            )
        return g.pages_for(tokens) - have_pages

    async def check_engine_holds(self, tokens: int) -> None:
        """413 for a prompt whose KV (FP16) is more than the engine can hold for a request: the
        one size limit left, since the staging budget bounds a window, not the prompt."""
        if self._engine_bytes is None or self._engine_bytes[0] is not self.adapter:
            # off the loop: an engine may ask its device, behind a running chunk
            self._engine_bytes = (self.adapter, await asyncio.to_thread(self.adapter.kv_budget_bytes))
        need, can = tokens * self.adapter.geometry.token_bytes, self._engine_bytes[1]
        if need > can:
            raise BudgetExceeded(
                f"this prompt's KV is {need:,} bytes at FP16, more than the {self.adapter.name} engine "
                f"on this node can hold ({can:,} bytes): send a shorter prompt or use a node with more memory"
            )

    def window_pages(self, pages: int) -> int:
        """The pages a handoff may hold in host memory at once: all of them, up to the budget."""
        fit = self.budget.capacity // self.adapter.geometry.page_bytes
        if fit < 1:
            raise BudgetExceeded(
                f"the staging budget ({self.budget.capacity:,} bytes) is smaller than one page of this "
                f"model ({self.adapter.geometry.page_bytes:,} bytes): raise --staging-bytes"
            )
        return min(pages, fit)

    async def create(
        self,
        handoff_id: str,
        token_ids: list[int],
        sampling: SamplingParams,
        mode: FirstTokenMode,
        wait_timeout: float,
        encoding: int = RAW,
        have_pages: int = 0,
        cache_salt: str | None = None,
    ) -> Handoff:
        request = EngineRequest(
            f"handoff-{handoff_id}",
            list(token_ids),
            sampling,
            mode,
            have_pages=have_pages,
            cache_salt=cache_salt,
            lossy_encoding=encoding if encoding in LOSSY else None,
        )
        self.adapter.validate(request, generates=False)
        pages = self.pages_to_send(len(token_ids), mode, have_pages)
        # refused before any wait or compute: a prompt the engine cannot hold, a budget below a page
        await self.check_engine_holds(kv_tokens(len(token_ids), mode))
        window = self.window_pages(pages)
        if handoff_id in self.handoffs:  # after the one await above: nothing comes between these and the wait
            raise HandoffError(f"handoff {handoff_id} already exists on this node", 409)
        if handoff_id in self.waiting:
            raise HandoffError(f"handoff {handoff_id} is already waiting for budget on this node", 409)
        wait = asyncio.ensure_future(self.budget.reserve(window * self.adapter.geometry.page_bytes, wait_timeout))
        self.waiting[handoff_id] = wait
        try:
            reservation = await wait
        except asyncio.CancelledError:
            if wait.cancelled() and not asyncio.current_task().cancelling():
                raise Cancelled(f"handoff {handoff_id} was cancelled while waiting for staging budget") from None
            raise
        finally:
            self.waiting.pop(handoff_id, None)
        request.window = PageWindow(max(1, window))
        handoff = Handoff(handoff_id, request, reservation, request.window, encoding=encoding, pages=pages)
        self.handoffs[handoff_id] = handoff
        handoff.task = asyncio.create_task(self._produce(handoff), name=f"prefill-{handoff_id}")
        handoff.lease = asyncio.get_running_loop().call_later(self.ttl, self._expire, handoff_id)
        self.metrics.handoffs_created.inc()
        return handoff

    async def _produce(self, h: Handoff) -> None:
        contract = self.adapter.contract.fingerprint_bytes
        id_bytes, digest = bytes.fromhex(h.handoff_id), token_digest(h.request.token_ids)
        self.prefill_calls += 1
        perturb = failpoints.fires("perturb_k")  # test-only: this handoff's pages carry wrong K
        try:
            async with aclosing(self.adapter.prefill(h.request)) as items:
                async for item in items:
                    if isinstance(item, KVPage) and item.index < h.request.have_pages:
                        h.window.give()  # the decoder holds it (an engine that cannot skip computing it yields it)
                        continue
                    if perturb and isinstance(item, KVPage):
                        item = failpoints.perturb_k(item)
                    if isinstance(item, KVPage) and h.encoding == RAW:  # header + a view of the page's buffer
                        h.frames.put_nowait(encode_frame(item, contract=contract, handoff_id=id_bytes, tokens=digest))
                    elif isinstance(item, KVPage):  # queued as a future, in order: prefill goes on meanwhile
                        h.frames.put_nowait(
                            codec_pool().submit(
                                encode_frame,
                                item,
                                contract=contract,
                                handoff_id=id_bytes,
                                tokens=digest,
                                encoding=h.encoding,
                            )
                        )
                    else:
                        h.state = "prefilled"
                        h.frames.put_nowait(done_frame(item))
                        self.metrics.prefill_seconds.observe(item.prefill_seconds)
        except Cancelled as e:
            h.frames.put_nowait(error_frame("cancelled", str(e)))
        except TandemError as e:
            h.frames.put_nowait(error_frame(type(e).__name__, str(e)))
        except Exception as e:  # an engine crash must still end the stream with a reason
            log.exception("prefill of handoff %s failed", h.handoff_id)
            h.frames.put_nowait(error_frame("engine_error", f"prefill failed: {e}"))

    def may_read(self, handoff_id: str, read_token: str | None) -> bool:
        """Whether `read_token` is the read token of the open handoff `handoff_id` (constant time)."""
        h = self.handoffs.get(handoff_id)
        return h is not None and key_matches(read_token, h.read_token)

    async def stream(self, handoff_id: str) -> AsyncIterator[bytes]:
        """The handoff's frames for its one reader; ends the handoff however the reading ends."""
        h = self.handoffs.get(handoff_id)
        if h is None:
            raise HandoffError(f"no handoff {handoff_id} (never created, expired or already read)", 404)
        if h.reader_attached:
            raise HandoffError(f"handoff {handoff_id} is already being read by another decoder", 409)
        h.reader_attached = True
        if h.lease is not None:
            # The lease is for pages nobody reads; a reader that stops reading is the stall
            # timeout's business, and a prefill longer than the lease must still be read to the end.
            h.lease.cancel()
        h.state = "streaming" if h.state == "prefilling" else h.state
        return self._frames(h)

    async def _frames(self, h: Handoff) -> AsyncIterator[bytes]:
        outcome = "reader_gone"
        try:
            while True:
                try:  # asyncio.timeout, not wait_for: no task per frame on the send path
                    async with asyncio.timeout(HEARTBEAT_SECONDS):
                        frame = await h.frames.get()
                except TimeoutError:  # still prefilling: tell the reader the link is alive
                    yield HEARTBEAT_FRAME
                    continue
                if isinstance(frame, Future):  # a page being encoded
                    try:
                        frame = await asyncio.wrap_future(frame)
                    except Exception as e:  # e.g. an FP8 page with infinities
                        log.warning("page of handoff %s could not be encoded: %s", h.handoff_id, e)
                        frame = error_frame("engine_error", f"page encoding failed: {e}")
                if isinstance(frame, bytes):  # the final frame or an error frame
                    yield frame
                    outcome = "done" if frame[:4] == DONE_MAGIC else "failed"
                    return
                yield TrackedFrame(frame, functools.partial(self._page_written, h, len(frame[0]) + len(frame[1])))
        finally:
            await self.finish(h.handoff_id, outcome)

    def _page_written(self, h: Handoff, nbytes: int) -> None:
        """A page is in the socket (not merely queued for it): its room in the window is free."""
        h.window.give()
        h.pages_sent += 1
        h.bytes_sent += nbytes
        self.metrics.pages_sent.inc()
        self.metrics.bytes_sent.inc(nbytes)

    async def cancel(self, handoff_id: str) -> bool:
        wait = self.waiting.get(handoff_id)
        if wait is not None:
            wait.cancel()  # the reserve call returns nothing it held; `create` raises Cancelled
            self.metrics.handoffs_finished.labels(outcome="cancelled_waiting").inc()
            return True
        return await self.finish(handoff_id, "cancelled")

    def _expire(self, handoff_id: str) -> None:
        h = self.handoffs.get(handoff_id)
        if h is not None:
            log.warning("handoff %s expired after %.0f s with its pages unread", handoff_id, self.ttl)
            asyncio.ensure_future(self.finish(handoff_id, "expired"))

    async def finish(self, handoff_id: str, outcome: str) -> bool:
        """End a handoff and release everything it holds; False if it was already gone."""
        h = self.handoffs.pop(handoff_id, None)
        if h is None:
            return False
        # A separate, shielded task: when the caller is cancelled (a decoder hung up and the
        # server cancels its stream), the teardown still runs to the end.
        await asyncio.shield(asyncio.ensure_future(self._teardown(h, outcome)))
        return True

    async def _teardown(self, h: Handoff, outcome: str) -> None:
        h.state = outcome
        if h.lease is not None:
            h.lease.cancel()
        self.adapter.cancel(h.request.request_id)
        h.window.close()  # a prefill waiting for room to export stops waiting
        if h.task is not None:
            # Prefill stops at its next chunk boundary; the engine finishes in-flight work and
            # releases the session before the task ends, so memory is free when we return.
            await asyncio.shield(h.task)
        while not h.frames.empty():
            frame = h.frames.get_nowait()
            if isinstance(frame, Future):
                frame.cancel()  # not begun: never will be; begun: finishes and is dropped
        if h.reader_attached and outcome in ("cancelled", "expired", "shutdown"):
            # the reader may be waiting for its next frame: end its stream with the reason
            h.frames.put_nowait(error_frame(outcome, f"handoff {h.handoff_id} was {outcome} on the prefiller"))
        h.reservation.release()
        self.metrics.handoffs_finished.labels(outcome=outcome).inc()

    async def close(self) -> None:
        for handoff_id in list(self.handoffs):
            await self.finish(handoff_id, "shutdown")

    def staged_bytes(self, h: Handoff | None = None) -> int:
        """Bytes of pages in host memory now (taken from a window, not yet sent): one handoff's,
        or every open handoff's."""
        held = h.window.held if h is not None else sum(h.window.held for h in self.handoffs.values())
        return held * self.adapter.geometry.page_bytes

    def describe(self) -> list[dict]:
        now = time.monotonic()
        return [
            {
                "handoff_id": h.handoff_id,
                "state": h.state,
                "prompt_tokens": len(h.request.token_ids),
                "reserved_bytes": h.reservation.nbytes,
                "staged_bytes": self.staged_bytes(h),
                "pages_sent": h.pages_sent,
                "age_seconds": round(now - h.created, 3),
                "reader_attached": h.reader_attached,
            }
            for h in self.handoffs.values()
        ]
