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

A connection must deliver a whole request (headers and body) within `REQUEST_DEADLINE` seconds:
of its TCP connection (the TLS handshake included, under `configured(tls=...)`), or of the first
byte of a later request on a kept-alive one; it is aborted otherwise. The deadline ends with the
request's last byte, so answers that stream for minutes are never cut. Between requests a
kept-alive connection is uvicorn's to close (`timeout_keep_alive`). uvicorn alone times nothing
out before a request's end, and its `limit_concurrency` counts connections: a few hundred silent
or trickling sockets would answer every request with 503 (review finding M2). So, also, at that
limit a new connection closes the one that has waited longest for a request (silent, trickling,
idle between requests, or in its handshake), as nginx takes back its connections that wait for a
request when it runs out (`ngx_drain_connections`): sockets that send nothing never keep out a
client that asks at once. A connection whose request is being answered is never closed for room;
when every one is, uvicorn's 503 stands. No per-address cap: room is made whatever the number of
addresses a LAN host takes, and a cap would have to admit the panel's pool (64 connections per
agent) and every decoder's page streams.

uvicorn is pinned in pyproject.toml (the protocol relies on its cycle's `chunked_encoding`,
`response_started` and `disconnected`, on the protocol's `flow`, `connections`, `pipeline`, parser
callbacks and `on_response_complete`); tests/unit/test_page_receiver.py, tests/unit/test_http_server.py and
tests/system/test_page_sender.py check the chunks on the wire, the stall timeout, the release of a
stream whose reader hung up, for both senders, and the request deadline and the room made at the
limit; tests/system/test_idle_sockets.py holds hundreds of sockets on a real agent and panel.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import ssl
import time
from collections.abc import AsyncIterable, Callable
from dataclasses import dataclass

from starlette.responses import StreamingResponse
from uvicorn.config import SSL_PROTOCOL_VERSION, create_ssl_context
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from .page_sender import SocketSender, TlsLayer, dup_socket

EXTENSION = "tandem.vectored"
SENDERS = ("thread", "loop")

Frame = bytes | tuple[bytes, memoryview]
log = logging.getLogger("tandem.http")

# Seconds a connection has to deliver a whole request. No legitimate client comes near it: the
# largest body either server takes (the agent's 8 MiB limit) arrives in it at 1.2 Mbit/s, the
# panel's 4 MiB at 0.6 Mbit/s, slower than any working LAN link; page-stream GETs and the panel's
# calls are a few KB sent at once. It is nginx's default wait for a request's header
# (client_header_timeout) and asyncio's and uvloop's for a TLS handshake: one figure for each phase.
REQUEST_DEADLINE = 60.0
LOG_EVERY = 60.0  # seconds between warnings of connections closed (an attack closes hundreds)


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


class Intake:
    """One server's connections that owe it a request, oldest first (a dict keeps the order in
    which they began to wait), and how many of them are still in their TLS handshake: those are not
    yet among uvicorn's `connections`, but hold a socket all the same."""

    def __init__(self) -> None:
        self.waiting: dict[PageStreamProtocol, None] = {}
        self.handshaking = 0
        self._closed: collections.Counter[str] = collections.Counter()
        self._last_peer = None
        self._logged_at = -LOG_EVERY
        self._report: asyncio.TimerHandle | None = None

    @staticmethod
    def of(server_state) -> Intake:
        """The intake of the server whose shared state (uvicorn's `ServerState`) this is."""
        intake = getattr(server_state, "tandem_intake", None)
        if intake is None:
            intake = server_state.tandem_intake = Intake()
        return intake

    def closed(self, why: str, peer) -> None:
        """Counted, and told in one warning a second later (at most one every LOG_EVERY seconds)."""
        self._closed[why] += 1
        self._last_peer = peer
        if self._report is None:
            delay = max(1.0, self._logged_at + LOG_EVERY - time.monotonic())
            self._report = asyncio.get_running_loop().call_later(delay, self._warn)

    def _warn(self) -> None:
        counts = ", ".join(f"{n} {why}" for why, n in self._closed.items())
        log.warning(
            "closed connections that delivered no whole request: %s (the last from %s)", counts, self._last_peer
        )
        self._closed.clear()
        self._logged_at, self._report = time.monotonic(), None


