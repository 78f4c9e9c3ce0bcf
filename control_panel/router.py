"""Routing one request: on a decoder of its pool, which prefills on a prefiller of the pool, or
on one node alone.

The planner chooses the nodes (planner.py); the router sends the decoder one request and keeps
the retries, the fallback and the cancellation; D owns the handshake with P. Before the first
token reaches the client, a decoder that cannot be reached, fails or is full is replaced by
another of the pool, and a prefiller that fails by another prefiller (then by the decoder alone,
as the pool's fallback says). The exchange is drawn in ARCHITECTURE.md ("One request").
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import httpx

from tandem_protocol.api import PREFILLER_FAILED, DecodeBody, GenerateBody, TokenizeAnswer
from tandem_protocol.client import AgentClient, AgentHTTPError, TransportError
from tandem_protocol.sampling import SamplingParams

from . import pins
from .planner import Plan, Planner
from .prefix_index import hashes_of


class RouteError(Exception):
    """The request cannot be served; `status` and `retry_after` shape the API answer."""

    def __init__(self, message: str, status: int = 503, retry_after: float | None = None, kind: str = "route_error"):
        super().__init__(message)
        self.status, self.retry_after, self.kind = status, retry_after, kind


class _PrefillerFailed(Exception):
    """D reported that P's side failed before the first token (D holds nothing for it)."""


class _DecoderFailed(Exception):
    """The decoder could not serve, before the first token: another may."""

    def __init__(self, error: RouteError):
        super().__init__(str(error))
        self.error = error


@dataclass(frozen=True)
class Target:
    """Where a model name runs: a pool (its decode nodes and prefill nodes) or one node."""

    name: str
    decode_urls: tuple[str, ...]
    prefill_urls: tuple[str, ...] = ()
    local_threshold: int = 0
    fallback: str = "decode_alone"
    page_encoding: str = "raw"
    is_node: bool = False  # `node/<name>`: that node alone, whatever it holds
    node_names: tuple[tuple[str, str], ...] = ()  # (url, name) of every node, for the request log
    # The prefix caches' namespace of this request (its API key's, cache_salt.py; None: unsalted),
    # sent to the nodes and used by the router's own index
    cache_salt: str | None = None

    def name_of(self, url: str) -> str:
        return dict(self.node_names).get(url, url)


@dataclass
class RouteStats:
    route: str = ""
    reason: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    decode_node: str = ""  # the nodes that served it, by name
    prefill_node: str = ""
    cached_tokens: int = 0  # prompt tokens a prefix cache served (D's, or on P/D P's if more)
    ttft_ms: float | None = None
    predicted_ttft_ms: float | None = None  # the planner's estimate (None: figures not measured yet)
    bytes_moved: int = 0
    finish_reason: str | None = None
    started: float = field(default_factory=time.perf_counter)
    last_token_at: float | None = None  # perf_counter
    done: dict = field(default_factory=dict)  # the decoder's last line


# What the router measures of a pool's nodes and links (node_figures.py), between requests:
CALIBRATION_TOKENS = 256  # a node with no prefill figure computes a prompt this long
LINK_PROBE_MEGABYTES = 16  # a decoder pulls this much from a prefiller to measure their link


# Clients of forgotten agents still closing (a task nobody references may be collected early).
_closing: set[asyncio.Task] = set()

# When a busy prefiller's answer carries no Retry-After, the client is told to wait this long.
DEFAULT_RETRY_AFTER = 2.0


