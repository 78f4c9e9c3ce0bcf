"""The decoder's side of the page stream: an HTTP/1.1 client that receives pages in place.

`GET /v1/handoffs/{handoff_id}/pages` answers with a chunked body of frames (node_agent/wire.py). A
general HTTP client (aiohttp, httpx) reads the socket into its own buffers and hands out byte
chunks, which then have to be copied into page buffers: measured here, that capped the stream at
~1.7 GB/s against ~6 GB/s for a raw socket. This client is an `asyncio.BufferedProtocol`: while a
page's payload is arriving, the socket writes straight into that page's buffer (`recv_into`), so
each byte is copied once, by the kernel. Only the small parts (status line, headers, chunk-size
lines, frame headers) go through a scratch buffer.

It speaks just what the page stream needs: one GET, a response with a chunked body (or a
Content-Length body for errors), keep-alive for the next request. Connections are pooled per peer
by `ReceiverPool`; a pooled connection the server closed in the meantime is retried once.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

from .handoff import PrefillDone
from .pages import FrameExpectation, KVPage, codec_pool
from .wire import FrameReader

MAX_HEAD = 64 * 1024  # status line + headers
MAX_ERROR_BODY = 64 * 1024  # of an error's body, what is kept (the rest is not read: the connection closes)
SMALL_READ = 256  # how much to read while expecting a chunk-size line
QUEUE_PAGES = 8  # pages received but not yet taken by the decoder before reading pauses
# Payload reads stop at 512 KiB so that each piece is hashed while the kernel's copy of it is
# still in cache (measured on this machine: xxh3 over whole-page reads ran at ~24 GB/s, over
# 512 KiB pieces at ~31 GB/s; smaller pieces cost more in per-read overhead than they save).
DIRECT_READ = 512 * 1024


class StreamBroken(ConnectionError):
    """The connection failed or closed before the page stream ended."""


class HTTPStatusError(Exception):
    def __init__(self, status: int, body: bytes):
        super().__init__(f"HTTP {status}")
        self.status = status
        self.body = body


class _Receiver(asyncio.BufferedProtocol):
    """One connection; parses one response at a time (see the module docstring)."""

    def __init__(self, stall_timeout: float | None = None) -> None:
        self.stall_timeout = stall_timeout
        self.transport: asyncio.Transport | None = None
        self._small = bytearray(MAX_HEAD)
        self._lost: BaseException | None = None
        self._wake: asyncio.Event = asyncio.Event()
        self.reused = 0
        self._reset(None)

    def _reset(self, reader: FrameReader | None) -> None:
        self.reader = reader
        self.items: list = []  # pages and PrefillDone, in order; an exception ends the list
        self.got_bytes = False
        self.last_data = time.monotonic()  # when a byte last came (the stall timeout's clock)
        self.keep_alive = True
        self.complete = False
        self._state = "head"
        self._used = 0  # bytes in _small not yet parsed
        self._chunk_left = 0
        self._length: int | None = None  # Content-Length body (errors)
        self._status = 0
        self._body = bytearray()
        self._direct = False

    # ---- asyncio protocol ----------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc: BaseException | None) -> None:
        self._lost = exc or StreamBroken("the peer closed the connection")
        if self.reader is not None and not self.complete:
            self._fail(
                StreamBroken(
                    f"connection closed after {self.reader.bytes_read:,} bytes of the page stream"
                    + (f" ({exc})" if exc else "")
                )
            )
        self._wake.set()

    def get_buffer(self, sizehint: int) -> memoryview:
        self._direct = False
        if self._state == "data" and self._length is None and self._status < 300:
            space = self.reader.payload_space()
            if space is not None:
                self._direct = True
                return space[: min(self._chunk_left, DIRECT_READ)]
            want = min(self._chunk_left, self.reader.head_missing())
        elif self._state in ("size", "crlf", "trailer"):
            want = SMALL_READ
        else:
            want = MAX_HEAD
        end = min(len(self._small), self._used + want)
        return memoryview(self._small)[self._used : end]

    def buffer_updated(self, nbytes: int) -> None:
        self.got_bytes = True
        self.last_data = time.monotonic()
        try:
            if self._direct:
                self._chunk_left -= nbytes
                self._deliver(self.reader.payload_received(nbytes))
                if self._chunk_left == 0:
                    self._state = "crlf"
            else:
                self._used += nbytes
                self._parse_small()
        except Exception as e:  # a bad frame or bad HTTP: the stream is over
            self._fail(e)
            self.keep_alive = False
            self.transport.close()

    def eof_received(self) -> bool:
        return False  # close; connection_lost reports what was missing

    # ---- parsing ---------------------------------------------------------------------------
    def _parse_small(self) -> None:
        buf, pos = memoryview(self._small), 0
        while pos < self._used and not self.complete:
            if self._state == "head":
                end = self._small.find(b"\r\n\r\n", 0, self._used)
                if end < 0:
                    if self._used == len(self._small):
                        raise StreamBroken(f"response headers longer than {MAX_HEAD} bytes")
                    break
                self._parse_head(bytes(buf[:end]))
                pos = end + 4
            elif self._state in ("size", "crlf", "trailer"):
                end = self._small.find(b"\r\n", pos, self._used)
                if end < 0:
                    if self._used - pos > 1024:
                        raise StreamBroken("malformed chunked encoding (no line end)")
                    break
                line = bytes(buf[pos:end])
                pos = end + 2
                self._line(line)
            elif self._length is not None:  # an error body with a Content-Length
                take = min(self._length - len(self._body), self._used - pos)
                self._body += buf[pos : pos + take]
                pos += take
                if len(self._body) == self._length or len(self._body) >= MAX_ERROR_BODY:
                    self._finish_error()
            else:  # chunk data through the scratch buffer (frame heads, small chunks, error bodies)
                take = min(self._chunk_left, self._used - pos)
                if self._status < 300:
                    self._deliver(self.reader.feed(buf[pos : pos + take]))
                else:
                    self._body += buf[pos : pos + take]
                self._chunk_left -= take
                pos += take
                if self._chunk_left == 0:
                    self._state = "crlf"
                if len(self._body) >= MAX_ERROR_BODY:
                    self._finish_error()
        # keep what is left (a partial line) at the front
        self._small[: self._used - pos] = bytes(buf[pos : self._used])
        self._used -= pos

    def _parse_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise StreamBroken(f"not an HTTP response: {lines[0][:80]!r}")
        self._status = int(parts[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip().lower()
        if headers.get(b"connection") == b"close" or parts[0] == b"HTTP/1.0":
            self.keep_alive = False
        if headers.get(b"transfer-encoding") == b"chunked":
            self._state = "size"
        elif b"content-length" in headers:
            self._length = int(headers[b"content-length"])
            self._state = "data"
            if self._length == 0:
                self._finish_error()
        else:
            raise StreamBroken("the page stream response has neither chunked encoding nor a length")
        if self._status < 300 and self._length is not None:
            raise StreamBroken("the page stream response is not chunked")
        self._wake.set()  # the status is known

    def _line(self, line: bytes) -> None:
        if self._state == "crlf":
            if line:
                raise StreamBroken("malformed chunked encoding (chunk longer than its size)")
            self._state = "size"
        elif self._state == "size":
            try:
                size = int(line.split(b";", 1)[0], 16)
            except ValueError:
                raise StreamBroken(f"malformed chunk size {line[:40]!r}") from None
            self._chunk_left, self._state = size, ("data" if size else "trailer")
        elif not line:  # the empty line after the last chunk (and any trailers)
            if self._status >= 300:
                self._finish_error()
            else:
                self.reader.close()  # raises if the final frame never came
                self.complete = True
                self._wake.set()

    def _finish_error(self) -> None:
        """The error, with its body's first MAX_ERROR_BODY bytes; a longer body is not read on
        (however long it claims to be): the connection closes."""
        self.complete = True
        if len(self._body) >= MAX_ERROR_BODY and len(self._body) != self._length:
            self.keep_alive = False
            self.transport.close()
        self._fail(HTTPStatusError(self._status, bytes(self._body[:MAX_ERROR_BODY])))

    def _deliver(self, items: list) -> None:
        if items:
            self.items.extend(items)
            self._wake.set()
            if len(self.items) >= QUEUE_PAGES and self.transport is not None:
                self.transport.pause_reading()  # the decoder is behind: let TCP push back

    def _fail(self, exc: BaseException) -> None:
        self.items.append(exc)
        self._wake.set()

    # ---- the consumer ----------------------------------------------------------------------
    def _stall_left(self) -> float | None:
        """Seconds until the stream counts as stalled: no byte at all for `stall_timeout`."""
        if self.stall_timeout is None:
            return None
        return self.last_data + self.stall_timeout - time.monotonic()

    async def next_item(self):
        while not self.items:
            if self.complete:
                return None
            if self._lost is not None:
                raise StreamBroken(f"the connection closed before the page stream ended ({self._lost})")
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), self._stall_left())
            except TimeoutError:
                if self._stall_left() > 0:  # bytes came meanwhile (a heartbeat, part of a page)
                    continue
                raise StreamBroken(
                    f"the page stream stalled: no data for {self.stall_timeout:g} s after "
                    f"{self.reader.bytes_read:,} bytes (link down or peer frozen)"
                ) from None
        item = self.items.pop(0)
        if len(self.items) < QUEUE_PAGES // 2 and self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, Future):  # an encoded page, decoded in the codec pool (FrameError if bad)
            return await asyncio.wrap_future(item)
        return item


class PageStream:
    """Async iterator over a handoff's pages and its PrefillDone; `bytes_read` counts wire bytes."""

    def __init__(self, receiver: _Receiver):
        self._r = receiver

    @property
    def bytes_read(self) -> int:
        return self._r.reader.bytes_read

    def __aiter__(self):
        return self

    async def __anext__(self) -> KVPage | PrefillDone:
        item = await self._r.next_item()
        if item is None:
            raise StopAsyncIteration
        return item