class PageStreamProtocol(HttpToolsProtocol):
    stall_timeout: float | None = None  # None: wait for a slow reader as long as TCP does
    request_deadline: float | None = REQUEST_DEADLINE  # None: wait for a request forever (uvicorn's way)

    sender: str = "loop"

    @classmethod
    def with_stall_timeout(cls, seconds: float | None) -> type[PageStreamProtocol]:
        return cls.configured(seconds)

    @classmethod
    def configured(
        cls,
        stall_timeout: float | None,
        sender: str = "loop",
        tls: ssl.SSLContext | None = None,
        request_deadline: float | None = REQUEST_DEADLINE,
    ):
        """The protocol for uvicorn's `http=`. `sender`: who writes a page stream's frames, "loop"
        (the transport) or "thread" (a `SocketSender`). `tls`: serve TLS with this context through
        `TlsLayer` (give uvicorn no certificate of its own): the TLS a sender thread can write, and
        whose handshake the request deadline covers."""
        if sender not in SENDERS:
            raise ValueError(f"sender is one of {SENDERS}, not {sender!r}")
        attributes = {"stall_timeout": stall_timeout, "sender": sender, "request_deadline": request_deadline}
        protocol = type(cls.__name__, (cls,), attributes)
        if tls is None:
            return protocol

        def create(*args, **kwargs) -> DeadlineTlsLayer:
            http = protocol(*args, **kwargs)
            return DeadlineTlsLayer(asyncio.get_running_loop(), http, tls, None, server_side=True)

        return create

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._intake = Intake.of(self.server_state)
        self._deadline: asyncio.TimerHandle | None = None
        self._socket: asyncio.BaseTransport | None = None  # what the deadline aborts (under TLS: the TCP one)
        self._handshaking = False

    # A connection is counted and its deadline starts when its TCP connection is accepted: under
    # `DeadlineTlsLayer`, before the handshake (`tls_started`); in plain HTTP, at `connection_made`.
    # Under uvloop's own TLS (uvicorn given a certificate) only once the handshake is done: uvloop
    # gives up on a handshake after 60 s itself, but does not let it be counted.
    def tls_started(self, tcp: asyncio.BaseTransport) -> None:
        self._handshaking = True
        self._intake.handshaking += 1
        self._accepted(tcp)

    def tls_ended(self) -> None:
        """The TCP connection is gone; if before the handshake ended, uvicorn never heard of it."""
        if self._handshaking:
            self._handshake_over()
            self._forget()

    def _handshake_over(self) -> None:
        self._handshaking = False
        self._intake.handshaking -= 1

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self.flow = StallFlowControl(transport, self.stall_timeout)
        if self._handshaking:  # now one of uvicorn's connections: its deadline runs on
            self._handshake_over()
        else:
            self._accepted(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._forget()
        super().connection_lost(exc)

    def _accepted(self, tcp: asyncio.BaseTransport) -> None:
        self._socket = tcp
        self._intake.waiting[self] = None
        self._arm()
        self._make_room()

    def _make_room(self) -> None:
        """At the limit (where uvicorn answers every new request 503), close the connections that
        have waited longest for a request, so that this one's request is served."""
        limit = self.limit_concurrency
        if limit is None:
            return
        while len(self.connections) + self._intake.handshaking >= limit:
            oldest = next((c for c in self._intake.waiting if c is not self and not c._writing()), None)
            if oldest is None:  # every other connection is being answered
                return
            oldest._close("to make room")

    def _writing(self) -> bool:
        """Whether the end of an answer is still on its way out (its client may be slow to read it)."""
        return self.transport is not None and self.transport.get_write_buffer_size() > 0

    def _arm(self) -> None:
        if self.request_deadline is not None and self._deadline is None:
            self._deadline = self.loop.call_later(self.request_deadline, self._deadline_passed)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _forget(self) -> None:
        self._disarm()
        self._intake.waiting.pop(self, None)

    def _deadline_passed(self) -> None:
        self._deadline = None
        self._close(f"after {self.request_deadline:g} s")

    def _close(self, why: str) -> None:
        """Abort (nothing is owed to a client that has not asked) and count it out at once."""
        self._intake.closed(why, self._socket.get_extra_info("peername"))
        if self._handshaking:
            self._handshake_over()
        self._forget()
        self.connections.discard(self)
        self._socket.abort()

    # The request: its deadline runs from its first byte (from the connection's start, for the
    # first) to its last; a connection waits (may be closed for room) until a request of it is
    # whole and again once its answer is complete.
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()
        if self.cycle is None or not self.cycle.response_complete:  # being answered (not answered early)
            self._intake.waiting.pop(self, None)

    def on_response_complete(self) -> None:
        idle = not self.pipeline  # no request queued behind this one
        super().on_response_complete()
        if idle and not self.transport.is_closing():
            self._intake.waiting.setdefault(self, None)

    def handle_websocket_upgrade(self) -> None:
        self._forget()  # the connection is the WebSocket protocol's now
        super().handle_websocket_upgrade()

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if self.cycle is not None and self.cycle.scope is self.scope:  # an HTTP request (not an upgrade)
            self.scope.setdefault("extensions", {})[EXTENSION] = ChunkWriter(self.cycle, self.flow, self)


class DeadlineTlsLayer(TlsLayer):
    """`TlsLayer` that tells its HTTP protocol of the TCP connection before the handshake, so the
    request deadline covers a handshake that never ends, and counts it toward the limit."""

    def __init__(self, loop, http: PageStreamProtocol, *args, **kwargs):
        super().__init__(loop, http, *args, **kwargs)
        self._http = http

    def connection_made(self, transport):
        self._http.tls_started(transport)
        super().connection_made(transport)

    def connection_lost(self, exc):
        super().connection_lost(exc)
        self._http.tls_ended()


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


def raise_open_file_limit() -> None:
    """The soft limit on open files up to the hard one (as Go's runtime does): a server's
    connection limit (1024 on the panel) must not meet the common soft default of 1024 files."""
    try:
        import resource
    except ImportError:  # not on Windows
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 65536 if hard == resource.RLIM_INFINITY else hard  # macOS: no file limit, a kernel cap
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):  # a kernel cap below it: keep the soft limit
            pass