class Router:
    def __init__(self, cluster_key: str, transport: httpx.AsyncBaseTransport | None = None):
        """`transport`: an httpx transport for every agent call (a unit test's fake agents)."""
        self.cluster_key = cluster_key
        self._transport = transport
        self._clients: dict[str, AgentClient] = {}
        self.planner = Planner()
        self._measuring: dict[object, asyncio.Task] = {}  # a node (url) or link (P, D) being measured

    def forget(self, *urls: str) -> None:
        """Drop the pooled connections to these agents and what the planner knew of them (a node
        removed, or one whose engine was just switched); the next request connects afresh."""
        for url in urls:
            self.planner.forget(url)
            client = self._clients.pop(url, None)
            if client is not None:
                task = asyncio.get_running_loop().create_task(client.aclose())
                _closing.add(task)
                task.add_done_callback(_closing.discard)

    async def set_cluster_key(self, key: str) -> None:
        """The panel learned its cluster key (the first node a user paired); clients use it from now on."""
        await self.aclose()
        self.cluster_key = key

    def client(self, url: str) -> AgentClient:
        client = self._clients.get(url)
        if client is None or client.pin != pins.pinned(url):  # new, or paired again with another certificate
            if client is not None:
                self.forget(url)
            client = self._clients[url] = pins.agent_client(url, self.cluster_key, transport=self._transport)
        return client

    async def aclose(self) -> None:
        for task in list(self._measuring.values()):
            task.cancel()
        for c in self._clients.values():
            await c.aclose()
        self._clients.clear()

    async def tokenize(self, target: Target, **body) -> TokenizeAnswer:
        """Token ids from a decoder of the pool (they share one tokenizer), the next one if it
        cannot be reached."""
        for n, url in enumerate(target.decode_urls):
            try:
                return await self.client(url).tokenize(**body)
            except AgentHTTPError as e:
                if e.status == 400:  # e.g. messages the chat template cannot render: its own words,
                    # not the decoder's address
                    raise RouteError(e.detail.get("message") or str(e), 400, kind="invalid_request_error") from e
                if n == len(target.decode_urls) - 1:
                    raise RouteError(str(e), 503) from e
            except TransportError as e:
                if n == len(target.decode_urls) - 1:
                    raise RouteError(f"no decoder of {target.name} is reachable: {e}", 503) from e
        raise RouteError(f"{target.name} has no decode node", 503)

    async def run(
        self, target: Target, token_ids: list[int], sampling: SamplingParams, stats: RouteStats
    ) -> AsyncIterator[dict]:
        """NDJSON-style events from D: {"token", "text"} …, then {"done": true, ...}. Leaving the
        iterator early (the client went away) closes D's stream: D stops and cancels P's handoff."""
        stats.prompt_tokens = len(token_ids)
        hashes = hashes_of(token_ids, target.cache_salt)
        decoders, prefillers = list(target.decode_urls), list(target.prefill_urls)
        last_error: RouteError | None = None
        while decoders:
            plan = self.planner.plan(
                tuple(decoders),
                tuple(prefillers),
                hashes,
                len(token_ids),
                target.local_threshold,
                target.is_node,
                target.name_of,
            )
            if target.prefill_urls and not prefillers:  # every prefiller failed before the first token
                if target.fallback != "decode_alone":
                    raise RouteError(f"{target.name}: {stats.reason} (fallback disabled)", 503)
                plan = replace(plan, reason=stats.reason)
            stats.route, stats.reason = plan.route, plan.reason
            stats.predicted_ttft_ms = None if plan.predicted_seconds is None else plan.predicted_seconds * 1000
            stats.decode_node = target.name_of(plan.decode_url)
            stats.prefill_node = target.name_of(plan.prefill_url) if plan.prefill_url else ""
            output: list[int] = []
            work = self.planner.started(plan, len(token_ids))
            try:
                async for event in self._serve(target, plan, token_ids, sampling, stats):
                    if "token" in event:
                        self.planner.first_token(work)
                        output.append(event["token"])
                    yield event
            except _PrefillerFailed as e:
                self.planner.failed(plan.prefill_url)
                prefillers.remove(plan.prefill_url)
                stats.reason = str(e)  # nothing has reached the client and D released what it imported
                continue
            except _DecoderFailed as e:
                last_error = e.error
                if e.error.status != 429:  # a full decoder is busy, not broken
                    self.planner.failed(plan.decode_url)
                decoders.remove(plan.decode_url)
                continue
            finally:
                self.planner.ended(work)
            self._learn(plan, token_ids, hashes, output, target.cache_salt)
            self._learn_figures(plan, len(token_ids), stats)
            self.measure(target)
            return
        raise last_error or RouteError(f"{target.name} has no decode node", 503)

    def _learn(
        self, plan: Plan, token_ids: list[int], hashes: list[bytes], output: list[int], salt: str | None
    ) -> None:
        """The nodes served the request: D now holds the prompt and the answer but its last token
        (whose KV was never computed), P the prompt (whose page hashes are `hashes`), both under
        the request's cache salt."""
        self.planner.served(plan.decode_url)
        self.planner.index.add(plan.decode_url, hashes_of(token_ids + output[:-1], salt))
        if plan.prefill_url:
            self.planner.served(plan.prefill_url)
            self.planner.index.add(plan.prefill_url, hashes)

    def _learn_figures(self, plan: Plan, prompt_tokens: int, stats: RouteStats) -> None:
        """What the request showed of its nodes: the prefill rate of the node that computed the
        prompt (D alone: its time to first token; P/D: P's own prefill seconds) and D's step."""
        f, done = self.planner.figures, stats.done
        if plan.prefill_url is None and done.get("ttft_seconds"):
            f.prefilled(
                plan.decode_url, prompt_tokens, prompt_tokens - done.get("cached_tokens", 0), done["ttft_seconds"]
            )
        elif plan.prefill_url and done.get("prefill_seconds"):
            new = prompt_tokens - done.get("prefill_cached_tokens", 0)
            f.prefilled(plan.prefill_url, prompt_tokens, new, done["prefill_seconds"])
        if stats.output_tokens >= 3 and stats.ttft_ms is not None and stats.last_token_at is not None:
            first_at = stats.started + stats.ttft_ms / 1000
            f.stepped(plan.decode_url, stats.output_tokens - 1, stats.last_token_at - first_at)

    # ---- measuring nodes and links between requests ----------------------------------------------
    def measure(self, target: Target) -> None:
        """Start measuring, in the background, what the planner lacks for this pool: the prefill
        rate of an idle node never measured (a short prompt on it), and each prefiller-decoder
        link never measured or measured long ago (the decoder pulls pages from the prefiller)."""
        if target.is_node or target.local_threshold:  # a threshold overrides the estimates
            return
        f, busy = self.planner.figures, self.planner.busy()
        for url in dict.fromkeys((*target.decode_urls, *target.prefill_urls)):
            if url not in self._measuring and url not in busy and f.needs_calibration(url):
                self._background(url, self._calibrate(url))
        for p in target.prefill_urls:
            for d in target.decode_urls:
                if p != d and (p, d) not in self._measuring and f.link_stale(p, d) and not {p, d} & busy:
                    self._background((p, d), self._probe_link(p, d))

    def _background(self, key: object, work) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._measuring[key] = task
        task.add_done_callback(lambda _: self._measuring.pop(key, None))

    async def _calibrate(self, url: str) -> None:
        f = self.planner.figures
        f.node(url).calibrated = time.monotonic()
        rng = random.Random(url)  # token ids every vocabulary has, no user's prompt
        ids = [rng.randrange(1000, 2000) for _ in range(CALIBRATION_TOKENS)]
        body = GenerateBody(token_ids=ids, sampling=SamplingParams(max_tokens=1))
        # queued work on the node, as the planner counts a request's
        work = self.planner.started(Plan("node", url, None, 0, "calibration"), CALIBRATION_TOKENS)
        try:
            async for event in self.client(url).lines("/v1/generate", body.model_dump(mode="json", exclude_none=True)):
                if event.get("done") and event.get("ttft_seconds"):
                    new = CALIBRATION_TOKENS - event.get("cached_tokens", 0)
                    f.prefilled(url, CALIBRATION_TOKENS, new, event["ttft_seconds"])
        except (AgentHTTPError, TransportError):
            pass  # measured again after CALIBRATION_STALE_SECONDS; until then the rule in tokens
        finally:
            self.planner.ended(work)

    async def _probe_link(self, p: str, d: str) -> None:
        self.planner.figures.link_tried[(p, d)] = time.monotonic()
        try:
            m = await self.client(d).bench_link(p, LINK_PROBE_MEGABYTES, pins.pinned(p))
        except (AgentHTTPError, TransportError):
            return  # tried again after LINK_STALE_SECONDS; until then the rule in tokens
        self.planner.figures.linked(p, d, m["bytes_per_second"], m["rtt_seconds"], m.get("page_bytes", 0))
        try:
            modes = (await self.client(d).info()).get("decoder_modes") or []
        except (AgentHTTPError, TransportError):
            return
        self.planner.figures.node(d).recompute_last = modes[:1] == ["recompute-last"]

    def _serve(self, target: Target, plan: Plan, token_ids, sampling, stats) -> AsyncIterator[dict]:
        if plan.prefill_url is None:
            body = GenerateBody(token_ids=token_ids, sampling=sampling, cache_salt=target.cache_salt)
            return self._stream(plan.decode_url, "/v1/generate", body, stats)
        body = DecodeBody(
            token_ids=token_ids,
            sampling=sampling,
            cache_salt=target.cache_salt,
            prefill_url=plan.prefill_url,
            prefill_fingerprint=pins.pinned(plan.prefill_url),
            page_encoding=target.page_encoding,
        )
        return self._stream(plan.decode_url, "/v1/decode", body, stats)

    async def _stream(self, url: str, path: str, body: GenerateBody, stats: RouteStats) -> AsyncIterator[dict]:
        first = True
        try:
            async for event in self.client(url).lines(path, body.model_dump(mode="json", exclude_none=True)):
                error = event.get("error")
                if first and error and error.get(PREFILLER_FAILED):
                    raise _PrefillerFailed(f"P/D transfer failed before the first token: {error['message']}")
                first = False
                if "token" in event:
                    stats.last_token_at = time.perf_counter()
                    if stats.ttft_ms is None:
                        stats.ttft_ms = (stats.last_token_at - stats.started) * 1000
                    stats.output_tokens += 1
                elif event.get("done"):
                    stats.done = event
                    stats.bytes_moved = event.get("wire_bytes", 0)
                    stats.cached_tokens = max(event.get("cached_tokens", 0), event.get("prefill_cached_tokens", 0))
                    stats.finish_reason = event.get("finish_reason")
                yield event
        except AgentHTTPError as e:
            if e.detail.get(PREFILLER_FAILED):  # D could not start the handoff on P
                raise _PrefillerFailed(e.detail.get("message", str(e))) from None
            if e.status in (400, 409, 413):  # the request (or this pool) cannot be served as asked
                raise RouteError(str(e), 400, kind="invalid_request_error") from e
            if e.status == 429:
                error = RouteError(
                    f"busy: {e}",
                    429,
                    retry_after=e.retry_after or DEFAULT_RETRY_AFTER,
                    kind="rate_limit_exceeded",
                )
            else:
                error = RouteError(str(e), 503)
            raise _DecoderFailed(error) from e  # an HTTP error comes before any line
        except TransportError as e:
            error = RouteError(f"{url} is not reachable: {e}", 503)
            if first:
                raise _DecoderFailed(error) from e
            raise error from e
