"""The engine adapter contract: what the node agent calls, and nothing else.

An adapter hosts one model on one engine and speaks three things: token ids, canonical KV pages
(`tandem_protocol.pages`) and requests. Everything above the adapters — the node agent, the
panel — sees only `EngineAdapter`. Two kinds of engine implement it:

    InProcessEngine  (engine_adapters/in_process.py)  torch, MLX: the model runs in the agent's
                     process; six engine primitives and one chunk loop build the operations.
    ServerEngine     (engine_adapters/server_engine.py)  vLLM, SGLang: the engine is its own
                     server process that owns its KV cache; one HTTP exchange per operation, pages
                     through a local bridge.

First-token modes (the decoder chooses, see `FirstTokenMode`):

- recompute-last: the decoder imports KV of prompt[:-1], runs the last prompt token itself and
  samples the first output token (vLLM's way). Needs a prompt of at least 2 tokens.
- commit-first: the decoder imports KV of the whole prompt and continues from the first token
  the prefiller sampled (SGLang's way).

KV storage is FP16 on every engine, so a local run and a P/D run read identical cache values.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import numpy as np

from tandem_protocol.api import TOKENIZE_SECONDS
from tandem_protocol.contract import HashCache, Progress, compute_contract
from tandem_protocol.errors import Cancelled, FrameError, RequestError
from tandem_protocol.handoff import FirstTokenMode, PrefillDone
from tandem_protocol.model_dir import inspect_model
from tandem_protocol.pages import LOSSY, KVPage
from tandem_protocol.sampling import OUTPUT_ONLY_FIELDS, SAMPLER_FIELDS, SamplingParams, TokenLogprobs
from tandem_protocol.settings import load
from tandem_protocol.template_switches import check_template_switches
from tandem_protocol.tools import render_messages

from .settings import EngineSettings


@functools.cache
def _byte_decoder() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


IMPORT_AHEAD = 4  # pages a decoder may have received and checked but not yet imported


class PageWindow:
    """How many of a prefill's pages may sit in host memory at once (the agent's staging window).

    A prefill takes one unit before it copies a page out of the engine's KV memory and yields it;
    the agent gives the unit back once the page is on the wire. While the window is full the
    engine keeps computing and the pages wait in its own KV memory, so a prompt of any size
    streams through a window of a few pages. One taker (the prefill) per window; every call is
    made on the event loop. `close` (the handoff ends) makes every wait raise Cancelled."""

    def __init__(self, pages: int):
        if pages < 1:
            raise ValueError("a page window holds at least one page")
        self.pages, self.free, self.closed = pages, pages, False
        self._changed: asyncio.Future | None = None

    @property
    def held(self) -> int:
        """Pages taken and not given back: in host memory now."""
        return self.pages - self.free

    def try_take(self) -> bool:
        """One page's room now, without waiting: True if taken."""
        if self.closed or self.free == 0:
            return False
        self.free -= 1
        return True

    async def take(self) -> None:
        """Wait for one page's room (back-pressure from a slow link); Cancelled once closed."""
        while not self.try_take():
            if self.closed:
                raise Cancelled("the handoff ended while its prefill waited for room to export a page")
            self._changed = asyncio.get_running_loop().create_future()
            await self._changed

    def give(self, pages: int = 1) -> None:
        """Pages that left host memory (sent, or dropped): their room is free again."""
        self.free += pages
        assert self.free <= self.pages, "a page window got back more than was taken"
        self._wake()

    def close(self) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)


T = TypeVar("T")