class ReceiverPool:
    """Keep-alive connections to one peer for page streams."""

    def __init__(
        self,
        base_url: str,
        headers: dict[str, str],
        ssl_context: ssl.SSLContext | bool | None,
        connect_timeout: float,
        max_idle: int = 4,
        stall_timeout: float | None = None,
    ):
        u = urlsplit(base_url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or (443 if u.scheme == "https" else 80)
        self._ssl = (
            None  # plain HTTP, whatever context was given
            if u.scheme != "https"
            else ssl_context
            if isinstance(ssl_context, ssl.SSLContext)
            else ssl.create_default_context()
            if ssl_context is None
            else _insecure()
        )
        self._headers = dict(headers)
        self._timeout = connect_timeout
        self._idle: list[_Receiver] = []
        self._max_idle = max_idle
        self._stall_timeout = stall_timeout

    async def _connect(self) -> _Receiver:
        loop = asyncio.get_running_loop()
        _, receiver = await asyncio.wait_for(
            loop.create_connection(
                lambda: _Receiver(self._stall_timeout),
                self.host,
                self.port,
                ssl=self._ssl,
                server_hostname=self.host if self._ssl else None,
            ),
            self._timeout,
        )
        return receiver

    @asynccontextmanager
    async def stream(
        self, path: str, expect: FrameExpectation | None, token: str | None = None
    ) -> AsyncIterator[PageStream]:
        """`token`: the bearer credential of this stream (a handoff's read token) in place of the pool's."""
        headers = self._headers | ({"Authorization": f"Bearer {token}"} if token else {})
        request = (
            f"GET {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            + "Accept: application/x-tandem-pages\r\n\r\n"
        ).encode()
        receiver = None
        for attempt in range(2):
            receiver = self._idle.pop() if self._idle and attempt == 0 else await self._connect()
            if receiver._lost is not None:
                continue
            receiver._reset(FrameReader(expect, codec_pool()))  # FP8/zstd pages decode off the loop
            receiver.transport.write(request)
            receiver.transport.resume_reading()
            # A reused connection the server had just closed fails before any byte: retry once.
            if await _response_started(receiver) or receiver.reused == 0:
                break
        if receiver._status >= 300:
            try:
                await receiver.next_item()  # raises HTTPStatusError with the body
            finally:
                receiver.transport.close()
        ok = False
        try:
            yield PageStream(receiver)
            ok = receiver.complete and not receiver.items and receiver.keep_alive
        finally:
            if ok and len(self._idle) < self._max_idle:
                receiver.reused += 1
                self._idle.append(receiver)
            else:
                receiver.transport.close()  # leaving early tells the prefiller we are gone

    def close(self) -> None:
        for r in self._idle:
            r.transport.close()
        self._idle.clear()


async def _response_started(receiver: _Receiver) -> bool:
    """Wait for the response's status line and headers (True), or the connection's end (False)."""
    while not receiver._status and receiver._lost is None and not receiver.items:
        receiver._wake.clear()
        await receiver._wake.wait()
    return bool(receiver._status) or receiver.got_bytes


def _insecure() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx
