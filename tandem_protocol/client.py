"""HTTP client for talking to an agent: used by decoders (to reach prefillers), the panel and tests.

Control calls and token streams go through httpx, the one HTTP client library of the product (its
CLI's too). It is the slower of the two this client has used: bench/bench_http_client.py, both in
one run against a torch agent on this 2-core machine under heavy load (load average ~25), measured
GET /v1/info at 6.85 ms (httpx) against 0.53 ms (aiohttp) a call on a kept-alive connection, and
a client reading a local NDJSON stream at 8,200 against 20,400 lines a second. A token stream is
paced by its engine (tens to hundreds of lines a second), far under either ceiling; the per-call
cost is paid three times before a P/D request's first token (tokenize, decode, D's handoff on P):
re-measure on a quiet machine before trading the single library for it. Page streams, the hot
path, go through `page_receiver.py`, which receives pages in place. One
`AgentClient` per peer keeps both connection pools, so a decoder reuses its connections to a
prefiller across requests instead of paying a TCP (and TLS) handshake.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx

from .api import TOKENIZE_SECONDS, HandoffBody, TokenizeAnswer, TokenizeBody
from .errors import TandemError
from .page_receiver import MAX_ERROR_BODY, HTTPStatusError, PageStream, ReceiverPool
from .pages import PROTOCOL_VERSION, FrameExpectation
from .settings import settings
from .tls import client_context

# The client side of the wire, for the callers that catch transport failures.
TransportError = (httpx.TransportError, ConnectionError, TimeoutError)  # StreamBroken is a ConnectionError


class AgentHTTPError(TandemError):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "AgentHTTPError",
        detail: dict | None = None,
        retry_after: float | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.detail = detail or {}  # the agent's error object (e.g. "field" for a bad configuration)
        self.retry_after = retry_after  # the answer's Retry-After (a 429), in seconds


def _http_error(status: int, where: str, body: bytes, retry_after: str | None = None) -> AgentHTTPError:
    try:
        err = json.loads(body)["error"]
        kind, message = err.get("type", "error"), err.get("message", "")
    except (ValueError, KeyError, TypeError, AttributeError):
        err, kind, message = {}, "error", body[:500].decode(errors="replace")
    try:
        retry = float(retry_after) if retry_after else None
    except ValueError:  # an HTTP date: agents never send one
        retry = None
    return AgentHTTPError(status, f"{where} answered {status} {kind}: {message}", kind, err, retry)


# A peer's answers are read up to these sizes, no further (the connection is closed past them): a
# hostile or broken peer cannot make the reader hold what it sends.
MAX_JSON = 1 << 20  # a JSON answer (status, info, a handoff); an error's body: MAX_ERROR_BODY
MAX_LINE = 1 << 20  # one line of a token stream


# How long a call that is not a stream waits for its answer (httpx's read and write timeouts), so
# that an agent that hangs, or whose event loop is held, cannot hold its caller forever: past it,
# a TransportError, as for an agent that cannot be reached. Each is far above what a working agent
# takes, so that none cuts a legitimate call short.
# healthz, info, status, local models, cancelling a handoff: milliseconds, a second or two for a
# server engine's status or a listing of the model roots.
CONTROL_SECONDS = 60.0
# A tokenize: the agent fails it itself once TOKENIZE_SECONDS have passed, with a 400 that says
# why; that answer is waited for.
TOKENIZE_WAIT = TOKENIZE_SECONDS + 30.0
# A configuration may close the engine and load another (a vLLM or SGLang server may take its
# whole start timeout, 600 s by default, and a new checkpoint's contract hashes every weight
# file), then load the old one again if that failed: an hour, for an administrator's action.
CONFIG_SECONDS = 3600.0
# A link probe pulls `megabytes`: CONTROL_SECONDS plus a second a megabyte, far slower than any
# link P/D can use. A handoff's creation waits up to its `wait_timeout` for staging budget
# (HandoffBody, 30 s by default): CONTROL_SECONDS plus that.
LINK_SECONDS_PER_MB = 1.0


class AnswerTooLarge(TandemError, ConnectionError):
    """A peer's answer (or one line of it) is larger than the reader takes: a broken link to that
    peer, as TransportError counts it."""


async def read_capped(response: httpx.Response, limit: int) -> bytes:
    """The response's body, or AnswerTooLarge once it passes `limit` bytes (whatever its
    Content-Length claims: only what arrives counts)."""
    if response.status_code >= 400:
        limit = min(limit, MAX_ERROR_BODY)
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > limit:
            if response.status_code >= 400:  # the error's start says enough
                return bytes(body[:limit])
            raise AnswerTooLarge(f"{_peer(response)} answered more than {limit} bytes to {response.url.path}")
    return bytes(body)


async def capped_lines(response: httpx.Response) -> AsyncIterator[bytes]:
    """The response's lines, none longer than MAX_LINE."""
    pending = b""
    async for chunk in response.aiter_bytes():
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            yield line
        if len(pending) > MAX_LINE:
            raise AnswerTooLarge(f"{_peer(response)} sent a line longer than {MAX_LINE} bytes on {response.url.path}")
    if pending:
        yield pending


