"""A page stream's writes off the event loop: a thread of its own sends the frames on the socket.

Why. The prefiller's engine thread is host-bound on a fast accelerator (it spends its time in Python,
queueing kernels) and needs the GIL almost all the time. uvloop writes a response's buffers with the
GIL held: `transport.writelines` and the writes it queues reach the socket in `writev` calls made
inside the loop's callbacks, and over TLS `SSLObject.write`'s output is read out of its memory BIO
(a copy) and written the same way; on loopback, and at 10 GbE rates, each page's write is a
long stretch of the GIL taken from the engine thread. Measured on an H200 (issue 23): P's prefill
ran 1.3-1.6× slower while its own process streamed the pages. Here a thread does the writing with
calls that let go of the GIL: `socket.sendmsg` (plain HTTP) and, over TLS, `SSLObject.write` into
the connection's memory BIO (OpenSSL's encryption runs without the GIL) then `socket.send` of its
output. What it holds the GIL for is a few bytecodes per call (and, over TLS, the copy out of the
BIO, in slices of `TLS_SLICE`). bench/bench_sender.py measures P's prefill inside P/D ÷ alone for
both senders on both transports (bench/results/sender-*.md).

Measured on the 2-CPU development VM, shared (load average 6-50 from other work), with
`bench/bench_sender.py --engine synthetic --ops 5000 --chunks 16 --page-mib 8 --rounds 3`: an
engine thread host-bound as a GPU prefill is (tiny torch ops, each taking the GIL) making 8 MiB
pages at about 1.3 GB/s, streamed by the same process to a reader over loopback; the engine's time
in P/D ÷ alone, loop → thread: plain 1.79 → 1.20, TLS 3.45 → 2.09. What is left on two cores is
CPU, not the GIL: the kernel's copy and, over TLS, the encryption share them with the engine thread
and the reader. The real prefill on a GPU: `BENCH=sender bash bench/gpu_scale_run.sh`.
Not chosen: kTLS (the thread would write through the kernel's TLS) — Python 3.11's `ssl` has no
`OP_ENABLE_KTLS`, OpenSSL enables it only on a socket BIO (asyncio's TLS uses memory BIOs) and this
kernel offers no `tls` ULP; the engine in a process of its own — it moves the pages between
processes and changes the engine adapters, while the thread takes the writes off the GIL for both
transports in the HTTP layer alone.

How. `PageStreamProtocol` (http_server.py) lends the connection to a `SocketSender` for the body
of one page stream, once the response head has gone out and nothing is left in the transport's
buffer; the thread writes each chunk as the loop would (size line, header, payload, CRLF: the same
bytes on the wire), up to `DEPTH` chunks behind the loop, and hands the connection back before the
last chunk (uvicorn writes it, then the connection is kept alive as ever).
- Plain HTTP: the thread writes on a duplicate of the connection's descriptor (`os.dup`), so the
  loop may close its own at any time (a decoder that hung up: uvloop sees the EOF, uvicorn marks the
  request disconnected) without the descriptor being reused under the thread. The loop keeps reading.
- TLS: uvloop's TLS layer keeps its SSL object and BIOs to itself, so a server whose page streams
  use a thread serves TLS through `TlsLayer`, asyncio's own TLS protocol (the same state machine,
  in Python, on any loop), whose SSL object and outgoing BIO are lent to the thread: while lent, the
  connection's reading is paused and whatever the loop would do with the SSL object (a read, an
  EOF, the connection's loss) waits for the thread to hand it back. The certificate, its pinning
  and the TLS versions are the context's, unchanged.
- The stall timeout holds: the descriptor is in timeout mode (a `poll` for room, then the send;
  never a busy wait), so a send that moves no byte for `stall_timeout` fails; the thread then ends,
  the loop aborts the connection and the app sees a disconnect, as with the loop's own writes.
- Teardown: a response that ends early (its reader gone, a cancellation) calls `abandon`, which
  stops the thread at once (`shutdown` wakes a blocked send); the thread closes its descriptor
  itself and the connection is given back to the loop (over TLS, with the events it deferred)
  before anything else touches it. The loop never waits for the thread but on `close` (the end of
  a stream, every chunk written), and the thread waits on a condition, never a poll.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import ssl
import threading
from asyncio import sslproto
from collections.abc import Callable

log = logging.getLogger("tandem.http")

DEPTH = 2  # chunks handed to the thread and not yet written: the loop never waits while one is sent
TLS_SLICE = 1 << 20  # plaintext encrypted per SSLObject.write: the copy out of the BIO is this at most
_WAIT_FOREVER = 3600.0  # a send's poll timeout when there is no stall timeout (it is then retried)


def _bytes_view(piece) -> memoryview:
    view = memoryview(piece)
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


class SocketSender:
    """One thread that writes the chunks of one response body on `sock` (a descriptor of its own,
    closed by the thread when it ends); over TLS through `tls`, an SSL object and its outgoing BIO.

    `on_end(error)` runs on the loop once the thread has ended (None: every chunk handed over was
    written and `close` asked for the end)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        stall_timeout: float | None,
        on_end: Callable[[BaseException | None], None],
        tls: tuple[ssl.SSLObject, ssl.MemoryBIO] | None = None,
    ):
        self._loop, self._sock, self._stall, self._on_end, self._tls = loop, sock, stall_timeout, on_end, tls
        sock.settimeout(stall_timeout or _WAIT_FOREVER)  # O_NONBLOCK + poll: the loop's descriptor stays non-blocking
        self._cond = threading.Condition()
        self._chunks: collections.deque[tuple[list, Callable[[], None] | None] | None] = collections.deque()
        self._stop = False
        self._room: asyncio.Future | None = None  # the loop waits on it for a free place in the queue
        self.error: BaseException | None = None
        self.ended = loop.create_future()
        self._thread = threading.Thread(target=self._run, name="tandem-page-sender", daemon=True)
        self._thread.start()

    # The loop's side

    async def send(self, pieces: list, on_written: Callable[[], None] | None = None) -> bool:
        """Queue one chunk (its pieces, written in order); False once the thread has stopped. The
        pieces are referenced until written: callers must not change them. `on_written` runs on
        the loop once the chunk's last byte is in the socket (never, if the stream is abandoned
        first)."""
        while True:
            with self._cond:
                if self._stop or self.ended.done():
                    return False
                if len(self._chunks) < DEPTH:
                    self._chunks.append((pieces, on_written))
                    self._cond.notify()
                    return True
                self._room = room = self._loop.create_future()
            await room

    async def close(self) -> bool:
        """Write what is queued, then end the thread; True if everything was written."""
        with self._cond:
            self._chunks.append(None)
            self._cond.notify()
        await asyncio.shield(self.ended)
        return self.error is None

    def abandon(self) -> None:
        """Stop now, whatever is queued (the stream ended early); the thread ends on its own."""
        with self._cond:
            if self.ended.done():
                return
            self._stop = True
            self._chunks.clear()
            self._cond.notify()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes a send blocked for room
        except OSError:
            pass

    # The thread's side

    def _run(self) -> None:
        error = None
        try:
            while True:
                with self._cond:
                    while not self._chunks and not self._stop:
                        self._cond.wait()
                    if self._stop:
                        break
                    chunk = self._chunks[0]
                if chunk is None:
                    break
                pieces, on_written = chunk
                if self._tls is None:
                    self._sendmsg([_bytes_view(p) for p in pieces])
                else:
                    self._send_tls(pieces)
                with self._cond:
                    self._chunks.popleft()
                    room, self._room = self._room, None
                if room is not None or on_written is not None:
                    self._loop.call_soon_threadsafe(_written, room, on_written)
        except (OSError, ValueError) as e:  # ssl.SSLError and TimeoutError are OSErrors
            error = e if not self._stop else None
        finally:
            self._sock.close()
            with self._cond:
                self._stop = True
                room, self._room = self._room, None
            try:
                self._loop.call_soon_threadsafe(self._ended, error, room)
            except RuntimeError:  # the loop is closed: nobody is left to tell
                pass

    def _ended(self, error: BaseException | None, room: asyncio.Future | None) -> None:
        self.error = error
        if room is not None:
            _resolve(room)
        try:
            self._on_end(error)
        finally:
            self.ended.set_result(None)

    def _sendmsg(self, views: list[memoryview]) -> None:
        while views:
            sent = self._send_some(lambda: self._sock.sendmsg(views))
            while sent:
                if sent >= len(views[0]):
                    sent -= len(views[0])
                    views.pop(0)
                else:
                    views[0], sent = views[0][sent:], 0
            while views and not len(views[0]):
                views.pop(0)

    def _send_tls(self, pieces: list) -> None:
        sslobj, outgoing = self._tls
        for piece in pieces:
            view = _bytes_view(piece)
            for start in range(0, len(view), TLS_SLICE):
                sslobj.write(view[start : start + TLS_SLICE])  # encrypts without the GIL
                self._sendmsg([memoryview(outgoing.read())])

    def _send_some(self, send: Callable[[], int]) -> int:
        """One send that moves some bytes, waiting for room at most the stall timeout."""
        while True:
            if self._stop:
                raise ConnectionAbortedError("the page stream was abandoned")
            try:
                return send()
            except TimeoutError:
                if self._stall is not None:
                    peer = _peer(self._sock)
                    log.warning("%s took no data for %g s; closing its connection", peer, self._stall)
                    raise


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _written(room: asyncio.Future | None, on_written: Callable[[], None] | None) -> None:
    if room is not None:
        _resolve(room)
    if on_written is not None:
        on_written()


