"""The agent's page-stream response and the HTTP server protocol that writes it without copies.

Stock uvicorn frames every chunk of a chunked response as `b"".join([size, body, b"\\r\\n"])`, a
fresh copy of each 1.5 MB page on the hot path, and a frame is two pieces (an 88-byte header,
then the page's own buffer), so a plain ASGI response pays for a join and two sends per page.
`bench/bench_link.py` measures what that costs: its stock-uvicorn and aiohttp rows against this
server's, and against raw TCP.

- `PageStreamProtocol` is the server protocol, passed through uvicorn's config:
  `uvicorn.Config(app, http=PageStreamProtocol.with_stall_timeout(60))`. It is uvicorn's httptools
  protocol (parsing, keep-alive, flow control and every response unchanged) with two additions:
  - each request's scope carries the ASGI extension `tandem.vectored`, a `ChunkWriter` that
    hands one chunk of a chunked response body, in any number of pieces, to the connection's
    transport as one vector (`transport.writelines`): the page buffer goes to the socket as it is;
  - its flow control gives up on a reader that takes no byte for `stall_timeout` seconds (a
    pulled cable, a frozen peer: TCP alone would wait for many minutes) and aborts the
    connection; the app sees a disconnect and releases what the response held. This holds for
    every response on the server (the panel serves with it for this alone).
  `PageStreamProtocol.configured(stall_timeout, sender="thread", tls=context)` (the agent's) has
  the `ChunkWriter` lend the connection to a sender thread for the rest of a page stream's body
  (`tandem_protocol/page_sender.py`: why, how, what it measured) and serves TLS through the layer
  that can lend its SSL object to that thread.
- `PageStreamResponse` takes an iterator of frames, each a `bytes` or a `(header, payload)` pair, or
  a `TrackedFrame` (the pair, and a callback for when it is in the socket).
  Under a server with `tandem.vectored` a frame is one chunk, written by the `ChunkWriter`; any
  other server gets each frame joined into one body message (one copy, still correct).

uvicorn is pinned in pyproject.toml (the protocol relies on its cycle's `chunked_encoding`,
`response_started` and `disconnected` and on the protocol's `flow`); tests/unit/test_page_receiver.py,
tests/unit/test_http_server.py and tests/system/test_page_sender.py check the chunks on the wire, the stall
timeout and the release of a stream whose reader hung up, for both senders.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncIterable, Callable
from dataclasses import dataclass

from starlette.responses import StreamingResponse
from uvicorn.config import SSL_PROTOCOL_VERSION, create_ssl_context
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from .page_sender import SocketSender, TlsLayer, dup_socket, tls_protocol

EXTENSION = "tandem.vectored"
SENDERS = ("thread", "loop")

Frame = bytes | tuple[bytes, memoryview]
log = logging.getLogger("tandem.http")


class _ShutdownCancels(logging.Filter):
    """uvicorn cancels the requests still open when its graceful-shutdown period ends, says so in
    one line ("Cancel N running task(s)"), then logs each as an "Exception in ASGI application"
    with the cancellation's traceback. Those tracebacks are dropped: nothing failed."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, asyncio.CancelledError) and "graceful shutdown" in str(exc))


def server_tls_context(certfile, keyfile) -> ssl.SSLContext:
    """The context uvicorn would make of `ssl_certfile`/`ssl_keyfile` with its defaults, for
    `PageStreamProtocol.configured(tls=...)`."""
    return create_ssl_context(certfile, keyfile, None, SSL_PROTOCOL_VERSION, ssl.CERT_NONE, None, None)


def quiet_shutdown_cancels() -> None:
    logging.getLogger("uvicorn.error").addFilter(_ShutdownCancels())


class ChunkWriter:
    """Writes the body of one request's response, chunk by chunk, straight to its connection:
    through the loop's transport, or (a server configured with `sender="thread"`) through a
    `SocketSender`, a thread that takes the connection over for the rest of the body."""

    def __init__(self, cycle: RequestResponseCycle, flow: FlowControl, protocol: PageStreamProtocol | None = None):
        self._cycle, self._flow, self._protocol = cycle, flow, protocol
        self._sender: SocketSender | None = None
        self._may_lend = protocol is not None and protocol.sender == "thread"

    @property
    def usable(self) -> bool:
        """True once the response has started as a chunked body (not HEAD, not sized)."""
        c = self._cycle
        return c.response_started and bool(c.chunked_encoding) and c.scope["method"] != "HEAD"

    async def write(self, *pieces: bytes | memoryview, on_written: Callable[[], None] | None = None) -> bool:
        """One chunk made of `pieces`; False once the client is gone (nothing more is sent). The
        transport (or the sender thread) keeps references to the buffers until they are written:
        callers must not reuse them (page frames are immutable bytes or views of unchanging arrays).
        `on_written` runs on the loop once the chunk is in the socket (through the loop's transport:
        all but what its buffer holds below its low-water mark); never if the client goes first."""
        if not self.usable:
            raise RuntimeError("ChunkWriter.write before a chunked response started")
        if self._may_lend:
            self._may_lend = False
            self._sender = self._lend()
        if self._cycle.disconnected:
            return False
        size = sum(len(p) for p in pieces)
        if self._sender is not None:
            if len(pieces) > 1 and len(pieces[0]) <= 256:  # one small piece, not two: fewer TLS records
                pieces = (b"%x\r\n" % size + pieces[0], *pieces[1:])
            else:
                pieces = (b"%x\r\n" % size, *pieces)
            return await self._sender.send([*pieces, b"\r\n"], on_written)
        if self._flow.write_paused and not self._cycle.disconnected:
            await self._flow.drain()
        if self._cycle.disconnected:
            return False
        self._cycle.transport.writelines([b"%x\r\n" % size, *pieces, b"\r\n"])
        if on_written is not None:
            self._flow.when_writable(on_written)
        return True

    async def finish(self) -> bool:
        """Before the response's last message: every chunk written and the connection back with
        the loop's transport; False if the client is gone."""
        if self._sender is None:
            return not self._cycle.disconnected
        written = await self._sender.close()  # cancelled meanwhile: `abandon` still reaches the thread
        self._sender = None
        return written and not self._cycle.disconnected

    def abandon(self) -> None:
        """The response ends early (its reader gone, cancelled): stop the sender thread now."""
        if self._sender is not None:
            self._sender.abandon()

    def _lend(self) -> SocketSender | None:
        """A sender thread that owns the connection's writes from now on, or None (the transport
        is not idle, or is a TLS layer that cannot lend its SSL object): the loop writes."""
        transport = self._cycle.transport
        tls, layer = None, getattr(transport, "_ssl_protocol", None)
        if transport.get_extra_info("sslcontext") is not None:
            if not isinstance(layer, TlsLayer):  # uvloop's own TLS: its SSL object is out of reach
                return None
            tls = layer.lend()
            if tls is None:
                return None
        elif transport.get_write_buffer_size():
            return None
        sock = dup_socket(layer._transport if tls is not None else transport)
        if sock is None:
            if tls is not None:
                layer.take_back()
            return None

        def on_end(error: BaseException | None) -> None:
            if tls is not None:
                layer.take_back()
            if error is not None:
                peer = transport.get_extra_info("peername")
                log.debug("page stream to %s ended: %s: %s", peer, type(error).__name__, error)
                transport.abort()  # connection_lost follows: the cycle is marked disconnected

        loop = asyncio.get_running_loop()
        return SocketSender(loop, sock, self._protocol.stall_timeout, on_end, tls)


class StallFlowControl(FlowControl):
    """uvicorn's flow control, whose wait for a full send buffer to drain ends after `stall_timeout`
    seconds without progress by aborting the connection (a close would wait for the buffer)."""

    def __init__(self, transport: asyncio.Transport, stall_timeout: float | None):
        super().__init__(transport)
        self.stall_timeout = stall_timeout
        self._on_writable: list[Callable[[], None]] = []

    def when_writable(self, callback: Callable[[], None]) -> None:
        """`callback()` now if the transport's buffer is under its high-water mark, else once it
        has drained under its low-water mark (never, if the connection is lost first)."""
        if self.write_paused:
            self._on_writable.append(callback)
        else:
            callback()

    def resume_writing(self) -> None:
        super().resume_writing()
        callbacks, self._on_writable = self._on_writable, []
        for callback in callbacks:
            callback()

    async def drain(self) -> None:
        try:
            await asyncio.wait_for(self._is_writable_event.wait(), self.stall_timeout)
        except TimeoutError:
            peer = self._transport.get_extra_info("peername")
            log.warning("%s took no data for %g s; closing its connection", peer, self.stall_timeout)
            self._transport.abort()  # connection_lost follows: the cycle is marked disconnected
            await asyncio.sleep(0)  # let it run before the caller looks


class PageStreamProtocol(HttpToolsProtocol):
    stall_timeout: float | None = None  # None: wait for a slow reader as long as TCP does

    sender: str = "loop"

    @classmethod
    def with_stall_timeout(cls, seconds: float | None) -> type[PageStreamProtocol]:
        return cls.configured(seconds)

    @classmethod
    def configured(cls, stall_timeout: float | None, sender: str = "loop", tls: ssl.SSLContext | None = None):
        """The protocol for uvicorn's `http=`. `sender`: who writes a page stream's frames, "loop"
        (the transport) or "thread" (a `SocketSender`). `tls`: serve TLS with this context through
        `TlsLayer` (give uvicorn no certificate of its own): the TLS a sender thread can write."""
        if sender not in SENDERS:
            raise ValueError(f"sender is one of {SENDERS}, not {sender!r}")
        protocol = type(cls.__name__, (cls,), {"stall_timeout": stall_timeout, "sender": sender})
        return protocol if tls is None else tls_protocol(protocol, tls)

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self.flow = StallFlowControl(transport, self.stall_timeout)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if self.cycle is not None and self.cycle.scope is self.scope:  # an HTTP request (not an upgrade)
            self.scope.setdefault("extensions", {})[EXTENSION] = ChunkWriter(self.cycle, self.flow, self)


async def aclose(iterator) -> None:
    if hasattr(iterator, "aclose"):
        await iterator.aclose()


@dataclass(frozen=True, slots=True)
class TrackedFrame:
    """A frame (its pieces, written in order) whose `on_written` runs once it is in the socket, as
    `ChunkWriter.write` says; on a server without `tandem.vectored`, once its body message is sent.
    The prefiller's staging window gives a page's room back then, not when it is queued."""

    pieces: tuple[bytes | memoryview, ...]
    on_written: Callable[[], None]


class PageStreamResponse(StreamingResponse):
    media_type = "application/x-tandem-pages"

    def __init__(self, frames: AsyncIterable[Frame | TrackedFrame]):
        super().__init__(frames, media_type=self.media_type)

    async def stream_response(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        writer = self._writer if self._writer is not None and self._writer.usable else None
        ended = False
        try:
            async for frame in self.body_iterator:
                on_written = None
                if isinstance(frame, TrackedFrame):
                    frame, on_written = frame.pieces, frame.on_written
                pieces = frame if isinstance(frame, tuple) else (frame,)
                if writer is not None:
                    if not await writer.write(*pieces, on_written=on_written):  # the client is gone
                        return
                else:
                    await send({"type": "http.response.body", "body": b"".join(pieces), "more_body": True})
                    if on_written is not None:
                        on_written()
            ended = True
            if writer is not None and not await writer.finish():
                return
        finally:
            if writer is not None:
                writer.abandon()  # a no-op once finished
            if not ended:  # the client is gone, or the task cancelled (Starlette's disconnect listener)
                await aclose(self.body_iterator)  # let go of the frames' source now, not at collection
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope, receive, send) -> None:
        self._writer: ChunkWriter | None = (scope.get("extensions") or {}).get(EXTENSION)
        await super().__call__(scope, receive, send)
