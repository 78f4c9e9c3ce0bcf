"""The agent's page-stream response and the HTTP server protocol that writes it without copies.

Stock uvicorn frames every chunk of a chunked response as `b"".join([size, body, b"\\r\\n"])`, a
fresh copy of each 1.5 MB page on the hot path (measured here: the page stream topped out near
3 GB/s on the sender while a raw socket moves 6 GB/s), and a frame is two pieces (an 88-byte
header, then the page's own buffer), so a plain ASGI response would pay for two sends per page.

- `PageStreamResponse` takes an iterator of frames, each a `bytes` or a `(header, payload)` pair.
  Where the server declares the ASGI extension `tandem.vectored`, a pair goes out as one body
  message carrying the payload beside the header (`"tandem.payload"`); any other server gets
  the two joined (one copy, still correct).
- `PageStreamProtocol` (pass as `uvicorn.Config(http=PageStreamProtocol)`) is uvicorn's httptools
  protocol with that extension: large chunks (and header + payload pairs) are handed to the
  transport as one vector (`transport.writelines`), one chunk per frame, so the page buffer goes
  to the socket as it is. Everything else (parsing, keep-alive, flow control) is uvicorn's.
- A reader that takes no byte for `stall_timeout` seconds (a pulled cable, a frozen peer: TCP
  alone would wait for many minutes) gets its connection closed; the app sees a disconnect and
  releases what the response held. `PageStreamProtocol.with_stall_timeout(s)` sets it.

The cost of the trick is one line that swaps the class of the request cycle uvicorn has just
built; uvicorn is pinned in pyproject.toml and tests/test_agent_pd.py exercises this path.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable

from starlette.responses import StreamingResponse
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

VECTOR_MIN = 64 * 1024  # smaller chunks: uvicorn's join is cheaper than a vectored write
EXTENSION = "tandem.vectored"
PAYLOAD_KEY = "tandem.payload"

Frame = bytes | tuple[bytes, memoryview]
log = logging.getLogger("tandem.http")


class PageStreamResponse(StreamingResponse):
    media_type = "application/x-tandem-pages"

    def __init__(self, frames: AsyncIterable[Frame]):
        super().__init__(frames, media_type=self.media_type)

    async def stream_response(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        vectored = EXTENSION in self._scope_extensions
        async for frame in self.body_iterator:
            if isinstance(frame, tuple):
                header, payload = frame
                if vectored:
                    await send({"type": "http.response.body", "body": header, PAYLOAD_KEY: payload, "more_body": True})
                    continue
                frame = b"".join(frame)
            await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope, receive, send) -> None:
        self._scope_extensions = scope.get("extensions") or {}
        await super().__call__(scope, receive, send)


class _VectoredCycle(RequestResponseCycle):
    stall_timeout: float | None = None

    async def send(self, message) -> None:
        if message["type"] == "http.response.body" and self.flow.write_paused and not self.disconnected:
            try:
                await asyncio.wait_for(self.flow.drain(), self.stall_timeout)
            except TimeoutError:
                log.warning(
                    "%s %s: the reader took no data for %g s; closing its connection",
                    self.scope["method"],
                    self.scope["path"],
                    self.stall_timeout,
                )
                self.transport.close()  # the app sees a disconnect and lets go of what it holds
                self.disconnected = True
                return
        body = message.get("body", b"")
        payload = message.get(PAYLOAD_KEY)
        if (
            message["type"] == "http.response.body"
            and message.get("more_body", False)
            and self.response_started
            and self.chunked_encoding
            and self.scope["method"] != "HEAD"
            and (payload is not None or len(body) >= VECTOR_MIN)
        ):
            if self.flow.write_paused and not self.disconnected:
                await self.flow.drain()
            if self.disconnected:
                return
            # The transport keeps references to the buffers until they are written: callers must
            # not reuse them (page frames are immutable bytes or views of unchanging arrays).
            if payload is None:
                self.transport.writelines([b"%x\r\n" % len(body), body, b"\r\n"])
            else:
                self.transport.writelines([b"%x\r\n" % (len(body) + len(payload)), body, payload, b"\r\n"])
            return
        if payload is not None:  # not a chunked body after all (HEAD, an error...): send it whole
            message = {
                "type": message["type"],
                "body": body + bytes(payload),
                "more_body": message.get("more_body", False),
            }
        await super().send(message)


class PageStreamProtocol(HttpToolsProtocol):
    stall_timeout: float | None = None  # None: wait for a slow reader as long as TCP does

    @classmethod
    def with_stall_timeout(cls, seconds: float | None) -> type[PageStreamProtocol]:
        return type(cls.__name__, (cls,), {"stall_timeout": seconds})

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if type(self.cycle) is RequestResponseCycle:
            self.cycle.__class__ = _VectoredCycle  # before its task first runs: nothing is sent yet
            self.cycle.stall_timeout = self.stall_timeout
            self.cycle.scope.setdefault("extensions", {})[EXTENSION] = {}
