"""HTTP client for talking to an agent: used by decoders (to pull pages), the CLI and tests.

One `AgentClient` per peer keeps a connection pool, so a decoder reuses its connection to a
prefiller across requests instead of paying a TCP (and TLS) handshake each time.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import AsyncIterator

import httpx

from engine_adapters.pages import PROTOCOL_VERSION
from engine_adapters.errors import TandemError


class AgentHTTPError(TandemError):
    def __init__(self, status: int, message: str, kind: str = "AgentHTTPError"):
        super().__init__(message)
        self.status = status
        self.kind = kind


def _raise_for(response: httpx.Response, body: bytes) -> None:
    if response.status_code < 400:
        return
    try:
        err = json.loads(body)["error"]
        kind, message = err.get("type", "error"), err.get("message", "")
    except (ValueError, KeyError, TypeError):
        kind, message = "error", body[:500].decode(errors="replace")
    raise AgentHTTPError(response.status_code, f"{response.request.url.host}:{response.request.url.port} "
                         f"answered {response.status_code} {kind}: {message}", kind)


class AgentClient:
    def __init__(self, base_url: str, key: str, verify: bool | str = True, timeout: float = 30.0):
        self.base_url = base_url.rstrip("/")
        self.http = httpx.AsyncClient(
            base_url=self.base_url, verify=verify,
            headers={"Authorization": f"Bearer {key}", "X-Tandem-Protocol": str(PROTOCOL_VERSION)},
            timeout=httpx.Timeout(timeout, read=None),  # streams may idle while a peer computes
            limits=httpx.Limits(max_keepalive_connections=16, keepalive_expiry=60))

    async def aclose(self) -> None:
        await self.http.aclose()

    async def _json(self, method: str, path: str, **kwargs) -> dict:
        response = await self.http.request(method, path, **kwargs)
        _raise_for(response, response.content)
        return response.json()

    async def info(self) -> dict:
        return await self._json("GET", "/v1/info")

    async def status(self) -> dict:
        return await self._json("GET", "/v1/status")

    async def tokenize(self, messages: list[dict] | None = None, prompt: str | None = None) -> list[int]:
        return (await self._json("POST", "/v1/tokenize", json={"messages": messages, "prompt": prompt}))["token_ids"]

    async def create_handoff(self, **body) -> dict:
        return await self._json("POST", "/v1/handoffs", json=body)

    async def cancel_handoff(self, room: str) -> dict:
        return await self._json("DELETE", f"/v1/handoffs/{room}")

    @asynccontextmanager
    async def page_stream(self, room: str, path: str | None = None) -> AsyncIterator[AsyncIterator[bytes]]:
        """The raw chunks of a room's page stream (closing it tells the prefiller we are gone)."""
        async with self.http.stream("GET", path or f"/v1/handoffs/{room}/pages") as response:
            if response.status_code >= 400:
                _raise_for(response, await response.aread())
            yield response.aiter_raw()

    async def lines(self, path: str, body: dict) -> AsyncIterator[dict]:
        """POST and read an NDJSON token stream line by line."""
        async with self.http.stream("POST", path, json=body) as response:
            if response.status_code >= 400:
                _raise_for(response, await response.aread())
            async for line in response.aiter_lines():
                if line:
                    yield json.loads(line)