@dataclass
class EngineRequest:
    request_id: str
    token_ids: list[int]
    sampling: SamplingParams
    mode: FirstTokenMode = FirstTokenMode.COMMIT_FIRST
    imported_at: float | None = None  # a decode's: wall clock once every page was in the engine's cache
    # a server engine's: (wall clock, perf counter) when its answer's first token came: a prefill's
    # end, where its last pages may still wait for the window
    answered_at: tuple[float, float] | None = None
    cached_tokens: int = 0  # prompt tokens whose KV came from this engine's prefix cache
    # The prefix cache's namespace (tandem_protocol/prefix.py): only requests with the same salt
    # share cached KV; None: the unsalted one. In-process engines chain it into their page hashes,
    # server engines pass it to their server (vLLM's and SGLang's `cache_salt`).
    cache_salt: str | None = None
    # A delta handoff: the leading pages of the prompt's KV the decoder holds already (set by its
    # `hold_prefix`); the prefiller sends only the pages after them.
    have_pages: int = 0
    held: Any = None  # what the decoder's engine holds for those pages until the decode takes them
    # A prefill's: the agent's staging window, one unit per page in host memory (None: unbounded,
    # as when an adapter is driven directly).
    window: PageWindow | None = None
    # A prefill's: its pages leave in this lossy encoding (`page_encoding: fp8` or `int8`; None:
    # lossless). An adapter that can encode them where they are computed (a GPU) sets each page's
    # `coded` payload; else the agent encodes them.
    lossy_encoding: int | None = None
    # Where `sampling.logprobs` asks for them: each output token's, appended before it is yielded
    # (a commit-first decoder's first is the prefiller's, from PrefillDone.first_logprobs).
    token_logprobs: list[TokenLogprobs] = field(default_factory=list)


