"""The decoder's in-place page receiver (node_agent/page_receiver.py) against odd but legal HTTP.

A small asyncio server writes a real page stream (real frames) with whatever chunking and
connection behaviour a test asks for; the client under test is the product's AgentClient.
"""

from __future__ import annotations

import asyncio
import json
import resource

import numpy as np
import pytest

from tandem_protocol import pages
from tandem_protocol.client import AgentClient, AgentHTTPError, TransportError
from tandem_protocol.errors import FrameError
from tandem_protocol.handoff import PrefillDone
from tandem_protocol.pages import (
    FP8_E4M3 as FP8,
)
from tandem_protocol.pages import (
    HEADER_SIZE,
    MAGIC,
    PROTOCOL_VERSION,
    RAW,
    FrameExpectation,
    KVPage,
    PageGeometry,
    frame_bytes,
    make_page,
)
from tandem_protocol.wire import HEARTBEAT_FRAME, done_frame

GEOMETRY = PageGeometry(layers=2, kv_heads=1, head_dim=8)
HANDOFF_ID, TOKENS, CONTRACT = bytes(range(16)), bytes(range(16, 32)), bytes(range(32, 48))
EXPECT = FrameExpectation(CONTRACT, HANDOFF_ID, TOKENS, GEOMETRY)


def body(pages: int = 3, g: PageGeometry = GEOMETRY) -> tuple[bytes, list[np.ndarray]]:
    rng = np.random.default_rng(pages)
    kvs = [
        rng.standard_normal((g.layers, 2, 64 if i < pages - 1 else 5, g.kv_heads, g.head_dim)).astype("<f2")
        for i in range(pages)
    ]
    frames = b"".join(
        frame_bytes(make_page(g, i, kv), contract=CONTRACT, handoff_id=HANDOFF_ID, tokens=TOKENS)
        for i, kv in enumerate(kvs)
    )
    return frames + done_frame(PrefillDone(7, 64 * (pages - 1) + 5, pages, 0.1)), kvs


def chunked(data: bytes, sizes: list[int], trailer: bytes = b"") -> bytes:
    out, pos, i = bytearray(), 0, 0
    while pos < len(data):
        n = sizes[i % len(sizes)]
        out += b"%x;ext=1\r\n" % len(data[pos : pos + n]) + data[pos : pos + n] + b"\r\n"
        pos, i = pos + n, i + 1
    return bytes(out + b"0\r\n" + trailer + b"\r\n")


class Server:
    """Answers each request on a connection with the next canned response; counts connections."""

    def __init__(self, responses: list[bytes], close_after: bool = False, drip: int = 0):
        self.responses, self.close_after, self.drip = list(responses), close_after, drip
        self.connections = 0

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.responses:
                await r.readuntil(b"\r\n\r\n")
                data = self.responses.pop(0)
                for i in range(0, len(data), self.drip or len(data)):
                    w.write(data[i : i + (self.drip or len(data))])
                    await w.drain()
                if self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        w.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()


def ok(payload: bytes, *headers: str) -> bytes:
    return (
        "HTTP/1.1 200 OK\r\ncontent-type: application/x-tandem-pages\r\ntransfer-encoding: chunked\r\n"
        + "".join(h + "\r\n" for h in headers)
        + "\r\n"
    ).encode() + payload


async def pull(client: AgentClient, expect: FrameExpectation = EXPECT) -> list:
    async with client.page_stream(HANDOFF_ID.hex(), expect) as stream:
        return [item async for item in stream]


def check(items: list, kvs: list[np.ndarray]) -> None:
    assert [type(i) for i in items] == [KVPage] * len(kvs) + [PrefillDone]
    for page, kv in zip(items, kvs):
        assert np.array_equal(page.kv.view(np.uint16), kv.view(np.uint16))
    assert items[-1].first_token == 7


@pytest.mark.parametrize("sizes", [[1], [3, 1000, 7], [88], [65_536], [10**9]], ids=str)
def test_any_chunking_gives_the_same_pages(sizes):
    data, kvs = body()

    async def main():
        async with Server([ok(chunked(data, sizes, trailer=b"x-trailer: 1\r\n"))], drip=997) as url:
            client = AgentClient(url, "k")
            check(await pull(client), kvs)
            await client.aclose()

    asyncio.run(main())


