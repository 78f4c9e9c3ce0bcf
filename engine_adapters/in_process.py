"""Engines that run the model in the agent's own process (transformers, mlx-lm).

A subclass implements six *engine primitives*, always called on the adapter's engine thread
(one thread per adapter, so engines that are not thread-safe stay correct):

    _load()                        load weights (called once, on the engine thread)
    new_session(capacity)          an empty KV cache for one request
    forward(session, ids)          run `ids` after the cached tokens; return last-position logits
    export_kv(session, start, end) K/V of cached positions [start, end) as [layers][2][n][heads][dim]
    import_kv(session, start, kv)  write K/V for positions [start, start + n) into the cache
    set_length(session, n)         declare the first n positions valid (after imports)

and may override `release` (free a session), `reserve` (make room for imported pages before
the first arrives) and `forward_rows` (one decode step of several
requests in one forward: continuous batching, `decode_batch.py`), plus three more where the engine runs
asynchronously (CUDA): `forward_chunk` (a chunk whose logits nobody reads) and
`export_start`/`export_finish` with `export_lag` (pages copied off the device while it
computes the next chunk). On CPU the math runs in float32 and K/V are rounded to FP16 as they
enter the cache.

From them this class builds the agent's operations (`base.EngineAdapter`): prefill computes
the prompt in chunks (`prefill_chunks`) and yields each chunk's pages as soon as it is done;
decode imports pages as they arrive; generate runs the same chunks locally, so its numbers are
P/D's.
"""

from __future__ import annotations

import asyncio
import threading
import time
from abc import abstractmethod
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator
from contextlib import aclosing
from typing import Any

import numpy as np

from tandem_protocol.handoff import FirstTokenMode, PrefillDone, kv_tokens
from tandem_protocol.pages import KVPage, make_page
from tandem_protocol.prefix import chain_seed, page_hashes

from . import failpoints
from .base import EngineAdapter, EngineRequest, PageWindow
from .decode_batch import DecodeBatch, Row
from .prefix_cache import PrefixCache
from .sampler import Sampler


