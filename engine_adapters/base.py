"""The engine adapter contract.

An adapter hosts one model on one engine (transformers, mlx-lm, …) and speaks three things:
token ids, canonical KV pages (`tandem_protocol.pages`) and requests. Everything above the
adapters — the node agent, the panel — sees only this interface.

An in-process adapter implements six *engine primitives*, always called on the adapter's own
engine thread (one thread per adapter, so engines that are not thread-safe stay correct):

    _load()                        load weights (called once, on the engine thread)
    new_session(capacity)          an empty KV cache for one request
    forward(session, ids)          run `ids` after the cached tokens; return last-position logits
    export_kv(session, start, end) K/V of cached positions [start, end) as [layers][2][n][heads][dim]
    import_kv(session, start, kv)  write K/V for positions [start, start + n) into the cache
    set_length(session, n)         declare the first n positions valid (after imports)

and may override three more where the engine runs asynchronously (CUDA): `forward_chunk` (a
chunk whose logits nobody reads) and `export_start`/`export_finish` with `export_lag` (pages
copied off the device while it computes the next chunk).

On top of them this class builds what the agent calls, all `async` and cancellable:

    prefill(request)           -> async iterator of KVPage … then one PrefillDone(first_token)
                                  Pages leave as each prefill chunk finishes (chunks are a
                                  multiple of 64 tokens), so transfer can overlap compute.
    decode(request, stream)    -> async iterator of token ids; `stream` is what prefill
                                  yielded (pages still arriving, then PrefillDone), usually
                                  after a trip over the wire.
    generate(request)          -> async iterator of token ids (the whole job on this engine).
    cancel(request_id)         -> stops a running request at its next step; idempotent.

First-token modes (the decoder chooses, see `FirstTokenMode`):

- recompute-last: the decoder imports KV of prompt[:-1], runs the last prompt token itself and
  samples the first output token (vLLM's way). Needs a prompt of at least 2 tokens.
- commit-first: the decoder imports KV of the whole prompt and continues from the first token
  the prefiller sampled (SGLang's way).

KV storage is FP16 on every engine: on CPU the math runs in float32 and K/V are rounded to FP16
as they enter the cache, so a local run and a P/D run read identical cache values.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import numpy as np

from tandem_protocol.contract import HashCache, Progress, compute_contract
from tandem_protocol.errors import Cancelled, FrameError, RequestError
from tandem_protocol.handoff import FirstTokenMode, PrefillDone, kv_tokens
from tandem_protocol.model_dir import inspect_model
from tandem_protocol.pages import KVPage, make_page
from tandem_protocol.sampling import OUTPUT_ONLY_FIELDS, SAMPLER_FIELDS, SamplingParams

from . import failpoints
from .sampler import Sampler

IMPORT_AHEAD = 4  # pages a decoder may have received and checked but not yet imported

# Tandem never downloads weights or tokenizers at run time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

T = TypeVar("T")


@dataclass
class EngineRequest:
    request_id: str
    token_ids: list[int]
    sampling: SamplingParams
    mode: FirstTokenMode = FirstTokenMode.COMMIT_FIRST


class EngineAdapter(ABC):
    name: ClassVar[str]
    decoder_modes: ClassVar[tuple[FirstTokenMode, ...]] = (FirstTokenMode.COMMIT_FIRST, FirstTokenMode.RECOMPUTE_LAST)
    prefill_chunk_tokens: int = 256  # an adapter may choose its own per device (torch on CUDA: 2,048)
    # Sampling fields this engine applies when it generates (`sampling`), and to the token it
    # samples at the end of a prefill (`first_token_sampling`: the first token, in commit-first
    # mode). In-process engines sample with `sampling.Sampler`; output-only penalties cannot
    # change a first token, so a prefiller honours them by doing nothing.
    sampling: ClassVar[frozenset[str]] = SAMPLER_FIELDS
    first_token_sampling: ClassVar[frozenset[str]] = SAMPLER_FIELDS | OUTPUT_ONLY_FIELDS

    def __init__(
        self,
        model_dir: str | Path,
        context_length: int | None = None,
        hash_cache: HashCache | None = None,
        progress: Progress | None = None,
    ):
        self.info = inspect_model(model_dir)
        self.model_dir = self.info.path
        max_context = self.info.max_context or context_length or 0
        self.context_length = int(context_length or max_context)
        if not 1 <= self.context_length <= max_context:
            raise RequestError(
                f"context length {self.context_length} is outside 1..{max_context} (the model's maximum)"
            )
        self.geometry = self.info.geometry
        self.contract = compute_contract(self.info, self.context_length, hash_cache, progress)
        self.eos_token_ids = self.info.eos_token_ids
        self._cancels: dict[str, threading.Event] = {}
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"tandem-{self.name}")
        self._executor.submit(self._load).result()
        self.tokenizer = self._executor.submit(self._load_tokenizer).result()

    # ---- engine primitives (engine thread only) -------------------------------------------
    @abstractmethod
    def _load(self) -> None: ...

    @abstractmethod
    def new_session(self, capacity: int) -> Any: ...

    @abstractmethod
    def forward(self, session: Any, token_ids: list[int]) -> np.ndarray: ...

    @abstractmethod
    def export_kv(self, session: Any, start: int, end: int) -> np.ndarray: ...

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
    # the event loop.
    export_lag = 0

    def export_start(self, session: Any, start: int, end: int) -> Any:
        return start, self.export_kv(session, start, end)

    def export_finish(self, handle: Any) -> list[KVPage]:
        start, kv = handle
        P = self.geometry.page_tokens
        return [make_page(self.geometry, (start + a) // P, kv[:, :, a : a + P]) for a in range(0, kv.shape[2], P)]

    @abstractmethod
    def import_kv(self, session: Any, start: int, kv: np.ndarray) -> None: ...

    @abstractmethod
    def set_length(self, session: Any, length: int) -> None: ...

    def accelerator(self) -> dict:
        """What this engine computes on: {"kind": "cuda"|"metal"|"cpu", "name": ...}."""
        import platform

        return {"kind": "cpu", "name": platform.processor() or platform.machine()}

    async def engine_stats(self) -> dict:
        """Engine-side figures for the agent's status (an engine in another process reports its
        own KV pool here, so tests and users can see it return to baseline)."""
        return {}

    def release(self, session: Any) -> None:  # noqa: B027 (optional hook, not abstract)
        """Free the session's KV memory (engines with pooled memory override this)."""

    def _load_tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.model_dir))

    # ---- tokenizer ------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def chat_token_ids(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.encode(text)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    # ---- running work on the engine thread -----------------------------------------------
    async def on_engine(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        for event in self._cancels.values():
            event.set()
        self._executor.shutdown(wait=True)

    @property
    def active_requests(self) -> int:
        """Requests holding engine memory right now (prefill, decode or generate)."""
        return len(self._cancels)

    def cancel(self, request_id: str) -> bool:
        """Ask a running request to stop; True if it was running. Safe to call twice."""
        event = self._cancels.get(request_id)
        if event is None:
            return False
        event.set()
        return True

    def _begin(self, req: EngineRequest) -> threading.Event:
        if req.request_id in self._cancels:
            raise RequestError(f"request id {req.request_id!r} is already running on this engine")
        event = threading.Event()
        self._cancels[req.request_id] = event
        return event

    def _check(self, req: EngineRequest, event: threading.Event) -> None:
        if event.is_set():
            raise Cancelled(f"request {req.request_id} was cancelled")

    def validate(self, req: EngineRequest, generates: bool) -> None:
        ids = req.token_ids
        if not ids:
            raise RequestError("the prompt is empty: at least one token is needed")
        arr = np.asarray(ids)
        if arr.dtype.kind not in "iu" or arr.min() < 0 or arr.max() >= self.info.vocab_size:
            raise RequestError(f"prompt token ids must be integers in 0..{self.info.vocab_size - 1}")
        if generates:
            cannot = sorted(req.sampling.non_default() - self.sampling)
            if cannot:
                raise RequestError(
                    f"the decode engine ({self.name}) cannot apply {', '.join(cannot)}: leave "
                    f"{'them' if len(cannot) > 1 else 'it'} at the default or use another node"
                )
        elif req.mode is FirstTokenMode.COMMIT_FIRST:
            cannot = sorted(req.sampling.non_default() - self.first_token_sampling)
            if cannot:
                raise RequestError(
                    f"the prefill engine ({self.name}) samples the first token and cannot apply "
                    f"{', '.join(cannot)}: leave them at their defaults or use another prefill node"
                )
        need = len(ids) + (req.sampling.max_tokens if generates else 0)
        if need > self.context_length:
            raise RequestError(
                f"prompt of {len(ids)} tokens"
                + (f" plus max_tokens {req.sampling.max_tokens}" if generates else "")
                + f" exceeds the context length {self.context_length}"
            )

    def prefill_chunks(self, n: int) -> list[tuple[int, int]]:
        """The [start, end) spans a prompt of n tokens is computed in: prefill_chunk_tokens each,
        except that the last page gets a chunk of its own. Pages leave after their chunk is
        computed, so the pages of the chunk before it travel while the last page computes, and
        what is left to send after prefill is one page, not a whole chunk (on an 85 MB/s link,
        ~18 ms instead of ~70). Local generation uses the same spans, so its numbers are P/D's."""
        last_page = (n - 1) // self.geometry.page_tokens * self.geometry.page_tokens
        spans, start = [], 0
        while start < n:
            end = min(start + self.prefill_chunk_tokens, n)
            if end == n and start < last_page:
                end = last_page
            spans.append((start, end))
            start = end
        return spans

    # ---- high-level operations -----------------------------------------------------------
    async def prefill(self, req: EngineRequest) -> AsyncIterator[KVPage | PrefillDone]:
        """Run the prompt; yield its KV pages as they are produced, then one PrefillDone."""
        self.validate(req, generates=False)
        export = kv_tokens(len(req.token_ids), req.mode)
        event = self._begin(req)
        session = None
        try:
            t0 = time.perf_counter()
            ids, n, P = req.token_ids, len(req.token_ids), self.geometry.page_tokens
            session = await self.on_engine(self.new_session, n)
            sent, logits = 0, None
            exports: deque = deque()  # export handles not yet collected
            spans = self.prefill_chunks(n)
            for i, (start, end) in enumerate(spans):
                self._check(req, event)
                failpoints.reach("prefill_chunk")
                logits = await self._compute(session, ids[start:end], last=end == n)
                ready = export if end == n else min(end, export) // P * P
                if ready > sent:
                    exports.append(await self.on_engine(self.export_start, session, sent, ready))
                    sent = ready
                # The lag applies between the first chunk and the one before the last. The first
                # chunk's pages go at once, so the link starts one chunk earlier (on a slow link that
                # is TTFT itself); so do those of the chunk before the last, whose forward waits for
                # the device to read logits back anyway: lagged, they would wait for it too.
                lag = self.export_lag if 0 < i < len(spans) - 2 else 0
                while len(exports) > lag:
                    for page in await self.on_engine(self.export_finish, exports.popleft()):
                        yield page
            first = Sampler(req.sampling)(logits)
            yield PrefillDone(
                first_token=first,
                kv_tokens=export,
                pages=self.geometry.pages_for(export),
                prefill_seconds=time.perf_counter() - t0,
                finished_at=time.time(),
            )
        finally:
            self._cancels.pop(req.request_id, None)
            if session is not None:
                await self._release(session)

    async def decode(self, req: EngineRequest, stream: AsyncIterable[KVPage | PrefillDone]) -> AsyncIterator[int]:
        """Import pages as they arrive, then stream output tokens."""
        if req.mode not in self.decoder_modes:
            raise RequestError(f"{self.name} cannot decode in {req.mode.value} mode")
        self.validate(req, generates=True)
        expected_tokens = kv_tokens(len(req.token_ids), req.mode)
        event = self._begin(req)
        session = None
        try:
            session = await self.on_engine(self.new_session, len(req.token_ids) + req.sampling.max_tokens)
            commit_first, done = req.mode is FirstTokenMode.COMMIT_FIRST, None
            async with aclosing(self._import_pages(req, event, session, stream, expected_tokens)) as complete:
                async for done in complete:
                    if commit_first:
                        # Every page has arrived and passed its checks; P's token is final. Out it
                        # goes while the engine thread is still importing the last pages.
                        yield done.first_token
            await self.on_engine(self.set_length, session, expected_tokens)
            sampler = Sampler(req.sampling)
            if commit_first:
                sampler.skip()
                first = done.first_token
            else:
                self._check(req, event)
                first = await self.on_engine(self._next_token, session, req.token_ids[-1], sampler)
            async for token in self._continue(req, event, session, sampler, first, emitted=commit_first):
                yield token
        finally:
            self._cancels.pop(req.request_id, None)
            if session is not None:
                await self._release(session)

    async def _import_stream(
        self,
        req: EngineRequest,
        event: threading.Event,
        session: Any,
        stream: AsyncIterable[KVPage | PrefillDone],
        expected_tokens: int,
    ) -> PrefillDone:
        """Write arriving pages into the session, checking order and counts; return the final item
        once every page is imported."""
        async with aclosing(self._import_pages(req, event, session, stream, expected_tokens)) as complete:
            async for done in complete:  # noqa: B007 (the last item is the answer)
                pass
        return done

    async def _import_pages(
        self,
        req: EngineRequest,
        event: threading.Event,
        session: Any,
        stream: AsyncIterable[KVPage | PrefillDone],
        expected_tokens: int,
    ) -> AsyncIterator[PrefillDone]:
        """Check arriving pages (order, counts, geometry) and hand each to the engine thread
        without waiting for it, up to IMPORT_AHEAD pages behind the stream. Yields the final item
        once, as soon as the whole stream has arrived and passed every check (imports may still
        be running); when resumed, waits for the imports to finish."""
        P = self.geometry.page_tokens
        expected_pages = self.geometry.pages_for(expected_tokens)
        index, done, pending = 0, None, deque()
        try:
            async for page in stream:
                self._check(req, event)
                if done is not None:
                    raise FrameError("the page stream continued after the prefiller's final frame")
                if isinstance(page, PrefillDone):
                    done = page
                    continue
                if index >= expected_pages:
                    raise FrameError(
                        f"page stream carries more than the {expected_pages} pages a "
                        f"{expected_tokens}-token KV import needs"
                    )
                want_valid = min(P, expected_tokens - index * P)
                if page.index != index:
                    raise FrameError(f"page {page.index} arrived where page {index} was expected (out of order)")
                if page.valid_tokens != want_valid:
                    raise FrameError(f"page {index} holds {page.valid_tokens} tokens, expected {want_valid}")
                if page.data.shape != self.geometry.page_shape:
                    raise FrameError(
                        f"page {index} has shape {page.data.shape}, this model needs {self.geometry.page_shape}"
                    )
                pending.append(asyncio.ensure_future(self.on_engine(self.import_kv, session, index * P, page.kv)))
                index += 1
                if len(pending) > IMPORT_AHEAD:
                    await pending.popleft()  # an import error surfaces here, before any token
            if index != expected_pages:
                raise FrameError(f"page stream ended after {index} of {expected_pages} pages: nothing was decoded")
            if done is None:
                raise FrameError("page stream ended without the prefiller's final frame: nothing was decoded")
            if done.kv_tokens != expected_tokens:
                raise FrameError(
                    f"prefiller exported {done.kv_tokens} tokens of KV, this decoder needs {expected_tokens}"
                )
            yield done
            while pending:
                await pending.popleft()
        finally:
            for f in pending:  # ended early: the engine thread runs them before the release anyway
                f.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def generate(self, req: EngineRequest) -> AsyncIterator[int]:
        """Serve the whole request on this engine (local prefill, then decode)."""
        self.validate(req, generates=True)
        event = self._begin(req)
        session = None
        try:
            ids = req.token_ids
            session = await self.on_engine(self.new_session, len(ids) + req.sampling.max_tokens)
            logits = None
            for start, end in self.prefill_chunks(len(ids)):
                self._check(req, event)
                logits = await self._compute(session, ids[start:end], last=end == len(ids))
            sampler = Sampler(req.sampling)
            async for token in self._continue(req, event, session, sampler, sampler(logits)):
                yield token
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
        """Yield `token` (unless the caller already has), then decode until a stop or max_tokens."""
        params = req.sampling
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        produced = 0
        while True:
            if not emitted:
                yield token
            emitted = False
            produced += 1
            if produced >= params.max_tokens or token in stops:
                return
            self._check(req, event)
            token = await self.on_engine(self._next_token, session, token, sampler)

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