def test_heartbeats_between_frames_are_skipped_in_any_chunking():
    data, kvs = body()
    first = len(data) - len(done_frame(PrefillDone(7, 133, 3, 0.1)))  # the final frame starts here
    with_beats = HEARTBEAT_FRAME * 2 + data[:first] + HEARTBEAT_FRAME + data[first:]

    async def main():
        for sizes in ([1], [5, 3], [4096]):
            async with Server([ok(chunked(with_beats, sizes))], close_after=True) as url:
                client = AgentClient(url, "k")
                check(await pull(client), kvs)
                await client.aclose()
        bad = HEARTBEAT_FRAME[:4] + (3).to_bytes(4, "little") + b"abc" + data
        async with Server([ok(chunked(bad, [4096]))], close_after=True) as url:
            client = AgentClient(url, "k")
            with pytest.raises(FrameError, match="heartbeat frame with a 3-byte body"):
                await pull(client)
            await client.aclose()

    asyncio.run(main())


def test_a_silent_stream_stalls_and_one_with_heartbeats_does_not():
    """The decoder's stall timeout (0.3 s here) ends a stream that sends nothing for longer, but a
    prefiller that is still computing keeps it alive with heartbeats (every 0.1 s here)."""
    data, kvs = body()

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, beats: bool) -> None:
        await r.readuntil(b"\r\n\r\n")
        w.write(ok(b""))
        for _ in range(10):  # a second of "prefill" before the first page
            if beats:
                w.write(chunked(HEARTBEAT_FRAME, [8])[:-5])  # one chunk, not the stream's end
            await w.drain()
            await asyncio.sleep(0.1)
        w.write(chunked(data, [4096]))
        await w.drain()
        w.close()

    async def main(beats: bool):
        server = await asyncio.start_server(lambda r, w: serve(r, w, beats), "127.0.0.1", 0)
        client = AgentClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", "k", stall_timeout=0.3)
        try:
            return await pull(client)
        finally:
            await client.aclose()
            server.close()

    check(asyncio.run(main(beats=True)), kvs)
    with pytest.raises(TransportError, match="stalled: no data for 0.3 s"):
        asyncio.run(main(beats=False))


def test_connections_are_reused_and_a_stale_one_is_retried():
    data, kvs = body()

    async def main():
        server = Server([ok(chunked(data, [5000]))] * 3)
        async with server as url:
            client = AgentClient(url, "k")
            check(await pull(client), kvs)
            check(await pull(client), kvs)
            assert server.connections == 1  # keep-alive: the second stream used the same connection
            server.close_after = True  # the server drops the pooled connection after the next response
            check(await pull(client), kvs)
            await asyncio.sleep(0.05)
            server.responses.append(ok(chunked(data, [5000])))
            check(await pull(client), kvs)  # the stale pooled connection fails before a byte: retried
            assert server.connections == 2
            await client.aclose()

    asyncio.run(main())


def test_http_errors_and_broken_streams_say_what_happened():
    data, _ = body()
    err = json.dumps({"error": {"type": "HandoffError", "message": "no handoff 00ff"}}).encode()

    async def main():
        cases = [
            (
                b"HTTP/1.1 404 Not Found\r\ncontent-length: %d\r\n\r\n" % len(err) + err,
                AgentHTTPError,
                "404 HandoffError: no handoff 00ff",
            ),
            (ok(chunked(data[:-20], [4096])), FrameError, "truncated"),  # clean end, no final frame
            (ok(chunked(data, [4096])[:3000]), TransportError, "connection closed after"),  # cut mid-stream
            (ok(b"zz\r\n"), TransportError, "malformed chunk size"),
            (b"SSH-2.0-OpenSSH\r\n\r\n", TransportError, "not an HTTP response"),
            (ok(chunked(data + b"extra", [4096])), FrameError, "data after the final frame"),
        ]
        for response, kind, message in cases:
            async with Server([response], close_after=True) as url:
                client = AgentClient(url, "k")
                with pytest.raises(kind, match=message):
                    await pull(client)
                await client.aclose()

    asyncio.run(main())