def _peer(sock: socket.socket):
    try:
        return sock.getpeername()
    except OSError:
        return None


def dup_socket(transport: asyncio.BaseTransport) -> socket.socket | None:
    """A socket object on a duplicate of the transport's descriptor (None if it has none)."""
    raw = transport.get_extra_info("socket")
    fd = raw.fileno() if raw is not None else -1
    if fd < 0:
        return None
    return socket.socket(fileno=os.dup(fd))


class TlsLayer(sslproto.SSLProtocol):
    """asyncio's server-side TLS protocol, whose SSL object can be lent to a `SocketSender`.

    While lent, the connection is not read and every call that would use the SSL object or its BIOs
    on the loop (data or EOF from the socket, the connection's loss, a write, a read resumed, a
    shutdown) is deferred until it is handed back, then run in order."""

    _lent = False

    def lend(self) -> tuple[ssl.SSLObject, ssl.MemoryBIO] | None:
        """The SSL object and its outgoing BIO for a sender, or None if the connection is not
        idle (a handshake or shutdown under way, bytes not yet written)."""
        if (
            self._lent
            or self._state != sslproto.SSLProtocolState.WRAPPED
            or self._get_write_buffer_size()
            or self._transport is None
            or self._transport.get_write_buffer_size()
        ):
            return None
        self._lent, self._deferred = True, []
        self._transport.pause_reading()
        return self._sslobj, self._outgoing

    def take_back(self) -> None:
        if not self._lent:
            return
        self._lent = False
        if self._transport is not None and not self._ssl_reading_paused:
            try:
                self._transport.resume_reading()
            except (AttributeError, RuntimeError):  # a transport that is closing
                pass
        deferred, self._deferred = self._deferred, []
        for call in deferred:
            call()

    def _defer(self, call: Callable[[], object]) -> bool:
        if self._lent:
            self._deferred.append(call)
        return self._lent

    def buffer_updated(self, nbytes):
        if self._lent:
            data = bytes(self._ssl_buffer_view[:nbytes])

            def replay():
                self._incoming.write(data)
                super(TlsLayer, self).buffer_updated(0)

            return self._defer(replay)
        return super().buffer_updated(nbytes)

    def eof_received(self):
        if self._lent:

            def replay():
                if not super(TlsLayer, self).eof_received() and self._transport is not None:
                    self._transport.close()

            return self._defer(replay)
        return super().eof_received()

    def connection_lost(self, exc):
        if not self._defer(lambda: super(TlsLayer, self).connection_lost(exc)):
            super().connection_lost(exc)

    def _do_read(self):
        if not self._defer(lambda: super(TlsLayer, self)._do_read()):
            super()._do_read()

    def _write_appdata(self, list_of_data):
        if not self._defer(lambda: super(TlsLayer, self)._write_appdata(list_of_data)):
            super()._write_appdata(list_of_data)

    def _start_shutdown(self):
        if not self._defer(lambda: super(TlsLayer, self)._start_shutdown()):
            super()._start_shutdown()
