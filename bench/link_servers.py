"""Page-stream servers for bench/bench_link.py: the same synthetic pages as the agent's
GET /v1/bench/pages, served three ways, so that the reason for the agent's own writer is
reproducible.

    python bench/link_servers.py KIND CONTRACT_HEX     prints "ready PORT", serves until killed

KIND:
- tandem:  a Starlette app, PageStreamResponse under uvicorn with PageStreamProtocol (the agent's
           server without the agent): one vectored write per frame, the page buffer as it is;
- uvicorn: the same app with Starlette's StreamingResponse under stock uvicorn (httptools): each
           frame joined into one body message (a copy), which uvicorn frames with another join;
- aiohttp: aiohttp's web server, StreamResponse.write of the header then the payload.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import xxhash  # noqa: E402

from tandem_protocol.handoff import PrefillDone  # noqa: E402
from tandem_protocol.pages import PageGeometry, encode_frame, make_page  # noqa: E402
from tandem_protocol.wire import done_frame  # noqa: E402

SMOLLM2 = PageGeometry(layers=30, kv_heads=3, head_dim=64)


def frames(count: int, contract: bytes):
    """`count` pages framed as the agent frames them (header, payload view), then the final frame."""
    page = make_page(SMOLLM2, 0, np.random.default_rng(0).standard_normal(SMOLLM2.page_shape).astype("<f2"))
    hashed = xxhash.xxh3_64(page.data)
    for i in range(count):
        page.index = i
        yield encode_frame(page, contract=contract, handoff_id=b"\0" * 16, tokens=b"\0" * 16, payload_state=hashed)
    yield (done_frame(PrefillDone(0, count * SMOLLM2.page_tokens, count, 0.0)), memoryview(b""))


def starlette_app(vectored: bool, contract: bytes):
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from tandem_protocol.http_server import PageStreamResponse

    async def pages(request):
        count = int(request.query_params.get("count", 100))
        if vectored:
            return PageStreamResponse(_aiter(frames(count, contract)))
        return StreamingResponse(_aiter(b"".join(f) for f in frames(count, contract)))

    return Starlette(routes=[Route("/v1/bench/pages", pages)])


async def _aiter(items):
    for item in items:
        yield item


def serve_uvicorn(sock: socket.socket, vectored: bool, contract: bytes) -> None:
    import uvicorn

    from tandem_protocol.http_server import PageStreamProtocol

    kwargs = {"http": PageStreamProtocol} if vectored else {}  # else uvicorn's own (httptools)
    config = uvicorn.Config(starlette_app(vectored, contract), log_level="warning", loop="uvloop", **kwargs)
    uvicorn.Server(config).run(sockets=[sock])


def serve_aiohttp(sock: socket.socket, contract: bytes) -> None:
    import asyncio

    import uvloop
    from aiohttp import web

    async def pages(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/x-tandem-pages"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        for header, payload in frames(int(request.query.get("count", 100)), contract):
            await response.write(header)
            if payload:
                await response.write(payload)
        await response.write_eof()
        return response

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/v1/bench/pages", pages)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        await asyncio.Event().wait()

    uvloop.run(main())


def main(kind: str, contract_hex: str) -> None:
    contract = bytes.fromhex(contract_hex)
    sock = socket.create_server(("127.0.0.1", 0))
    print("ready", sock.getsockname()[1], flush=True)
    if kind == "aiohttp":
        serve_aiohttp(sock, contract)
    elif kind in ("tandem", "uvicorn"):
        serve_uvicorn(sock, kind == "tandem", contract)
    else:
        sys.exit(f"unknown server kind {kind!r}: tandem, uvicorn or aiohttp")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(*sys.argv[1:])
