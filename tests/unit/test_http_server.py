"""The agent's HTTP protocol (tandem_protocol/http_server.py) on a real uvicorn server: a reader
that takes nothing is hung up on after the stall timeout, and the response lets go of its source
(page streams and ordinary streaming answers alike)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route

from tandem_protocol.http_server import PageStreamProtocol, PageStreamResponse

STALL = 0.5


def endless_app(released: asyncio.Event) -> Starlette:
    chunk = bytes(1 << 20)

    async def frames():
        try:
            while True:
                yield (chunk[:88], memoryview(chunk))
        finally:
            released.set()

    async def pages(request):
        return PageStreamResponse(frames())

    async def text(request):
        async def lines():
            try:
                while True:
                    yield chunk
                    await asyncio.sleep(0)  # as a real source awaits its next token
            finally:
                released.set()

        return StreamingResponse(lines())

    return Starlette(routes=[Route("/pages", pages), Route("/text", text)])


@pytest.mark.parametrize("path", ["/pages", "/text"])
def test_a_reader_that_takes_nothing_is_hung_up_on(path):
    async def main():
        released = asyncio.Event()
        sock = socket.create_server(("127.0.0.1", 0))
        config = uvicorn.Config(
            endless_app(released), http=PageStreamProtocol.with_stall_timeout(STALL), log_level="error"
        )
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        try:
            client.connect(sock.getsockname())
            client.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            t0 = time.perf_counter()
            await asyncio.wait_for(released.wait(), 20)  # the response let go of its source
            waited = time.perf_counter() - t0
            assert STALL <= waited < 10 * STALL + 5, waited
            client.settimeout(10)  # the endless answer ends: what the kernel had buffered, then EOF
            got = 0
            with contextlib.suppress(ConnectionResetError):
                while n := len(client.recv(1 << 20)):
                    got += n
            assert got < 64 << 20, got
        finally:
            client.close()
            server.should_exit = True
            await task

    asyncio.run(main())