class InProcessEngine(EngineAdapter):
    prefill_chunk_tokens: int = 256  # an engine may choose its own per device (torch on CUDA: 2,048)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batch = DecodeBatch(self._executor, self.forward_rows)
        self.prefix_cache = PrefixCache(self.prefix_cache_default_bytes(), self.geometry.page_bytes)

    # ---- engine primitives (engine thread only) -------------------------------------------
    @abstractmethod
    def new_session(self, capacity: int) -> Any: ...

    @abstractmethod
    def forward(self, session: Any, token_ids: list[int]) -> np.ndarray: ...

    @abstractmethod
    def export_kv(self, session: Any, start: int, end: int) -> np.ndarray: ...

    @abstractmethod
    def import_kv(self, session: Any, start: int, kv: np.ndarray) -> None: ...

    @abstractmethod
    def set_length(self, session: Any, length: int) -> None: ...

    def import_coded(self, session: Any, start: int, payload: np.ndarray, n: int, encoding: int) -> None:
        """Import a page's first `n` tokens from its payload in a lossy `encoding` (fp8.py's or
        int8.py's layout), decoding on the device: only engines whose `decodes_coded` holds that
        encoding receive pages so."""
        raise NotImplementedError(f"{self.name} does not decode lossy pages itself")

    def release(self, session: Any) -> None:  # noqa: B027 (optional hook, not abstract)
        """Free the session's KV memory (engines with pooled memory override this)."""

    def reserve(self, session: Any, tokens: int) -> None:  # noqa: B027 (optional hook, not abstract)
        """Make room for `tokens` imported positions before any page arrives, so that the work
        of allocating is not done between pages (an engine whose cache grows lazily overrides it)."""

    def forward_rows(self, sessions: list[Any], tokens: list[int]) -> np.ndarray:
        """One decode step of several requests: row r runs `tokens[r]` after `sessions[r]`'s
        cache; the logits, [rows][vocab]. An engine that can batch overrides it; one row must
        give `forward`'s logits exactly (a request alone computes as it always has)."""
        return np.stack([self.forward(s, [t]) for s, t in zip(sessions, tokens, strict=True)])

    def forward_chunk(self, session: Any, token_ids: list[int]) -> None:
        """Compute a prompt chunk whose logits nobody reads (every chunk but the last). An
        asynchronous device (CUDA) overrides it so that nothing here waits for the device."""
        self.forward(session, token_ids)

    # A prompt's pages leave in two steps, so that an asynchronous device can copy one chunk's KV
    # to the host while it computes the next: `export_start` begins the copy of whole pages from
    # token `start` (a page boundary) to `end`, `export_finish` waits for it and returns the pages.
    # `export_lag` is how many chunks the prefill loop lets that wait trail: 0 (the default, for
    # engines that compute as they are called: waiting later would only hold pages back) or 1
    # (CUDA: the device still has the next chunk queued when the host waits, so the wait costs
    # the device nothing). Both run on the engine thread, so cutting pages never competes with
    # the event loop. `lossy`: the pages leave in that lossy encoding (FP8_E4M3, INT8); an engine
    # on a device may encode them there (KVPage.coded), where it costs nothing beside the compute
    # (the host's codec: ~25-60 ms a core for an 8B model's page).
    export_lag = 0

    def export_start(self, session: Any, start: int, end: int, lossy: int | None = None) -> Any:
        return start, self.export_kv(session, start, end)

    def export_finish(self, handle: Any) -> list[KVPage]:
        start, kv = handle
        P = self.geometry.page_tokens
        return [make_page(self.geometry, (start + a) // P, kv[:, :, a : a + P]) for a in range(0, kv.shape[2], P)]

    # ---- the chunk loop -------------------------------------------------------------------
    def prefill_chunks(self, n: int, start: int = 0) -> list[tuple[int, int]]:
        """The [start, end) spans a prompt of n tokens is computed in, from `start` (0, or the end
        of a cached prefix): prefill_chunk_tokens each, except that the last page gets a chunk of
        its own. Pages leave after their chunk is computed, so the pages of the chunk before it
        travel while the last page computes, and what is left to send after prefill is one page,
        not a whole chunk (on an 85 MB/s link, ~18 ms instead of ~70). Local generation uses the
        same spans, so its numbers are P/D's."""
        last_page = (n - 1) // self.geometry.page_tokens * self.geometry.page_tokens
        spans = []
        while start < n:
            end = min(start + self.prefill_chunk_tokens, n)
            if end == n and start < last_page:
                end = last_page
            spans.append((start, end))
            start = end
        return spans

    async def prefill(self, req: EngineRequest) -> AsyncIterator[KVPage | PrefillDone]:
        self.validate(req, generates=False)
        export = kv_tokens(len(req.token_ids), req.mode)
        event = self._begin(req)
        session = None
        window = req.window
        try:
            t0 = time.perf_counter()
            ids, n, P = req.token_ids, len(req.token_ids), self.geometry.page_tokens
            session = await self.on_engine(self.new_session, n)
            cached, req.cached_tokens = await self.on_engine(self._restore, session, ids, req.cache_salt)
            for index in range(req.have_pages, len(cached)):  # computed before: leaves at once
                if window is not None:
                    await window.take()
                yield make_page(self.geometry, index, cached[index])
            # computed from the end of the cached prefix; exported from the first page neither
            # the cache's whole pages nor the decoder hold
            sent, logits = max(len(cached), req.have_pages) * P, None
            exports: deque = deque()  # export handles not yet collected
            spans = self.prefill_chunks(n, req.cached_tokens)
            for i, (start, end) in enumerate(spans):
                self._check(req, event)
                failpoints.reach("prefill_chunk")
                await failpoints.pause("slow_prefill_chunk")
                logits = await self._compute(session, ids[start:end], last=end == n)
                ready = export if end == n else min(end, export) // P * P
                # Only the pages the window has room for are copied out now; the rest wait in the
                # session's cache while the next chunk computes (a slow link pauses export, not compute).
                upto = self._room_upto(window, sent, ready)
                if upto > sent:
                    exports.append(await self.on_engine(self.export_start, session, sent, upto, req.lossy_encoding))
                    sent = upto
                # The lag applies between the first chunk and the one before the last. The first
                # chunk's pages go at once, so the link starts one chunk earlier (on a slow link that
                # is TTFT itself); so do those of the chunk before the last, whose forward waits for
                # the device to read logits back anyway: lagged, they would wait for it too.
                lag = self.export_lag if 0 < i < len(spans) - 2 else 0
                while len(exports) > lag:
                    for page in await self.on_engine(self.export_finish, exports.popleft()):
                        yield page
            first = (await self._sampler(req, req.token_logprobs))(logits)
            self._remember(session, ids, req.cache_salt)
            # the prefill ends here, whatever its pages still wait for
            done = PrefillDone(
                first_token=first,
                kv_tokens=export,
                pages=self.geometry.pages_for(export),
                prefill_seconds=time.perf_counter() - t0,
                finished_at=time.time(),
                cached_tokens=req.cached_tokens,
                first_logprobs=req.token_logprobs[0] if req.token_logprobs else None,
            )
            while sent < export:  # every chunk is computed: the rest leave as the window frees
                await window.take()  # the page at `sent`
                upto = self._room_upto(window, min(sent + P, export), export)
                handle = await self.on_engine(self.export_start, session, sent, upto, req.lossy_encoding)
                for page in await self.on_engine(self.export_finish, handle):
                    yield page
                sent = upto
            yield done
        finally:
            self._cancels.pop(req.request_id, None)
            if session is not None:
                await self._release(session)

    def _room_upto(self, window: PageWindow | None, sent: int, ready: int) -> int:
        """Where export may run to now, from `sent` (a page boundary, or the end): `ready` without
        a window, else across as many of the pages in [sent, ready) as it has room for (taken)."""
        if window is None or ready <= sent:
            return max(sent, ready)
        upto = sent
        while upto < ready and window.try_take():
            upto = min(upto + self.geometry.page_tokens, ready)
        return upto

    async def decode(self, req: EngineRequest, stream: AsyncIterable[KVPage | PrefillDone]) -> AsyncIterator[int]:
        self._check_mode(req)
        self.validate(req, generates=True)
        expected_tokens = kv_tokens(len(req.token_ids), req.mode)
        event = self._begin(req)
        session = None
        try:
            session = await self.on_engine(self.new_session, len(req.token_ids) + req.sampling.max_tokens)
            await self.on_engine(self.reserve, session, expected_tokens)
            P = self.geometry.page_tokens
            held, req.held = req.held or [], None
            await self.on_engine(self._import_held, session, held)  # the stream brings the rest

            def write(page: KVPage) -> None:
                if page.data is None:  # lossy as it came (decodes_coded)
                    self.import_coded(session, page.index * P, page.coded, page.valid_tokens, page.encoding)
                else:
                    self.import_kv(session, page.index * P, page.kv)

            commit_first, done = req.mode is FirstTokenMode.COMMIT_FIRST, None
            async with aclosing(self._import_pages(req, event, stream, expected_tokens, write)) as complete:
                async for done in complete:
                    if commit_first:
                        # Every page has arrived and passed its checks; P's token is final. Out it
                        # goes while the engine thread is still importing the last pages.
                        self._keep_first_logprobs(req, done)
                        yield done.first_token
            await self.on_engine(self.set_length, session, expected_tokens)
            req.imported_at = time.time()  # every page is in the engine's cache now
            sampler = await self._sampler(req, req.token_logprobs)
            if commit_first:
                sampler.skip(done.first_token)
                first = done.first_token
            else:
                self._check(req, event)
                first = await self.on_engine(self._next_token, session, req.token_ids[-1], sampler)
            produced = []
            async for token in self._continue(req, event, session, sampler, first, emitted=commit_first):
                produced.append(token)
                yield token
            out = [first, *produced] if commit_first else produced
            self._remember(session, req.token_ids + out[:-1], req.cache_salt)
        finally:
            self._cancels.pop(req.request_id, None)
            if session is not None:
                await self._release(session)

    async def generate(self, req: EngineRequest) -> AsyncIterator[int]:
        self.validate(req, generates=True)
        event = self._begin(req)
        session = None
        try:
            ids = req.token_ids
            session = await self.on_engine(self.new_session, len(ids) + req.sampling.max_tokens)
            _, req.cached_tokens = await self.on_engine(self._restore, session, ids, req.cache_salt)
            logits = None
            for start, end in self.prefill_chunks(len(ids), req.cached_tokens):
                self._check(req, event)
                logits = await self._compute(session, ids[start:end], last=end == len(ids))
            sampler = await self._sampler(req, req.token_logprobs)
            produced = []
            async for token in self._continue(req, event, session, sampler, sampler(logits)):
                produced.append(token)
                yield token
            self._remember(session, ids + produced[:-1], req.cache_salt)
        finally:
            self._cancels.pop(req.request_id, None)
            if session is not None:
                await self._release(session)

    async def _continue(
        self,
        req: EngineRequest,
        event: threading.Event,
        session: Any,
        sampler: Sampler,
        token: int,
        emitted: bool = False,
    ) -> AsyncIterator[int]:
        """Yield `token` (unless the caller already has), then decode in the engine's batch until
        a stop or max_tokens."""
        params = req.sampling
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        if not emitted:
            yield token
        if params.max_tokens <= 1 or token in stops:
            return
        self._check(req, event)
        loop = asyncio.get_running_loop()
        row = Row(req.request_id, session, token, sampler, stops, params.max_tokens, 1, event, loop)
        await self.on_engine(self.batch.add, row)
        try:
            while True:
                item = await row.out.get()
                if isinstance(item, BaseException):
                    raise item
                token, last = item
                yield token
                if last:
                    return
                self._check(req, event)
        finally:
            # before the session is released (also on the engine thread, queued after this)
            await asyncio.shield(self.on_engine(self.batch.remove, row))

    # ---- the prefix cache (prefix_cache.py) ------------------------------------------------
    def prefix_cache_status(self) -> dict:
        return self.prefix_cache.status()

    def set_prefix_cache_bytes(self, capacity: int) -> None:
        self._executor.submit(self.prefix_cache.resize, capacity).result()

    async def hold_prefix(self, req: EngineRequest) -> None:
        tokens = req.token_ids[: kv_tokens(len(req.token_ids), req.mode)]
        req.held = await self.on_engine(self._held_pages, tokens, req.cache_salt)
        req.have_pages = len(req.held)
        req.cached_tokens = req.have_pages * self.geometry.page_tokens

    def _held_pages(self, tokens: list[int], salt: str | None) -> list[np.ndarray]:
        """The cached pages of the longest prefix of `tokens` under the cache salt `salt`, counted
        as one lookup. Held by reference: an eviction meanwhile drops the cache's entry, not the array."""
        if self.prefix_cache.capacity < self.geometry.page_bytes:
            return []
        pages = self.prefix_cache.match(self._hashes(tokens, salt))
        self.prefix_cache.count(
            len(tokens) // self.geometry.page_tokens * self.geometry.page_tokens, len(pages) * self.geometry.page_tokens
        )
        return pages

    def _restore(self, session: Any, ids: list[int], salt: str | None) -> tuple[list[np.ndarray], int]:
        """Import the longest prefix of `ids` cached under `salt` into `session`: its whole pages (returned)
        and, after them, as many tokens as a cached tail shares; returns the pages and the tokens
        imported. The last prompt token is always computed (its logits sample the first token),
        so what is looked up is ids[:-1]."""
        if self.prefix_cache.capacity < self.geometry.page_bytes:
            return [], 0
        P, tokens = self.geometry.page_tokens, ids[:-1]
        hashes = self._hashes(tokens, salt)
        pages = self.prefix_cache.match(hashes)
        after = self._chain_end(hashes[: len(pages)], salt)
        length = len(pages) * P
        shared, tail = self.prefix_cache.match_tail(after, tokens[length : length + P - 1])
        self.prefix_cache.count(len(tokens), length + shared)
        self._import_held(session, pages)
        if shared:
            self.import_kv(session, length, tail[:, :, :shared])
            length += shared
        if length:
            self.set_length(session, length)
        return pages, length

    def _import_held(self, session: Any, pages: list[np.ndarray]) -> None:
        for index, kv in enumerate(pages):
            self.import_kv(session, index * self.geometry.page_tokens, kv)

    def _remember(self, session: Any, tokens: list[int], salt: str | None) -> None:
        """Queue, on the engine thread ahead of the session's release, the caching under `salt` of
        the full pages of `tokens` (whose KV the session holds from position 0) that the cache lacks."""
        if self.prefix_cache.capacity >= self.geometry.page_bytes:
            self._executor.submit(self._cache_pages, session, tokens, salt)

    def _cache_pages(self, session: Any, tokens: list[int], salt: str | None) -> None:
        hashes, P = self._hashes(tokens, salt), self.geometry.page_tokens
        full = len(hashes) * P
        if full < len(tokens):  # the tail first: the oldest entry of its chain
            kv = self.export_kv(session, full, len(tokens))
            self.prefix_cache.add_tail(self._chain_end(hashes, salt), tokens[full:], kv)
        first = next((i for i, h in enumerate(hashes) if h not in self.prefix_cache), len(hashes))
        kv = self.export_kv(session, first * P, full) if first < len(hashes) else None
        pages = [] if kv is None else [np.ascontiguousarray(kv[:, :, a : a + P]) for a in range(0, kv.shape[2], P)]
        self.prefix_cache.add(hashes, pages, start=first)

    def _hashes(self, tokens: list[int], salt: str | None) -> list[bytes]:
        return page_hashes(self.contract.fingerprint_bytes, tokens, self.geometry.page_tokens, salt=salt)

    def _chain_end(self, hashes: list[bytes], salt: str | None) -> bytes:
        """What a tail after these whole pages follows: the last page's hash, or the chain's seed
        (salted: a short prompt's tail is its salt's alone too)."""
        return hashes[-1] if hashes else chain_seed(self.contract.fingerprint_bytes, salt)

    async def _sampler(self, req: EngineRequest, logprobs: list) -> Sampler:
        """The request's sampler; one whose output follows a JSON schema gets the grammar
        tokenizer, built off the event loop the first time (about a second)."""
        tokenizer = None
        if req.sampling.json_schema is not None:
            tokenizer = await asyncio.to_thread(lambda: self.grammar_tokenizer)
        return Sampler(req.sampling, logprobs, tokenizer)

    def _next_token(self, session: Any, token: int, sampler: Sampler) -> int:
        return sampler(self.forward(session, [token]))

    async def _compute(self, session: Any, ids: list[int], last: bool) -> np.ndarray | None:
        """One prompt chunk on the engine thread; the logits of the last one only."""
        if last:
            return await self.on_engine(self.forward, session, ids)
        await self.on_engine(self.forward_chunk, session, ids)
        return None

    async def _release(self, session: Any) -> None:
        # Release on the engine thread so it runs after any engine work still queued for it.
        await asyncio.shield(self.on_engine(self.release, session))