def test_a_slow_decoder_pauses_the_socket():
    """Pages the decoder has not taken yet are bounded (QUEUE_PAGES); the rest waits in TCP."""
    from tandem_protocol import page_receiver

    big = PageGeometry(layers=4, kv_heads=2, head_dim=64)  # 128 KiB pages: 40 overflow socket buffers
    data, kvs = body(40, big)

    async def main():
        async with Server([ok(chunked(data, [big.page_bytes + 88]))]) as url:
            client = AgentClient(url, "k")
            async with client.page_stream(
                HANDOFF_ID.hex(), FrameExpectation(CONTRACT, HANDOFF_ID, TOKENS, big)
            ) as stream:
                first = await stream.__anext__()
                await asyncio.sleep(0.3)  # everything would have arrived by now, were reading not paused
                waiting = len(stream._r.items)
                items = [first] + [item async for item in stream]
            assert 1 <= waiting <= page_receiver.QUEUE_PAGES + 1
            check(items, kvs)
            await client.aclose()

    asyncio.run(main())


def _page_app(frames: list):
    from starlette.applications import Starlette
    from starlette.routing import Route

    from tandem_protocol.http_server import PageStreamResponse

    async def pages(request):
        async def gen():
            for f in frames:
                yield f

        return PageStreamResponse(gen())

    return Starlette(routes=[Route("/pages", pages, methods=["GET", "HEAD"])])


def _frames(pages: int = 3) -> tuple[list, bytes]:
    from tandem_protocol.pages import encode_frame

    g, rng = GEOMETRY, np.random.default_rng(1)
    out = [
        encode_frame(
            make_page(g, i, rng.standard_normal((g.layers, 2, 64, g.kv_heads, g.head_dim)).astype("<f2")),
            contract=CONTRACT,
            handoff_id=HANDOFF_ID,
            tokens=TOKENS,
        )
        for i in range(pages)
    ]
    out.append(done_frame(PrefillDone(7, 64 * pages, pages, 0.1)))
    return out, b"".join(bytes(p) for f in out for p in (f if isinstance(f, tuple) else (f,)))


def test_page_response_sends_one_chunk_per_frame_on_the_agent_server_and_joins_elsewhere():
    """(header, payload) pairs: one vectored chunk each under PageStreamProtocol; any other
    server (here Starlette's test client) gets the same bytes joined. HEAD sends no body."""
    import socket

    import uvicorn
    from starlette.testclient import TestClient

    from tandem_protocol.http_server import PageStreamProtocol

    frames, whole = _frames()
    with TestClient(_page_app(frames)) as tc:
        assert tc.get("/pages").content == whole

    async def main():
        sock = socket.create_server(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(_page_app(frames), http=PageStreamProtocol, log_level="warning"))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            port = sock.getsockname()[1]
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET /pages HTTP/1.1\r\nHost: x\r\n\r\n")
            await r.readuntil(b"\r\n\r\n")
            sizes, data = [], bytearray()
            while True:
                size = int((await r.readuntil(b"\r\n")).split(b";")[0], 16)
                sizes.append(size)
                data += await r.readexactly(size + 2)
                data = data[:-2]
                if size == 0:
                    break
            assert bytes(data) == whole
            assert sizes == [len(f[0]) + len(f[1]) if isinstance(f, tuple) else len(f) for f in frames] + [0]
            w.write(b"HEAD /pages HTTP/1.1\r\nHost: x\r\n\r\n")
            head = await r.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200")
            w.close()
            # the client connections can use the agent's receiver too
            client = AgentClient(f"http://127.0.0.1:{port}", "k")
            try:
                async with client.page_stream("", EXPECT, path="/pages") as stream:
                    items = [item async for item in stream]
                assert [i.index for i in items[:-1]] == [0, 1, 2] and items[-1].first_token == 7
            finally:
                await client.aclose()
        finally:
            server.should_exit = True
            await task

    asyncio.run(main())