def _peer(response: httpx.Response) -> str:
    return f"{response.url.host}:{response.url.port}"


def _raise_for(response: httpx.Response, body: bytes) -> None:
    if response.status_code >= 400:
        raise _http_error(response.status_code, _peer(response), body, response.headers.get("retry-after"))


class AgentClient:
    def __init__(
        self,
        base_url: str,
        key: str,
        verify: bool | str | None = None,
        timeout: float = 30.0,
        stall_timeout: float | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        pin: str | None = None,
    ):
        """`pin`: the SHA-256 fingerprint of the certificate the agent must present over HTTPS
        (tandem_protocol/tls.py), checked before anything is sent — how agents' self-signed
        certificates are trusted. Without one, `verify`: True (system CAs), False (no check), a CA
        bundle path, or None for the TANDEM_CA_FILE environment variable when set and the system
        CAs otherwise. `transport`: an httpx transport for control calls and token streams (a unit
        test's fake agent); page streams never use it."""
        if verify is None:
            ca_file = settings().ca_file
            verify = str(ca_file) if ca_file else True
        self.base_url, self.pin = base_url.rstrip("/"), pin
        self._headers = {"X-Tandem-Protocol": str(PROTOCOL_VERSION)}
        if key:  # a keyless client (liveness only) sends none: "Bearer " alone is an illegal header
            self._headers["Authorization"] = f"Bearer {key}"
        self._ssl: ssl.SSLContext | bool | None = (
            client_context(pin)
            if pin and self.base_url.startswith("https://")
            else ssl.create_default_context(cafile=verify)
            if isinstance(verify, str)
            else (None if verify else False)
        )
        self._connect_timeout = timeout
        self._transport = transport
        self._http: httpx.AsyncClient | None = None
        self._pages: ReceiverPool | None = None  # page streams bypass httpx (page_receiver.py)
        self._stall_timeout = stall_timeout  # a page stream silent this long is broken (None: wait)

    @property
    def http(self) -> httpx.AsyncClient:
        # Created on first use, inside the event loop that will use it.
        if self._http is None or self._http.is_closed:
            self._http = httpx.AsyncClient(
                base_url=self.base_url,
                headers=self._headers,
                # connecting is bounded; reading is not: a decode may stream for minutes (a call
                # that is not a stream bounds its own, `_json`)
                timeout=httpx.Timeout(None, connect=self._connect_timeout),
                verify=True if self._ssl is None else self._ssl,
                limits=httpx.Limits(max_connections=64, keepalive_expiry=60),
                transport=self._transport,
            )
        return self._http

    async def aclose(self) -> None:
        if self._pages is not None:
            self._pages.close()
        if self._http is not None:
            await self._http.aclose()

    async def _json(self, method: str, path: str, wait: float | None = None, **kwargs) -> dict:
        """A call that is not a stream, its answer waited for `wait` seconds at most (default
        CONTROL_SECONDS; sending the body, then each read): past that, httpx's ReadTimeout or
        WriteTimeout (TransportError)."""
        wait = CONTROL_SECONDS if wait is None else wait
        timeout = httpx.Timeout(connect=self._connect_timeout, read=wait, write=wait, pool=None)
        try:
            async with self.http.stream(method, path, timeout=timeout, **kwargs) as response:
                body = await read_capped(response, MAX_JSON)
        except httpx.TimeoutException as e:
            if isinstance(e, httpx.ConnectTimeout | httpx.PoolTimeout):
                raise
            where = f"{self.base_url} {method} {path}"
            raise type(e)(f"{where}: no answer within {wait:g} s ({type(e).__name__})", request=e.request) from None
        _raise_for(response, body)
        return json.loads(body)

    async def healthz(self) -> dict:
        """Liveness (the one route that needs no key)."""
        return await self._json("GET", "/healthz")

    async def info(self) -> dict:
        return await self._json("GET", "/v1/info")

    async def status(self) -> dict:
        return await self._json("GET", "/v1/status")

    async def tokenize(self, **body) -> TokenizeAnswer:
        """POST /v1/tokenize with a TokenizeBody's fields (messages or prompt, tools, chat_template_kwargs)."""
        sent = TokenizeBody(**body).model_dump(exclude_none=True)
        return TokenizeAnswer(**await self._json("POST", "/v1/tokenize", TOKENIZE_WAIT, json=sent))

    async def configure(self, **body) -> dict:
        """POST /v1/config: check (dry_run) or switch the node's engine, model and budget."""
        return await self._json("POST", "/v1/config", CONFIG_SECONDS, json=body)

    async def local_models(self) -> dict:
        return await self._json("GET", "/v1/models/local")

    async def bench_link(self, peer: str, megabytes: int, peer_fingerprint: str | None = None) -> dict:
        """POST /v1/bench/link: this node pulls `megabytes` of synthetic pages from `peer` (the link
        from that prefiller to this decoder; over HTTPS it must present `peer_fingerprint`):
        bytes_per_second, rtt_seconds, page_bytes."""
        body = {"peer": peer, "megabytes": megabytes, "peer_fingerprint": peer_fingerprint}
        wait = CONTROL_SECONDS + megabytes * LINK_SECONDS_PER_MB
        return await self._json("POST", "/v1/bench/link", wait, json={k: v for k, v in body.items() if v is not None})

    async def create_handoff(self, **body) -> dict:
        wait = CONTROL_SECONDS + body.get("wait_timeout", HandoffBody.model_fields["wait_timeout"].default)
        return await self._json("POST", "/v1/handoffs", wait, json=body)

    async def cancel_handoff(self, handoff_id: str) -> dict:
        return await self._json("DELETE", f"/v1/handoffs/{handoff_id}")

    @asynccontextmanager
    async def page_stream(
        self, handoff_id: str, expect: FrameExpectation | None, path: str | None = None, token: str | None = None
    ) -> AsyncIterator[PageStream]:
        """A handoff's pages and its PrefillDone, checked against `expect`, received in place.
        `token`: the handoff's read token (what creating it answered), its stream's one credential.

        Leaving the block before the stream ends closes the connection, which tells the
        prefiller its reader is gone.
        """
        if self._pages is None:
            self._pages = ReceiverPool(
                self.base_url, self._headers, self._ssl, self._connect_timeout, stall_timeout=self._stall_timeout
            )
        try:
            async with self._pages.stream(path or f"/v1/handoffs/{handoff_id}/pages", expect, token) as stream:
                yield stream
        except HTTPStatusError as e:
            raise _http_error(e.status, f"{self._pages.host}:{self._pages.port}", e.body) from None

    async def lines(self, path: str, body: dict) -> AsyncIterator[dict]:
        """POST and read an NDJSON token stream line by line. An answer of 4xx/5xx (before any
        line) raises AgentHTTPError."""
        async with self.http.stream("POST", path, json=body) as response:
            if response.status_code >= 400:
                _raise_for(response, await read_capped(response, MAX_ERROR_BODY))
            async for line in capped_lines(response):
                if line.strip():
                    yield json.loads(line)