class EngineAdapter(ABC):
    """One model on one engine. Construction loads it (weights, tokenizer, contract) and may take
    minutes; afterwards every operation is an `async` iterator that the agent may abandon at any
    point (closing it frees what the request holds) or stop with `cancel`."""

    name: ClassVar[str]
    """The engine's name in `engine_adapters.ADAPTERS` ("torch", "mlx", "vllm", "sglang")."""
    decoder_modes: ClassVar[tuple[FirstTokenMode, ...]] = (FirstTokenMode.COMMIT_FIRST, FirstTokenMode.RECOMPUTE_LAST)
    """The first-token modes this engine decodes in; the first is the one it prefers."""
    decodes_coded: frozenset[int] = frozenset()
    """The lossy encodings whose pages its decode imports as they came (KVPage.coded) and decodes
    on its own device (torch on CUDA: FP8 and INT8); others the receiver decodes to FP16 on the
    host first."""
    sampling: ClassVar[frozenset[str]] = SAMPLER_FIELDS
    """Sampling fields this engine applies when it generates."""
    first_token_sampling: ClassVar[frozenset[str]] = SAMPLER_FIELDS | OUTPUT_ONLY_FIELDS
    """Sampling fields it applies to the token it samples at the end of a prefill (commit-first).
    Output-only penalties cannot change a first token, so a prefiller honours them by doing nothing."""

    def __init__(
        self,
        model_dir: str | Path,
        context_length: int | None = None,
        hash_cache: HashCache | None = None,
        progress: Progress | None = None,
        settings: EngineSettings | None = None,
    ):
        """Load the model in `model_dir` for contexts of `context_length` tokens (default: the
        model's own maximum), with the process's engine `settings` (default: read from the
        environment now). Raises RequestError for a context length the model cannot serve."""
        self.settings = settings if settings is not None else load(EngineSettings)
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
        # One engine thread per adapter: engines that are not thread-safe stay correct, and
        # loading runs on the thread that will use what it loads.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"tandem-{self.name}")
        self._executor.submit(self._load).result()
        self.tokenizer = self._executor.submit(self._load_tokenizer).result()
        # Tokenizing has a thread of its own: off the event loop (an 8 MiB prompt takes seconds)
        # and off the engine thread (a request's tokenizing must not wait for decode steps). One
        # thread, as vLLM's tokenizer executor has: a fast tokenizer used from several threads at
        # once can fail ("Already borrowed").
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix=f"tandem-{self.name}-tokenize")

    # ---- what the agent calls ---------------------------------------------------------------
    @abstractmethod
    def prefill(self, req: EngineRequest) -> AsyncIterator[KVPage | PrefillDone]:
        """Run the prompt; yield its KV pages in order (index 0, 1, …) as they are produced, then
        exactly one PrefillDone carrying the first token sampled with `req.sampling` (and its
        `first_logprobs` when `req.sampling.logprobs` asks for them). Where `req.window` is set,
        each page yielded holds one unit of it, taken before the page was copied out of the
        engine's KV memory (the agent gives it back once the page is sent): while the window is
        full, pages wait in the engine, never in host memory, whatever the prompt's size. Pages before
        `req.have_pages` (a delta handoff: the decoder holds them) need not be yielded; the
        agent drops any that are.

        The pages cover `kv_tokens(len(prompt), req.mode)` tokens: the whole prompt for a
        commit-first decoder, prompt[:-1] for a recompute-last one. Pages leave as the engine
        finishes them, so transfer can overlap compute. Raises RequestError for a request this
        engine cannot serve (checked by `validate` before any compute), Cancelled after `cancel`."""

    @abstractmethod
    def decode(self, req: EngineRequest, stream: AsyncIterable[KVPage | PrefillDone]) -> AsyncIterator[int]:
        """Import `stream` — what a prefiller's `prefill` yielded for the same request, usually
        after a trip over the wire, pages possibly still arriving — then yield output token ids
        until a stop token or `req.sampling.max_tokens`.

        In commit-first mode the first token yielded is the prefiller's (and, where the request
        asks for log-probabilities, its TokenLogprobs the prefiller's `first_logprobs`). A stream out of order,
        short, long or of the wrong geometry raises FrameError before any token; `req.mode` not in
        `decoder_modes` raises RequestError."""

    @abstractmethod
    def generate(self, req: EngineRequest) -> AsyncIterator[int]:
        """The whole request on this engine (its own prefill, then decode): the output a P/D
        request must agree with.

        decode and generate: when `req.sampling.logprobs` is set, each token's TokenLogprobs is
        appended to `req.token_logprobs` before the token is yielded."""

    def cancel(self, request_id: str) -> bool:
        """Ask a running request to stop at its next step (from any thread); True if it was
        running. Idempotent."""
        event = self._cancels.get(request_id)
        if event is None:
            return False
        event.set()
        return True

    @property
    def active_requests(self) -> int:
        """Requests holding engine memory right now (prefill, decode or generate)."""
        return len(self._cancels)

    def validate(self, req: EngineRequest, generates: bool) -> None:
        """Raise RequestError if this engine cannot serve `req` as a decoder (`generates`) or as a
        prefiller: empty prompt, token ids outside the vocabulary, sampling it cannot apply, or
        more tokens than its context length. The agent calls it before it answers 200."""
        ids = req.token_ids
        if not ids:
            raise RequestError("the prompt is empty: at least one token is needed")
        arr = np.asarray(ids)
        if arr.dtype.kind not in "iu" or arr.min() < 0 or arr.max() >= self.info.vocab_size:
            raise RequestError(f"prompt token ids must be integers in 0..{self.info.vocab_size - 1}")
        if any(token >= self.info.vocab_size for token, _ in req.sampling.logit_bias):
            raise RequestError(f"logit_bias token ids must be in 0..{self.info.vocab_size - 1}")
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

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def chat_token_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of a chat, through the model's chat template, ready for the answer."""
        return self.encode(self.chat_prompt(messages))

    def chat_prompt(
        self, messages: list[dict], tools: list[dict] | None = None, template_kwargs: dict | None = None
    ) -> str:
        """A chat as the model's template renders it, ready for the answer; `tools` rendered by the
        template where it knows tools, else by Tandem's prompt (tandem_protocol/tools.py);
        `template_kwargs` (e.g. enable_thinking) passed to the template: only its switches, never
        a template of the caller's (TemplateSwitchError)."""
        check_template_switches(template_kwargs)
        template = self.tokenizer.chat_template
        knows_tools = "tools" in (template if isinstance(template, str) else json.dumps(template or ""))
        rendered = render_messages(messages, tools, knows_tools)
        extra = {**(template_kwargs or {}), **({"tools": tools} if tools and knows_tools else {})}
        return self.tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True, **extra)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def token_pieces(self, token_ids: list[int]) -> list[tuple[str, bytes]]:
        """Each token alone, as log-probabilities show it: its text (special tokens included) and
        its exact bytes. A byte-level BPE token (GPT-2's scheme: Llama 3, Qwen, SmolLM) may be part
        of a character, whose text alone is U+FFFD: its bytes are the token's own, so a client can
        join them back into the character; any other token's bytes are its text's."""
        byte_of = _byte_decoder()
        pieces = []
        for token_id, piece in zip(token_ids, self.tokenizer.convert_ids_to_tokens(token_ids), strict=True):
            text = self.tokenizer.decode([token_id])
            own = self._byte_level and piece and all(c in byte_of for c in piece)
            pieces.append((text, bytes(byte_of[c] for c in piece) if own else text.encode()))
        return pieces

    @functools.cached_property
    def grammar_tokenizer(self):
        """The tokenizer as llguidance sees it, for requests whose output follows a grammar
        (built once, ~1 s; its vocabulary is the model's, its end the model's stop tokens)."""
        import llguidance.hf

        return llguidance.hf.from_tokenizer(
            self.tokenizer, n_vocab=self.info.vocab_size, eos_token=sorted(self.eos_token_ids)
        )

    @functools.cached_property
    def _byte_level(self) -> bool:
        """Whether the tokenizer's pieces are GPT-2's byte-level alphabet (its space is "Ġ")."""
        return self.tokenizer.convert_ids_to_tokens(self.encode(" a"))[0].startswith("Ġ")

    def accelerator(self) -> dict:
        """What this engine computes on: {"kind": "cuda"|"metal"|"cpu", "name": ...}."""
        import platform

        return {"kind": "cpu", "name": platform.processor() or platform.machine()}

    def kv_budget_bytes(self) -> int:
        """The KV, at the canonical FP16 size, this engine can hold for its running requests: the
        decoder's default admission budget (node_agent/admission.py). By default a quarter of the
        memory available once the model is loaded: in-process engines on a CPU keep float32
        caches, twice the canonical size, beside the weights and everything else on the machine."""
        import psutil

        return psutil.virtual_memory().available // 4

    async def hold_prefix(self, req: EngineRequest) -> None:  # noqa: B027 (optional hook)
        """Before a P/D decode: find the longest prefix of the KV `req` needs (its first
        `kv_tokens(len(prompt), req.mode)` tokens, whole pages) that this engine's prefix cache
        holds, and hold it for the request (eviction cannot take it) — `req.have_pages` pages,
        in `req.held`. The prefiller then sends only the later pages, and `decode` expects its
        stream to begin at page `have_pages`. An engine without a prefix cache holds nothing."""

    def release_prefix(self, req: EngineRequest) -> None:
        """The decode of `req` will not run after `hold_prefix` (the handshake failed, or its
        stream was never read): let go of what `req.held` holds. Safe to call more than once,
        and after a decode that took it."""
        req.held = None

    def prefix_cache_default_bytes(self) -> int:
        """The default budget of the engine's prefix cache (pages of recent prompts and outputs,
        in host memory at the canonical size): an eighth of the memory available once the model
        is loaded, half of what `kv_budget_bytes` gives running requests on a CPU."""
        import psutil

        return psutil.virtual_memory().available // 8

    def prefix_cache_status(self) -> dict | None:
        """The prefix cache's figures (capacity, bytes, pages, lookups, lookup_tokens, hit_tokens,
        evicted_pages), or None for an engine that keeps no prefix cache of Tandem's."""
        return None

    def set_prefix_cache_bytes(self, capacity: int) -> None:  # noqa: B027 (optional hook, not abstract)
        """Keep at most `capacity` bytes of prefix pages (0: none), evicting at once what is over.
        An engine without a prefix cache of Tandem's ignores it."""

    async def engine_stats(self) -> dict:
        """Engine-side figures for the agent's status (an engine in another process reports its
        own KV pool here, so tests and users can see it return to baseline)."""
        return {}

    def close(self) -> None:
        """Stop every request and free the engine (threads, processes, memory)."""
        for event in self._cancels.values():
            event.set()
        self._tokenizer_thread.shutdown(wait=False)  # what is queued there still answers; nothing waits for it
        self._executor.shutdown(wait=True)

    # ---- shared by both kinds of engine -------------------------------------------------------
    @abstractmethod
    def _load(self) -> None:
        """Load the engine (weights, or start its server); runs once, on the engine thread."""

    def _load_tokenizer(self):
        from transformers import AutoTokenizer

        # Tandem never downloads a tokenizer at run time.
        return AutoTokenizer.from_pretrained(str(self.model_dir), local_files_only=True)

    async def on_engine(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the engine thread."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def on_tokenizer(self, fn: Callable[..., T], *args: Any, timeout: float = TOKENIZE_SECONDS) -> T:
        """Run `fn(*args)` (a chat template's render, an encoding) on the tokenizer thread; the
        event loop serves other requests meanwhile. RequestError once `timeout` seconds have
        passed since the call, queueing included: the request fails then, while what was running
        finishes on its thread (a thread cannot be stopped; a render of the model's own template,
        with the switches tandem_protocol/template_switches.py lets through, ends)."""
        work = asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)
        try:
            return await asyncio.wait_for(work, timeout)
        except TimeoutError:
            raise RequestError(
                f"tokenizing did not finish within {timeout:g} s on this node (a prompt too long, or "
                "too many long prompts at once): shorten the prompt or try again"
            ) from None

    def _begin(self, req: EngineRequest) -> threading.Event:
        if req.request_id in self._cancels:
            raise RequestError(f"request id {req.request_id!r} is already running on this engine")
        event = threading.Event()
        self._cancels[req.request_id] = event
        return event

    def _check_mode(self, req: EngineRequest) -> None:
        if req.mode not in self.decoder_modes:
            raise RequestError(f"{self.name} cannot decode in {req.mode.value} mode")

    @staticmethod
    def _keep_first_logprobs(req: EngineRequest, done: PrefillDone) -> None:
        """A commit-first decode's first token is the prefiller's: so are its log-probabilities."""
        if req.sampling.logprobs is not None:
            if done.first_logprobs is None:
                raise FrameError(
                    "the prefiller sent no log-probabilities for the first token the request asked them of"
                )
            req.token_logprobs.append(done.first_logprobs)

    def _check(self, req: EngineRequest, event: threading.Event) -> None:
        if event.is_set():
            raise Cancelled(f"request {req.request_id} was cancelled")

    async def _import_pages(
        self,
        req: EngineRequest,
        event: threading.Event,
        stream: AsyncIterable[KVPage | PrefillDone],
        expected_tokens: int,
        write: Callable[[KVPage], None],
    ) -> AsyncIterator[PrefillDone]:
        """Check arriving pages (order, counts, geometry) and hand each to `write` on the engine
        thread without waiting for it, up to IMPORT_AHEAD pages behind the stream. Yields the final
        item once, as soon as the whole stream has arrived and passed every check (writes may still
        be running); when resumed, waits for the writes to finish."""
        P = self.geometry.page_tokens
        expected_pages = self.geometry.pages_for(expected_tokens)
        index, done, pending = req.have_pages, None, deque()  # a delta handoff begins after the held pages
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
                g = self.geometry
                if page.data is None:  # lossy, left encoded for this engine (decodes_coded)
                    codec = LOSSY[page.encoding]
                    got, want = (
                        page.coded.shape,
                        (codec.payload_bytes(g.layers, g.kv_heads, g.head_dim, g.page_tokens),),
                    )
                else:
                    got, want = page.data.shape, g.page_shape
                if got != want:
                    raise FrameError(f"page {index} has shape {got}, this model needs {want}")
                pending.append(asyncio.ensure_future(self.on_engine(write, page)))
                index += 1
                if len(pending) > IMPORT_AHEAD:
                    await pending.popleft()  # a write error surfaces here, before any token
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
