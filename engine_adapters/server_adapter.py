"""The adapter side of engines that run as their own server (vLLM, SGLang): what both share.

Such an engine owns its KV cache, so the six in-process engine primitives of `base.EngineAdapter`
do not apply; the subclass implements prefill/decode/generate per request over HTTP, and pages
move through the bridge (engine_adapters/bridge.py). This class holds the server, the bridge and
the per-request cancel plumbing: `cancel()` may come from any thread and wakes the request's
waits at once.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np

from tandem_protocol.errors import Cancelled, FrameError, RequestError, TandemError
from tandem_protocol.handoff import PrefillDone
from tandem_protocol.pages import KVPage, make_page
from tandem_protocol.sampling import ALL_FIELDS

from .base import EngineAdapter, EngineRequest
from .bridge import END, Bridge, page_frame
from .engine_server import EngineServer


class ServerAdapter(EngineAdapter):
    engine_label = "engine"  # how messages name the engine
    # the server samples every token itself, with every parameter Tandem knows
    sampling = ALL_FIELDS
    first_token_sampling = ALL_FIELDS

    def _load(self) -> None:
        run_dir = Path(tempfile.mkdtemp(prefix=f"tandem-{self.name}-"))
        self.bridge = Bridge(run_dir / "bridge.sock", self.engine_label)
        self.server = self._server(run_dir)
        self.server.start()
        # request id -> (its event loop, an event set by cancel() from any thread)
        self._cancel_events: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Event]] = {}
        self._http, self._http_loop = None, None  # one aiohttp session, opened at first use

    def _server(self, run_dir: Path) -> EngineServer:
        raise NotImplementedError

    # The engine primitives are the engine's business: these adapters work per request.
    def new_session(self, capacity: int) -> Any:
        raise NotImplementedError

    def forward(self, session: Any, token_ids: list[int]) -> np.ndarray:
        raise NotImplementedError

    def export_kv(self, session: Any, start: int, end: int) -> np.ndarray:
        raise NotImplementedError

    def set_length(self, session: Any, length: int) -> None:
        raise NotImplementedError

    def import_kv(self, room: str, start: int, kv: np.ndarray) -> None:
        """Hand a checked page to the engine's loader (called by `_import_stream`)."""
        page = make_page(self.geometry, start // self.geometry.page_tokens, kv)
        self.bridge.rooms[room].outgoing.put(page_frame(page))

    def http(self):
        """The adapter's HTTP session to its own server (kept open: no connection set-up per request)."""
        import aiohttp

        loop = asyncio.get_running_loop()
        if self._http is None or self._http.closed or self._http_loop is not loop:
            # a session belongs to one event loop (tests drive adapters from several)
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
            self._http_loop = loop
        return self._http

    async def metrics(self) -> str | None:
        """The server's Prometheus text, or None while it is down or restarting."""
        import aiohttp

        try:
            async with self.http().get(self.server.url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
                return await r.text()
        except Exception:
            return None

    async def server_stats(self, gauges: dict[str, str]) -> dict:
        """Engine figures for the agent's status: the process (pid, restarts) and the server's
        Prometheus gauges named in `gauges` (metric -> key); nulls while it is down."""
        proc = self.server.proc
        stats = {
            "restarts": self.server.restarts,
            "pid": proc.pid if proc and proc.poll() is None else None,
            **{key: None for key in gauges.values()},
        }
        text = await self.metrics()
        for line in (text or "").splitlines():
            metric = line.split("{", 1)[0].split(" ", 1)[0]
            if metric in gauges:
                stats[gauges[metric]] = float(line.rsplit(" ", 1)[1])
        return stats

    def close(self) -> None:
        self.server.stop()
        self.bridge.close()
        if self._http is not None and not self._http.closed:
            try:
                asyncio.get_running_loop().create_task(self._http.close())
            except RuntimeError:  # no loop running (closed from a plain thread): the process is ending
                pass
        super().close()

    # ---- talking to the server ---------------------------------------------------------------
    generate_path = "/"

    def _top_k(self, sampling) -> int:
        """top_k as the server takes it: -1 (off) when unset or not below the vocabulary, where it
        keeps every token anyway (SGLang's scheduler died on a top_k past int32)."""
        return sampling.top_k if 0 < sampling.top_k < self.info.vocab_size else -1

    async def _answer_tokens(self, response, stream: bool) -> AsyncIterator[int]:
        """The new token ids of one answer from the server (engine-specific format)."""
        raise NotImplementedError
        yield 0

    async def _tokens(self, body: dict, out: asyncio.Queue, pages: asyncio.Queue | None = None) -> None:
        """Stream an answer's token ids into `out`, then None (or the exception). A prefill's page
        queue (`pages`) hears of a failure too, and of pages still missing 30 s after the server
        answered, so no wait outlives the request."""
        label = self.engine_label
        try:
            async with self.http().post(self.server.url + self.generate_path, json=body) as r:
                if r.status >= 400:
                    raise RequestError(f"{label} refused the request ({r.status}): {(await r.text())[:500]}")
                async for token in self._answer_tokens(r, body["stream"]):
                    out.put_nowait(token)
            out.put_nowait(None)
            if pages is not None:
                asyncio.get_running_loop().call_later(
                    30, pages.put_nowait, FrameError(f"{label} finished the prefill but not all of its pages arrived")
                )
        except asyncio.CancelledError:
            raise
        except Exception as e:  # connection refused or reset: the server is down or restarting
            error = (
                e
                if isinstance(e, TandemError)
                else TandemError(
                    f"{label} is not answering ({type(e).__name__}: {e}); log tail:\n{self.server.log_tail(5)}"
                )
            )
            out.put_nowait(error)
            if pages is not None:
                pages.put_nowait(error)

    async def _relay_prefill(
        self, req: EngineRequest, incoming: asyncio.Queue, export: int, out: asyncio.Queue, t0: float
    ) -> AsyncIterator[KVPage | PrefillDone]:
        """The engine's exported pages from the bridge, checked for order and trimmed to `export`
        tokens (an engine that always exports the whole prompt, for a recompute-last decoder),
        then PrefillDone with the first token of the engine's answer (from `out`)."""
        P, pages = self.geometry.page_tokens, self.geometry.pages_for(export)
        for index in range(pages):
            item = await self._wait(req, incoming.get())
            if item is END:
                raise FrameError(f"{self.engine_label} exported {index} of {pages} pages")
            if isinstance(item, Exception):
                raise item
            if item.index != index:
                raise FrameError(f"{self.engine_label} exported page {item.index} where {index} was expected")
            valid = min(P, export - index * P)
            if item.valid_tokens != valid:
                item = make_page(self.geometry, index, item.kv[:, :, :valid])
            # the last page leaves at the end of the engine's last prefill step: that is when it finished
            finished_at, seconds = time.time(), time.perf_counter() - t0
            yield item
        first = await self._next(req, out)
        yield PrefillDone(
            first_token=int(first), kv_tokens=export, pages=pages, prefill_seconds=seconds, finished_at=finished_at
        )

    # ---- per-request bookkeeping -----------------------------------------------------------
    async def _next(self, req: EngineRequest, out: asyncio.Queue):
        item = await self._wait(req, out.get())
        if isinstance(item, Exception):
            raise item
        return item

    async def _wait(self, req: EngineRequest, aw):
        """Await `aw` unless the request is cancelled first (cancel() wakes this)."""
        cancelled = self._cancel_events[req.request_id][1]
        getter = asyncio.ensure_future(aw)
        stopper = asyncio.ensure_future(cancelled.wait())
        try:
            await asyncio.wait({getter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
        if not getter.done():
            getter.cancel()
            raise Cancelled(f"request {req.request_id} was cancelled")
        return getter.result()

    def _start(self, req: EngineRequest) -> None:
        self._begin(req)
        self._cancel_events[req.request_id] = (asyncio.get_running_loop(), asyncio.Event())

    def _end(self, req: EngineRequest, task: asyncio.Task | None) -> None:
        if task is not None and not task.done():
            task.cancel()  # closes the HTTP request: the engine aborts it and frees its KV
        self._cancels.pop(req.request_id, None)
        self._cancel_events.pop(req.request_id, None)

    def cancel(self, request_id: str) -> bool:
        running = super().cancel(request_id)
        if request_id in self._cancel_events:
            loop, event = self._cancel_events[request_id]
            loop.call_soon_threadsafe(event.set)
        return running