class Flood(Server):
    """Answers one request with `head`, then `size` zero bytes, 1 MiB at a time from one buffer
    (so that only the reader's memory grows with what it takes)."""

    def __init__(self, head: bytes, size: int):
        super().__init__([])
        self.head, self.size = head, size

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        block = bytes(1 << 20)
        try:
            await r.readuntil(b"\r\n\r\n")
            w.write(self.head)
            for _ in range(self.size // len(block)):
                w.write(block)
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        w.close()


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def test_a_hostile_peer_cannot_make_the_decoder_hold_what_it_claims():
    """Issue 22: a frame header claiming a 1 GiB page (a geometry other than the stream's), then
    64 MiB of it; an error claiming a 20 GB body, then 64 MiB of it. Each ends the stream with a
    clear error at once; the reader's peak RSS grows by less than 16 MiB."""
    huge = PageGeometry(layers=4096, kv_heads=8, head_dim=128)  # a consistent header, 1 GiB a page
    header = pages._HEADER.pack(
        MAGIC, PROTOCOL_VERSION, HEADER_SIZE, CONTRACT, HANDOFF_ID, TOKENS, 0, 64, 64,
        huge.layers, huge.kv_heads, huge.head_dim, RAW, huge.page_bytes, 0,
    )  # fmt: skip
    assert huge.page_bytes == 1 << 30 and pages.parse_header(header).payload_size == 1 << 30
    page_claim = ok(b"%x\r\n" % (HEADER_SIZE + huge.page_bytes) + header)
    error_claim = b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 21474836480\r\n\r\n"

    async def main():
        before = peak_rss()
        for answer, says in ((page_claim, "geometry"), (error_claim, "500")):
            async with Flood(answer, 64 << 20) as url:
                client = AgentClient(url, "k")
                with pytest.raises((FrameError, AgentHTTPError)) as e:
                    await pull(client)
                assert says in str(e.value), e.value
                await client.aclose()
        return (peak_rss() - before) / (1 << 20)

    grown = asyncio.run(main())
    assert grown < 16, f"peak RSS grew {grown:.1f} MiB"


def test_fp8_pages_are_decoded_off_the_loop_in_order_and_a_corrupted_one_is_refused(monkeypatch):
    """An FP8 page of an 8B model costs ~25 ms of a core to decode: on the event loop that would
    stall every other stream and request of the decoder, so encoded pages are decoded in the codec
    pool and handed out in order; their checks (checksum, exponents) still fail the stream."""
    import threading

    from tandem_protocol import fp8

    decoded_on = []
    real_decode = fp8.decode

    def recording_decode(payload, shape):
        decoded_on.append(threading.current_thread())
        return real_decode(payload, shape)

    monkeypatch.setattr(fp8, "decode", recording_decode)
    rng = np.random.default_rng(8)
    kvs = [rng.standard_normal((2, 2, 64, 1, 8)).astype("<f2") for _ in range(6)]
    frames = [
        frame_bytes(make_page(GEOMETRY, i, kv), contract=CONTRACT, handoff_id=HANDOFF_ID, tokens=TOKENS, encoding=FP8)
        for i, kv in enumerate(kvs)
    ]
    final = done_frame(PrefillDone(7, 64 * 6, 6, 0.1))
    corrupted = bytearray(frames[3])
    corrupted[-1] ^= 0x01

    async def main():
        loop_thread = threading.current_thread()
        good, bad = b"".join(frames) + final, b"".join(frames[:3]) + bytes(corrupted) + b"".join(frames[4:]) + final
        async with Server([ok(chunked(good, [4096])), ok(chunked(bad, [4096]))]) as url:
            client = AgentClient(url, "k")
            items = await pull(client)
            assert [type(i) for i in items] == [KVPage] * 6 + [PrefillDone]
            assert [p.index for p in items[:6]] == list(range(6))
            for page, kv in zip(items, kvs):
                assert np.array_equal(page.kv, real_decode(fp8.encode(kv), kv.shape))
            assert len(decoded_on) == 6 and loop_thread not in decoded_on
            with pytest.raises(FrameError, match="checksum mismatch on page 3"):
                await pull(client)
            await client.aclose()

    asyncio.run(main())
