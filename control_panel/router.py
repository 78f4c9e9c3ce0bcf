"""Routing one request: prefill on P and decode on D at once, or D alone when that is better.

For a pair the router allocates a room, asks P to reserve budget and start prefill, and at once
asks D to decode that room — D pulls P's pages as they stream. D's tokens come back as they are
made. Prompts under the pair's threshold run on D alone, and so do requests whose P is down, or
whose transfer fails before D's first token (P crashed or was killed, the link broke or stalled, a
page arrived damaged), when the pair's fallback policy allows: nothing has reached the client yet
and D has released whatever it imported. Each event says the route taken and why. Leaving the
iterator early (the client went away) aborts both roles.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tandem_protocol.client import AgentClient, AgentHTTPError, TransportError
from tandem_protocol.sampling import non_default_fields


class RouteError(Exception):
    """The request cannot be served; `status` and `retry_after` shape the API answer."""

    def __init__(self, message: str, status: int = 503, retry_after: float | None = None, kind: str = "route_error"):
        super().__init__(message)
        self.status, self.retry_after, self.kind = status, retry_after, kind


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
    ttft_ms: float | None = None
    bytes_moved: int = 0
    finish_reason: str | None = None
    started: float = field(default_factory=time.perf_counter)


# A decoder's /v1/info (its first-token mode, contract fingerprint, sampling) is asked once and
# reused for this long: one request less on every P/D request's path. A decoder whose contract
# changed in the meantime is caught by the prefiller (409), and the router asks again at once.
INFO_TTL_SECONDS = 10.0


class Router:
    def __init__(self, cluster_key: str):
        self.cluster_key = cluster_key
        self._clients: dict[str, AgentClient] = {}
        self._infos: dict[str, tuple[float, dict]] = {}

    def forget(self, *urls: str) -> None:
        """Drop what the router remembers of these agents (after the panel reconfigured them)."""
        for url in urls:
            self._infos.pop(url, None)

    async def decoder_info(self, url: str, fresh: bool = False) -> dict:
        cached = self._infos.get(url)
        if cached and not fresh and time.monotonic() - cached[0] < INFO_TTL_SECONDS:
            return cached[1]
        info = await self.client(url).info()
        self._infos[url] = (time.monotonic(), info)
        return info

    async def set_cluster_key(self, key: str) -> None:
        """The panel learned its cluster key (the first node a user paired); clients use it from now on."""
        await self.aclose()
        self.cluster_key = key

    def client(self, url: str) -> AgentClient:
        if url not in self._clients:
            self._clients[url] = AgentClient(url, self.cluster_key)
        return self._clients[url]

    async def aclose(self) -> None:
        for c in self._clients.values():
            await c.aclose()
        self._clients.clear()

    async def tokenize(self, target: Target, messages: list[dict] | None, prompt: str | None) -> list[int]:
        try:
            return await self.client(target.decode_url).tokenize(messages=messages, prompt=prompt)
        except AgentHTTPError as e:
            if e.status == 400:  # e.g. messages the chat template cannot render
                raise RouteError(str(e), 400, kind="invalid_request_error") from e
            raise RouteError(str(e), 503) from e
        except TransportError as e:
            raise RouteError(f"the decoder of {target.name} is not reachable: {e}", 503) from e

    async def run(self, target: Target, token_ids: list[int], sampling: dict, stats: RouteStats) -> AsyncIterator[dict]:
        """NDJSON-style events from D: {"token", "text"} …, then {"done": true, ...}."""
        stats.prompt_tokens = len(token_ids)
        if target.prefill_url is None:
            stats.route = "node"
            async for event in self._stream(
                target.decode_url, "/v1/generate", {"token_ids": token_ids, "sampling": sampling}, stats
            ):
                yield event
            return
        if len(token_ids) < target.local_threshold:
            stats.route, stats.reason = (
                "decode_alone",
                f"prompt of {len(token_ids)} tokens is under the pair's threshold",
            )
            async for event in self._alone(target, token_ids, sampling, stats):
                yield event
            return
        room = uuid.uuid4().hex
        p = self.client(target.prefill_url)
        try:
            for fresh in (False, True):
                info = await self.decoder_info(target.decode_url, fresh)
                context = info.get("context_length") or 0
                if context and token_ids and len(token_ids) + sampling["max_tokens"] > context:
                    # D would refuse it (400) after P had prefilled: refuse it before either starts
                    raise RouteError(
                        f"prompt of {len(token_ids)} tokens plus max_tokens {sampling['max_tokens']} "
                        f"exceeds the context length {context} of {target.name}",
                        400,
                        kind="invalid_request_error",
                    )
                cannot = sorted(non_default_fields(sampling) - set(info.get("sampling", ())))
                if cannot:  # refused before either role is scheduled
                    raise RouteError(
                        f"the decode engine of {target.name} ({info['engine']}) cannot apply {', '.join(cannot)}",
                        400,
                        kind="invalid_request_error",
                    )
                mode = info["decoder_modes"][0]
                # compressed only where the decoder reads it (an older decoder: raw, as before)
                encoding = target.page_encoding if target.page_encoding in info.get("page_encodings", ()) else "raw"
                extra = {} if encoding == "raw" else {"page_encoding": encoding}
                try:
                    await p.create_handoff(
                        room=room,
                        token_ids=token_ids,
                        sampling=sampling,
                        mode=mode,
                        contract=info["contract"]["fingerprint"],
                        **extra,
                    )
                    break
                except AgentHTTPError as e:
                    if e.status != 409 or fresh:  # 409: maybe the decoder changed since it was asked
                        raise
        except AgentHTTPError as e:
            if e.status == 429:
                raise RouteError(
                    f"the prefiller of {target.name} is busy: {e}", 429, retry_after=2.0, kind="rate_limit_exceeded"
                ) from e
            if e.status in (400, 409, 413):
                raise RouteError(str(e), 400, kind="invalid_request_error") from e
            async for event in self._fallback(target, token_ids, sampling, stats, f"prefiller failed: {e}"):
                yield event
            return
        except TransportError as e:
            async for event in self._fallback(target, token_ids, sampling, stats, f"prefiller unreachable: {e}"):
                yield event
            return
        stats.route = "pd"
        finished = False
        try:
            first = True
            async for event in self._stream(
                target.decode_url,
                "/v1/decode",
                {
                    "room": room,
                    "token_ids": token_ids,
                    "sampling": sampling,
                    "mode": mode,
                    "prefill_url": target.prefill_url,
                },
                stats,
            ):
                if first and "error" in event and target.fallback == "decode_alone":
                    # the P/D path failed before any token left: serve the request on D alone
                    reason = f"P/D transfer failed before the first token: {event['error']['message']}"
                    async for alt in self._fallback(target, token_ids, sampling, stats, reason):
                        yield alt
                    finished = True
                    return
                first = False
                yield event
            finished = True
        finally:
            if not finished:  # the client went away: make sure P lets go of the room too
                try:
                    await p.cancel_handoff(room)
                except (AgentHTTPError, *TransportError):
                    pass

    async def _fallback(self, target, token_ids, sampling, stats, reason) -> AsyncIterator[dict]:
        if target.fallback != "decode_alone":
            raise RouteError(f"{target.name}: {reason} (fallback disabled)", 503)
        stats.route, stats.reason = "decode_alone", reason
        async for event in self._alone(target, token_ids, sampling, stats):
            yield event

    async def _alone(self, target, token_ids, sampling, stats) -> AsyncIterator[dict]:
        async for event in self._stream(
            target.decode_url, "/v1/generate", {"token_ids": token_ids, "sampling": sampling}, stats
        ):
            yield event

    async def _stream(self, url: str, path: str, body: dict, stats: RouteStats) -> AsyncIterator[dict]:
        try:
            async for event in self.client(url).lines(path, body):
                if "token" in event:
                    if stats.ttft_ms is None:
                        stats.ttft_ms = (time.perf_counter() - stats.started) * 1000
                    stats.output_tokens += 1
                elif event.get("done"):
                    stats.bytes_moved = event.get("wire_bytes", 0)
                    stats.finish_reason = event.get("finish_reason")
                yield event
        except AgentHTTPError as e:
            raise RouteError(
                str(e),
                400 if e.status == 400 else 503,
                kind="invalid_request_error" if e.status == 400 else "route_error",
            ) from e
        except TransportError as e:
            raise RouteError(f"{url} is not reachable: {e}", 503) from e
