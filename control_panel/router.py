"""Routing one request: on a pair's decoder, which prefills on its prefiller, or on one node alone.

The panel chooses the route (prompts under a pair's threshold run on D alone), sends D one
request, and keeps the fallback and the cancellation; D owns the handshake with P. The exchange
is drawn in ARCHITECTURE.md ("One request"). Each event says the route taken and why.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

from tandem_protocol.api import PREFILLER_FAILED, DecodeBody, GenerateBody
from tandem_protocol.client import AgentClient, AgentHTTPError, TransportError
from tandem_protocol.sampling import SamplingParams


class RouteError(Exception):
    """The request cannot be served; `status` and `retry_after` shape the API answer."""

    def __init__(self, message: str, status: int = 503, retry_after: float | None = None, kind: str = "route_error"):
        super().__init__(message)
        self.status, self.retry_after, self.kind = status, retry_after, kind


class _PrefillerFailed(Exception):
    """D reported that P's side failed before the first token (D holds nothing for it)."""


@dataclass(frozen=True)
class Target:
    """Where a model name runs: a pair (prefill + decode) or one node."""

    name: str
    decode_url: str
    prefill_url: str | None = None
    local_threshold: int = 0
    fallback: str = "decode_alone"
    page_encoding: str = "raw"


@dataclass
class RouteStats:
    route: str = ""
    reason: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens a prefix cache served (D's, or on P/D P's if more)
    ttft_ms: float | None = None
    bytes_moved: int = 0
    finish_reason: str | None = None
    started: float = field(default_factory=time.perf_counter)


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

    def forget(self, *urls: str) -> None:
        """Drop the pooled connections to these agents (a node removed, or one whose engine was
        just switched); the next request connects afresh."""
        for url in urls:
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
        if url not in self._clients:
            self._clients[url] = AgentClient(url, self.cluster_key, transport=self._transport)
        return self._clients[url]

    async def aclose(self) -> None:
        for c in self._clients.values():
            await c.aclose()
        self._clients.clear()

    async def tokenize(self, target: Target, messages: list[dict] | None, prompt: str | None) -> list[int]:
        try:
            return await self.client(target.decode_url).tokenize(messages=messages, prompt=prompt)
        except AgentHTTPError as e:
            if e.status == 400:  # e.g. messages the chat template cannot render: its own words,
                # not the decoder's address
                raise RouteError(e.detail.get("message") or str(e), 400, kind="invalid_request_error") from e
            raise RouteError(str(e), 503) from e
        except TransportError as e:
            raise RouteError(f"the decoder of {target.name} is not reachable: {e}", 503) from e

    async def run(
        self, target: Target, token_ids: list[int], sampling: SamplingParams, stats: RouteStats
    ) -> AsyncIterator[dict]:
        """NDJSON-style events from D: {"token", "text"} …, then {"done": true, ...}. Leaving the
        iterator early (the client went away) closes D's stream: D stops and cancels P's handoff."""
        stats.prompt_tokens = len(token_ids)
        if target.prefill_url is None:
            stats.route = "node"
            async for event in self._alone(target, token_ids, sampling, stats):
                yield event
            return
        if len(token_ids) < target.local_threshold:
            stats.route = "decode_alone"
            stats.reason = f"prompt of {len(token_ids)} tokens is under the pair's threshold"
            async for event in self._alone(target, token_ids, sampling, stats):
                yield event
            return
        stats.route = "pd"
        body = DecodeBody(
            token_ids=token_ids,
            sampling=sampling,
            prefill_url=target.prefill_url,
            page_encoding=target.page_encoding,
        )
        try:
            async for event in self._stream(target.decode_url, "/v1/decode", body, stats):
                yield event
        except _PrefillerFailed as e:
            if target.fallback != "decode_alone":
                raise RouteError(f"{target.name}: {e} (fallback disabled)", 503) from None
            # nothing has reached the client yet and D has released whatever it imported
            stats.route, stats.reason = "decode_alone", str(e)
            async for event in self._alone(target, token_ids, sampling, stats):
                yield event

    async def _alone(self, target, token_ids, sampling, stats) -> AsyncIterator[dict]:
        body = GenerateBody(token_ids=token_ids, sampling=sampling)
        async for event in self._stream(target.decode_url, "/v1/generate", body, stats):
            yield event

    async def _stream(self, url: str, path: str, body: GenerateBody, stats: RouteStats) -> AsyncIterator[dict]:
        first = True
        try:
            async for event in self.client(url).lines(path, body.model_dump(mode="json", exclude_none=True)):
                error = event.get("error")
                if first and error and error.get(PREFILLER_FAILED):
                    raise _PrefillerFailed(f"P/D transfer failed before the first token: {error['message']}")
                first = False
                if "token" in event:
                    if stats.ttft_ms is None:
                        stats.ttft_ms = (time.perf_counter() - stats.started) * 1000
                    stats.output_tokens += 1
                elif event.get("done"):
                    stats.bytes_moved = event.get("wire_bytes", 0)
                    stats.cached_tokens = max(event.get("cached_tokens", 0), event.get("prefill_cached_tokens", 0))
                    stats.finish_reason = event.get("finish_reason")
                yield event
        except AgentHTTPError as e:
            if e.detail.get(PREFILLER_FAILED):  # D could not start the handoff on P
                raise _PrefillerFailed(e.detail.get("message", str(e))) from None
            if e.status == 429:
                raise RouteError(
                    f"the prefiller is busy: {e}",
                    429,
                    retry_after=e.retry_after or DEFAULT_RETRY_AFTER,
                    kind="rate_limit_exceeded",
                ) from e
            if e.status in (400, 409, 413):  # the request (or this pair) cannot be served as asked
                raise RouteError(str(e), 400, kind="invalid_request_error") from e
            raise RouteError(str(e), 503) from e
        except TransportError as e:
            raise RouteError(f"{url} is not reachable: {e}", 503) from e
