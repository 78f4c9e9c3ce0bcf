"""HTTP client for talking to an agent: used by decoders (to pull pages), routers and tests.

Control calls and token streams go through aiohttp (its C HTTP parser; httpx's pure-Python h11
was 3x slower here). Page streams, the hot path, go through `page_receiver.py`, which receives
pages in place. One `AgentClient` per peer keeps both connection pools, so a decoder reuses its
connections to a prefiller across requests instead of paying a TCP (and TLS) handshake.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp

from .errors import TandemError
from .page_receiver import HTTPStatusError, PageStream, ReceiverPool
from .pages import PROTOCOL_VERSION, FrameExpectation
from .settings import settings

# The client side of the wire, for the callers that catch transport failures.
TransportError = (aiohttp.ClientError, ConnectionError, TimeoutError)  # StreamBroken is a ConnectionError


class AgentHTTPError(TandemError):
    def __init__(self, status: int, message: str, kind: str = "AgentHTTPError", detail: dict | None = None):
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.detail = detail or {}  # the agent's error object (e.g. "field" for a bad configuration)


def _raise_for(response: aiohttp.ClientResponse, body: bytes) -> None:
    if response.status >= 400:
        raise _http_error(response.status, f"{response.url.host}:{response.url.port}", body)


def _http_error(status: int, where: str, body: bytes) -> AgentHTTPError:
    try:
        err = json.loads(body)["error"]
        kind, message = err.get("type", "error"), err.get("message", "")
    except (ValueError, KeyError, TypeError, AttributeError):
        err, kind, message = {}, "error", body[:500].decode(errors="replace")
    return AgentHTTPError(status, f"{where} answered {status} {kind}: {message}", kind, err)


class AgentClient:
    def __init__(
        self,
        base_url: str,
        key: str,
        verify: bool | str | None = None,
        timeout: float = 30.0,
        stall_timeout: float | None = None,
    ):
        """`verify`: True (system CAs), False (no check), a CA bundle path, or None for the
        TANDEM_CA_FILE environment variable when set (how a cluster with self-signed agent
        certificates is trusted) and the system CAs otherwise."""
        if verify is None:
            ca_file = settings().ca_file
            verify = str(ca_file) if ca_file else True
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {key}", "X-Tandem-Protocol": str(PROTOCOL_VERSION)}
        self._ssl: ssl.SSLContext | bool = (
            ssl.create_default_context(cafile=verify) if isinstance(verify, str) else (None if verify else False)
        )
        self._timeout = aiohttp.ClientTimeout(total=None, connect=timeout, sock_connect=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._pages: ReceiverPool | None = None  # page streams bypass aiohttp (page_receiver.py)
        self._stall_timeout = stall_timeout  # a page stream silent this long is broken (None: wait)

    @property
    def session(self) -> aiohttp.ClientSession:
        # Created on first use, inside the event loop that will use it.
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                headers=self._headers,
                timeout=self._timeout,
                read_bufsize=1 << 20,
                connector=aiohttp.TCPConnector(limit=64, keepalive_timeout=60, ssl=self._ssl),
            )
        return self._session

    async def aclose(self) -> None:
        if self._pages is not None:
            self._pages.close()
        if self._session is not None:
            await self._session.close()

    async def _json(self, method: str, path: str, **kwargs) -> dict:
        async with self.session.request(method, self.base_url + path, **kwargs) as response:
            body = await response.read()
            _raise_for(response, body)
            return json.loads(body)

    async def healthz(self) -> dict:
        """Liveness (the one route that needs no key)."""
        return await self._json("GET", "/healthz")

    async def info(self) -> dict:
        return await self._json("GET", "/v1/info")

    async def status(self) -> dict:
        return await self._json("GET", "/v1/status")

    async def tokenize(self, messages: list[dict] | None = None, prompt: str | None = None) -> list[int]:
        return (await self._json("POST", "/v1/tokenize", json={"messages": messages, "prompt": prompt}))["token_ids"]

    async def configure(self, **body) -> dict:
        """POST /v1/config: check (dry_run) or switch the node's engine, model and budget."""
        return await self._json("POST", "/v1/config", json=body)

    async def local_models(self) -> dict:
        return await self._json("GET", "/v1/models/local")

    async def create_handoff(self, **body) -> dict:
        return await self._json("POST", "/v1/handoffs", json=body)

    async def cancel_handoff(self, room: str) -> dict:
        return await self._json("DELETE", f"/v1/handoffs/{room}")

    @asynccontextmanager
    async def page_stream(
        self, room: str, expect: FrameExpectation | None, path: str | None = None
    ) -> AsyncIterator[PageStream]:
        """A room's pages and its PrefillDone, checked against `expect`, received in place.

        Leaving the block before the stream ends closes the connection, which tells the
        prefiller its reader is gone.
        """
        if self._pages is None:
            self._pages = ReceiverPool(
                self.base_url, self._headers, self._ssl, self._timeout.connect, stall_timeout=self._stall_timeout
            )
        try:
            async with self._pages.stream(path or f"/v1/handoffs/{room}/pages", expect) as stream:
                yield stream
        except HTTPStatusError as e:
            raise _http_error(e.status, f"{self._pages.host}:{self._pages.port}", e.body) from None

    async def lines(self, path: str, body: dict) -> AsyncIterator[dict]:
        """POST and read an NDJSON token stream line by line."""
        async with self.session.post(self.base_url + path, json=body) as response:
            if response.status >= 400:
                _raise_for(response, await response.read())
            async for line in response.content:
                if line.strip():
                    yield json.loads(line)
