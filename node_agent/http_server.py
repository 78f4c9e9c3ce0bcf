"""The agent's HTTP server protocol: uvicorn's httptools protocol, writing large chunks without a copy.

Stock uvicorn frames every chunk of a chunked response as `b"".join([size, body, b"\\r\\n"])`, a
fresh copy of each 1.5 MB page frame on the hot path (measured here: the page stream topped out
near 3 GB/s on the sender while a raw socket moves 6 GB/s). This subclass hands large chunks to
the transport as a vector instead (`transport.writelines`), so the body buffer goes to the
socket as it is. Everything else (parsing, keep-alive, flow control, completion) is uvicorn's.

The cost of the trick is one line that swaps the class of the request cycle uvicorn has just
built; uvicorn is pinned in pyproject.toml and tests/test_agent_pd.py exercises this path.
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

VECTOR_MIN = 64 * 1024  # smaller chunks: uvicorn's join is cheaper than a vectored write


class _VectoredCycle(RequestResponseCycle):
    async def send(self, message) -> None:
        body = message.get("body", b"")
        if (message["type"] == "http.response.body" and message.get("more_body", False)
                and self.response_started and self.chunked_encoding and len(body) >= VECTOR_MIN
                and self.scope["method"] != "HEAD"):
            if self.flow.write_paused and not self.disconnected:
                await self.flow.drain()
            if self.disconnected:
                return
            # The transport keeps a reference to `body` until it is written: callers must not
            # reuse the buffer (page frames are immutable bytes or views of unchanging arrays).
            self.transport.writelines([b"%x\r\n" % len(body), body, b"\r\n"])
            return
        await super().send(message)


class PageStreamProtocol(HttpToolsProtocol):
    """Pass as `uvicorn.Config(http=PageStreamProtocol)`."""

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if type(self.cycle) is RequestResponseCycle:
            self.cycle.__class__ = _VectoredCycle  # before its task first runs: nothing is sent yet
