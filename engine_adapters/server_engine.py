"""Engines that run as their own server process (vLLM, SGLang): one exchange template for both.

Such an engine owns its KV cache, so the adapter works per request: each operation is one HTTP
request to the engine's server, and pages move through the bridge (engine_adapters/bridge.py),
a unix socket between this process and the engine's KV plugin, one *room* per request:

    prefill   open an export room; POST the prompt with max_tokens 1 and the room; relay the
              pages the plugin writes into the room, in order, then PrefillDone with the first
              token of the server's answer. A page is read off the room only once the request's
              window has room for it (`_grant`): the rest wait in the engine's KV memory.
    decode    open an import room; POST the prompt (streaming) with the room; write the pages of
              the incoming stream into it as they pass their checks, then the end of the room
              (`_hand_over`); relay the server's tokens.
    generate  POST the prompt without a room (an engine may override: SGLang).

A subclass says how its server starts (`_server`), how a request body looks (`_body`), how an
answer carries tokens (`_answer_tokens`) and, where needed, which role a request needs
(`_role`). `cancel()` may come from any thread and wakes the request's waits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
import uuid
from abc import abstractmethod
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from tandem_protocol.errors import Cancelled, FrameError, RequestError, TandemError
from tandem_protocol.handoff import FirstTokenMode, PrefillDone, kv_tokens
from tandem_protocol.pages import KVPage, make_page
from tandem_protocol.sampling import ALL_FIELDS, SamplingParams, TokenLogprobs

from .base import EngineAdapter, EngineRequest, PageWindow
from .bridge import END, Bridge, Room, page_frame_parts
from .server_process import ServerProcess

STALL_SECONDS = 30  # a prefill's pages the agent has room for, missing this long after the answer: lost
_releases: set[asyncio.Task] = set()  # roles being let go of (a task nobody holds may be collected)


@dataclass
class SentDecode:
    """A decode's import room and the engine's answer to it (sent by `hold_prefix` where the engine
    says what its prefix cache holds, else by `decode`)."""

    room: str
    box: Room
    task: asyncio.Task | None = None
    out: asyncio.Queue | None = None
    role: contextlib.AsyncExitStack | None = None  # the engine's decode role, held (`_role`)


@dataclass(frozen=True)
class Transfer:
    """The bridge room a request's KV goes through: `op` "export" (a prefill) or "import" (a
    decode) of `tokens` tokens."""

    op: str
    room: str
    tokens: int


class ServerEngine(EngineAdapter):
    engine_label: ClassVar[str] = "engine"  # how messages name the engine
    generate_path: ClassVar[str] = "/"  # the server's generation endpoint
    exports_whole_prompt: ClassVar[bool] = False  # True: the engine exports every prompt token
    # True: the engine keeps a prefix cache of its own (on unless settings.prefix_caching is off)
    # and its plugin says, once it schedules a decode, how many prompt tokens it holds (a `matched`
    # connection on the bridge): `hold_prefix` sends the decode before the handshake.
    reports_prefix: ClassVar[bool] = False
    # the server samples every token itself, with every parameter Tandem knows
    sampling = ALL_FIELDS
    first_token_sampling = ALL_FIELDS

    # ---- what a subclass provides -------------------------------------------------------------
    @abstractmethod
    def _server(self, run_dir: Path) -> ServerProcess:
        """The engine's server process (not started), its files under `run_dir`."""

    @abstractmethod
    def _body(self, req: EngineRequest, max_tokens: int, stream: bool, transfer: Transfer | None) -> dict:
        """The JSON body of one generation request for `req`."""

    @abstractmethod
    def _answer_tokens(
        self, response, stream: bool, counts: EngineRequest | None
    ) -> AsyncIterator[tuple[int, TokenLogprobs | None]]:
        """The new tokens of one answer from the server (an aiohttp response), each with its
        log-probabilities where the request asked for them (else None); the prompt tokens the
        engine's own cache served go to `counts.cached_tokens` where given."""

    def _role(self, role: str) -> contextlib.AbstractAsyncContextManager:
        """Held while a request of `role` ("prefill"/"decode") runs (SGLang switches roles)."""
        return contextlib.nullcontext()

    def _new_room(self) -> str:
        return uuid.uuid4().hex

    def _hand_over(self, room: Room, done: PrefillDone) -> None:
        """Every page of a decode is in `room`: tell the engine's loader it has them all."""
        room.outgoing.put(END)

    # ---- the server and its bridge ----------------------------------------------------------
    def _load(self) -> None:
        run_dir = Path(tempfile.mkdtemp(prefix=f"tandem-{self.name}-"))
        self.bridge = Bridge(run_dir / "bridge.sock", self.engine_label)
        self.server = self._server(run_dir)
        self.server.start()
        # request id -> (its event loop, an event set by cancel() from any thread)
        self._cancel_events: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Event]] = {}
        self._http, self._http_loop = None, None  # one aiohttp session, opened at first use
        self._lookups = self._lookup_tokens = self._hit_tokens = 0  # hold_prefix's, reports_prefix engines

    def http(self):
        """The adapter's HTTP session to its own server (kept open: no connection set-up per request)."""
        import aiohttp

        loop = asyncio.get_running_loop()
        if self._http is None or self._http.closed or self._http_loop is not loop:
            # a session belongs to one event loop (tests drive adapters from several)
            self._http = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                headers={"Authorization": f"Bearer {self.server.api_key}"},  # the server's own key
            )
            self._http_loop = loop
        return self._http

    async def server_stats(self, gauges: dict[str, str]) -> dict:
        """Engine figures for the agent's status: the process (pid, restarts) and the server's
        Prometheus gauges named in `gauges` (metric -> key); nulls while it is down."""
        import aiohttp

        proc = self.server.proc
        stats = {
            "restarts": self.server.restarts,
            "pid": proc.pid if proc and proc.poll() is None else None,
            **{key: None for key in gauges.values()},
        }
        try:
            async with self.http().get(self.server.url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
                text = await r.text()
        except Exception:  # down or restarting
            return stats
        for line in text.splitlines():
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

    # ---- the three operations ---------------------------------------------------------------
    async def prefill(self, req: EngineRequest) -> AsyncIterator[KVPage | PrefillDone]:
        self.validate(req, generates=False)
        export = kv_tokens(len(req.token_ids), req.mode)
        room = self._new_room()
        box = self.bridge.open("export", room, len(req.token_ids) if self.exports_whole_prompt else export)
        self._start(req)
        task = granting = None
        try:
            async with self._role("prefill"):
                out: asyncio.Queue = asyncio.Queue()
                t0 = time.perf_counter()
                body = self._body(req, 1, stream=False, transfer=Transfer("export", room, export))
                task = asyncio.create_task(self._tokens(body, out, box, counts=req))
                granting = asyncio.create_task(self._grant(req.window, box, export))
                async for item in self._relay_prefill(req, box.incoming, export, out, t0):
                    yield item
        finally:
            self.bridge.close_room(room)
            self._end(req, task)
            if granting is not None:
                granting.cancel()

    async def _grant(self, window: PageWindow | None, box: Room, export: int) -> None:
        """Let the bridge read the engine's pages as the window has room for them (one unit each,
        taken here and carried by the page the prefill yields). An engine that exports the whole
        prompt sends one page more than a recompute-last decoder needs: read, never relayed."""
        pages, sent = self.geometry.pages_for(export), self.geometry.pages_for(box.tokens)
        if window is None:
            box.grant(sent)
            return
        for _ in range(pages):
            await window.take()
            box.grant()
        box.grant(sent - pages)

    async def decode(self, req: EngineRequest, stream: AsyncIterable[KVPage | PrefillDone]) -> AsyncIterator[int]:
        self._check_mode(req)
        self.validate(req, generates=True)
        sent, req.held = req.held if isinstance(req.held, SentDecode) else None, None
        sent = sent or self._open_decode(req)
        try:
            if sent.role is None:
                await self._hold_role(sent)
            if sent.task is None:
                self._send_decode(req, sent)
            done = await self._import_stream(req, stream, sent.box.tokens, sent.box)
            self._hand_over(sent.box, done)
            commit_first = req.mode is FirstTokenMode.COMMIT_FIRST
            while (item := await self._next(req, sent.out)) is not None:
                token, logprobs = item
                if commit_first:  # the engine's first token is the prefiller's, and so are its logprobs
                    commit_first = False
                    self._keep_first_logprobs(req, done)
                else:
                    self._keep_logprobs(req, logprobs)
                yield token
            req.imported_at = sent.box.imported_at  # the engine acknowledged before it decoded
        finally:
            self._close_decode(req, sent)
            if sent.role is not None:
                await sent.role.aclose()

    def _open_decode(self, req: EngineRequest) -> SentDecode:
        room = self._new_room()
        sent = SentDecode(room, self.bridge.open("import", room, kv_tokens(len(req.token_ids), req.mode)))
        self._start(req)
        return sent

    def _send_decode(self, req: EngineRequest, sent: SentDecode) -> None:
        transfer = Transfer("import", sent.room, sent.box.tokens)
        sent.out = asyncio.Queue()
        body = self._body(req, req.sampling.max_tokens, stream=True, transfer=transfer)
        sent.task = asyncio.create_task(self._tokens(body, sent.out))

    async def _hold_role(self, sent: SentDecode) -> None:
        sent.role = contextlib.AsyncExitStack()
        await sent.role.enter_async_context(self._role("decode"))

    def _close_decode(self, req: EngineRequest, sent: SentDecode) -> None:
        """End the request's room and its HTTP request (the engine aborts it); its role is
        let go of by the caller."""
        self.bridge.close_room(sent.room)
        self._end(req, sent.task)

    # ---- an engine's own prefix cache (reports_prefix) --------------------------------------
    async def hold_prefix(self, req: EngineRequest) -> None:
        """Send the decode now and wait for the engine to say how many prompt tokens its prefix
        cache holds: once it scheduled the request, it keeps them for it (vLLM: the request's
        blocks). The decode then continues this request."""
        if not self.prefix_caching:
            return
        self._check_mode(req)
        sent = self._open_decode(req)
        req.held = sent
        try:
            await self._hold_role(sent)
            self._send_decode(req, sent)
            matched = asyncio.ensure_future(sent.box.matched)
            await self._wait(req, asyncio.wait({matched, sent.task}, return_when=asyncio.FIRST_COMPLETED))
            if not matched.done():  # the engine failed (or answered) before it scheduled the request
                item = await self._wait(req, sent.out.get())
                raise (
                    item
                    if isinstance(item, Exception)
                    else TandemError(f"{self.engine_label} answered a decode before it scheduled it")
                )
        except BaseException:
            self.release_prefix(req)
            raise
        P = self.geometry.page_tokens
        req.have_pages = min(matched.result(), sent.box.tokens) // P
        req.cached_tokens = req.have_pages * P
        self._lookups += 1
        self._lookup_tokens += sent.box.tokens // P * P
        self._hit_tokens += req.cached_tokens

    @property
    def prefix_caching(self) -> bool:
        """Whether the engine's own prefix cache is on."""
        return self.reports_prefix and self.settings.prefix_caching

    def set_prefix_cache_bytes(self, capacity: int) -> None:
        """The engine's prefix cache lives in its KV pool, whose size is a start-up option: any
        budget but 0 turns it on (what it keeps is what running requests leave of the pool); a
        change between on and off restarts the engine."""
        if self.reports_prefix and (capacity > 0) != self.settings.prefix_caching:
            self.settings = self.settings.model_copy(update={"prefix_caching": capacity > 0})
            self.server.settings = self.settings
            self.server.restart()

    def prefix_cache_status(self) -> dict | None:
        """The engine's prefix cache as Tandem sees it: its capacity is the engine's KV pool
        (shared with running requests, so what it holds is not known here), and the lookups and
        hits are those of Tandem's decodes."""
        if not self.reports_prefix:
            return None
        return {
            "capacity": self.kv_budget_bytes() if self.prefix_caching else 0,
            "lookups": self._lookups,
            "lookup_tokens": self._lookup_tokens,
            "hit_tokens": self._hit_tokens,
        }

    def release_prefix(self, req: EngineRequest) -> None:
        sent, req.held = req.held, None
        if isinstance(sent, SentDecode):
            self._close_decode(req, sent)
            if sent.role is not None:  # in a task of its own: letting go of a role is awaited
                task = asyncio.get_running_loop().create_task(sent.role.aclose())
                _releases.add(task)
                task.add_done_callback(_releases.discard)

    async def generate(self, req: EngineRequest) -> AsyncIterator[int]:
        self.validate(req, generates=True)
        self._start(req)
        out: asyncio.Queue = asyncio.Queue()
        task = asyncio.create_task(self._tokens(self._body(req, req.sampling.max_tokens, True, None), out, counts=req))
        try:
            while (item := await self._next(req, out)) is not None:
                token, logprobs = item
                self._keep_logprobs(req, logprobs)
                yield token
        finally:
            self._end(req, task)

    # ---- talking to the server ---------------------------------------------------------------
    def _top_k(self, sampling: SamplingParams) -> int:
        """top_k as the server takes it: -1 (off) when unset or not below the vocabulary, where it
        keeps every token anyway (SGLang's scheduler died on a top_k past int32)."""
        return sampling.top_k if 0 < sampling.top_k < self.info.vocab_size else -1

    async def _tokens(
        self, body: dict, out: asyncio.Queue, export: Room | None = None, counts: EngineRequest | None = None
    ) -> None:
        """Stream an answer's token ids into `out`, then None (or the exception). A prefill's
        export room hears of a failure too, and of pages the agent had room for that stay missing
        for STALL_SECONDS once the server answered, so no wait outlives the request."""
        label = self.engine_label
        try:
            async with self.http().post(self.server.url + self.generate_path, json=body) as r:
                if r.status >= 400:
                    raise RequestError(f"{label} refused the request ({r.status}): {(await r.text())[:500]}")
                async for item in self._answer_tokens(r, body["stream"], counts):
                    out.put_nowait(item)
            out.put_nowait(None)
            if export is not None:
                self._watch_export(export, -1)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # connection refused or reset: the server is down or restarting
            error = e if isinstance(e, TandemError) else self._not_answering(e)
            out.put_nowait(error)
            if export is not None:
                export.incoming.put_nowait(error)

    def _watch_export(self, box: Room, last: int) -> None:
        """After the server answered a prefill: every STALL_SECONDS, fail the room if no page came
        in that time although the window had room for one (pages held back by a slow link are
        not missing)."""
        if box.closed:
            return
        if box.delivered == last and box.waiting_pages:
            box.incoming.put_nowait(
                FrameError(f"{self.engine_label} finished the prefill but not all of its pages arrived")
            )
            return
        box.loop.call_later(STALL_SECONDS, self._watch_export, box, box.delivered)

    def _not_answering(self, e: Exception) -> TandemError:
        return TandemError(
            f"{self.engine_label} is not answering ({type(e).__name__}: {e}); log tail:\n{self.server.log_tail(5)}"
        )

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
        first, logprobs = await self._next(req, out)
        self._keep_logprobs(req, logprobs)
        yield PrefillDone(
            first_token=int(first),
            kv_tokens=export,
            pages=pages,
            prefill_seconds=seconds,
            finished_at=finished_at,
            cached_tokens=req.cached_tokens,  # the answer, which carries it, came with the first token
            first_logprobs=req.token_logprobs[0] if req.token_logprobs else None,
        )

    async def _import_stream(
        self, req: EngineRequest, stream: AsyncIterable[KVPage | PrefillDone], expected_tokens: int, box: Room
    ) -> PrefillDone:
        """Write the incoming pages into the engine's import room as they pass their checks;
        return the prefiller's final item once every page is in."""
        event = self._cancels[req.request_id]

        def write(page: KVPage) -> None:
            box.outgoing.put(page_frame_parts(page))

        async with contextlib.aclosing(self._import_pages(req, event, stream, expected_tokens, write)) as complete:
            async for done in complete:  # noqa: B007 (the last item is the answer)
                pass
        return done

    # ---- per-request bookkeeping -----------------------------------------------------------
    def _keep_logprobs(self, req: EngineRequest, logprobs: TokenLogprobs | None) -> None:
        if req.sampling.logprobs is not None:
            if logprobs is None:
                raise TandemError(f"{self.engine_label} answered a token without the log-probabilities asked of it")
            # an engine may add the sampled token to the alternatives (vLLM): the top k it is
            req.token_logprobs.append(TokenLogprobs(logprobs.logprob, logprobs.top[: req.sampling.logprobs]))

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
