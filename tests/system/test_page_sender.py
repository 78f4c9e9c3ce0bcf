"""The page sender thread (tandem_protocol/page_sender.py) on a real uvicorn server, plain and TLS,
on uvloop (as the agent serves) and asyncio: the bytes on the wire are exactly the loop's, the
connection goes back to the loop for the last chunk and the next request, a reader that takes
nothing is hung up on after the stall timeout, and a reader that hangs up releases the stream."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
import time
import uuid

import numpy as np
import pytest
import uvicorn
import uvloop
from starlette.applications import Starlette
from starlette.routing import Route

from tandem_protocol import page_sender
from tandem_protocol.client import AgentClient
from tandem_protocol.http_server import PageStreamProtocol, PageStreamResponse, TrackedFrame, server_tls_context
from tandem_protocol.pages import FrameExpectation, PageGeometry, encode_frame, make_page
from tandem_protocol.tls import certificate_fingerprint, client_context, ensure_certificate
from tandem_protocol.wire import HEARTBEAT_FRAME

from ..unit.test_page_receiver import CONTRACT, HANDOFF_ID, TOKENS

STALL = 0.5
GEOMETRY = PageGeometry(layers=4, kv_heads=4, head_dim=64)  # 256 KiB pages: several sends each
EXPECT = FrameExpectation(CONTRACT, HANDOFF_ID, TOKENS, GEOMETRY)
LOOPS = {"uvloop": uvloop.new_event_loop, "asyncio": asyncio.new_event_loop}


def frames(pages: int = 6) -> tuple[list, bytes]:
    from tandem_protocol.handoff import PrefillDone
    from tandem_protocol.wire import done_frame

    g, rng = GEOMETRY, np.random.default_rng(2)
    out: list = [HEARTBEAT_FRAME]
    for i in range(pages):
        kv = rng.standard_normal((g.layers, 2, 64, g.kv_heads, g.head_dim)).astype("<f2")
        out.append(encode_frame(make_page(g, i, kv), contract=CONTRACT, handoff_id=HANDOFF_ID, tokens=TOKENS))
    out.append(done_frame(PrefillDone(7, 64 * pages, pages, 0.1)))
    return out, b"".join(bytes(p) for f in out for p in (f if isinstance(f, tuple) else (f,)))


def chunk_sizes(items: list) -> list[int]:
    return [sum(len(p) for p in f) if isinstance(f, tuple) else len(f) for f in items] + [0]


def page_app(items: list, released: asyncio.Event | None = None, endless: bool = False) -> Starlette:
    async def pages(request):
        async def gen():
            try:
                while True:
                    for f in items:
                        yield f
                    if not endless:
                        return
            finally:
                if released is not None:
                    released.set()

        return PageStreamResponse(gen())

    return Starlette(routes=[Route("/pages", pages)])


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    cert, key = ensure_certificate(tmp_path_factory.mktemp("tls"), "sender")
    return server_tls_context(cert, key), certificate_fingerprint(cert)


@contextlib.asynccontextmanager
async def serving(app, sender: str, tls_context=None, stall: float | None = None):
    sock = socket.create_server(("127.0.0.1", 0))
    http = PageStreamProtocol.configured(stall, sender=sender, tls=tls_context)
    server = uvicorn.Server(uvicorn.Config(app, http=http, log_level="error"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await task


@pytest.fixture
def senders(monkeypatch):
    """The SocketSenders made during a test."""
    made = []
    original = page_sender.SocketSender.__init__

    def init(self, *args, **kwargs):
        made.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(page_sender.SocketSender, "__init__", init)
    return made


async def read_chunks(r: asyncio.StreamReader) -> tuple[list[int], bytes]:
    sizes, data = [], bytearray()
    while True:
        size = int((await r.readuntil(b"\r\n")).split(b";")[0], 16)
        sizes.append(size)
        data += (await r.readexactly(size + 2))[:-2]
        if size == 0:
            return sizes, bytes(data)


@pytest.mark.parametrize("loop", list(LOOPS))
@pytest.mark.parametrize("transport", ["plain", "tls"])
@pytest.mark.parametrize("sender", ["thread", "loop"])
def test_the_bytes_on_the_wire_are_the_loops_and_the_connection_is_kept(loop, transport, sender, tls, senders):
    items, whole = frames()

    async def main():
        ctx, pin = tls if transport == "tls" else (None, None)
        async with serving(page_app(items), sender, ctx) as port:
            client_ssl = client_context(pin) if pin else None
            r, w = await asyncio.open_connection("127.0.0.1", port, ssl=client_ssl)
            for _ in range(2):  # a second request on the same connection: it was handed back
                w.write(b"GET /pages HTTP/1.1\r\nHost: x\r\n\r\n")
                head = await r.readuntil(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
                sizes, data = await read_chunks(r)
                assert data == whole
                assert sizes == chunk_sizes(items)
            w.close()
            client = AgentClient(f"{'https' if pin else 'http'}://127.0.0.1:{port}", "k", pin=pin)
            try:
                async with client.page_stream("", EXPECT, path="/pages") as stream:
                    got = [item async for item in stream]
                assert [p.index for p in got[:-1]] == list(range(6)) and got[-1].first_token == 7
            finally:
                await client.aclose()

    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        runner.run(main())
    assert len(senders) == (3 if sender == "thread" else 0)
    assert all(s.ended.done() and s.error is None for s in senders)
    assert not [t for t in threading.enumerate() if t.name == "tandem-page-sender"]


@pytest.mark.parametrize("transport", ["plain", "tls"])
def test_a_reader_that_takes_nothing_is_hung_up_on(transport, tls, senders):
    async def main():
        released = asyncio.Event()
        items, _ = frames(2)
        ctx, pin = tls if transport == "tls" else (None, None)
        async with serving(page_app(items, released, endless=True), "thread", ctx, stall=STALL) as port:

            def connect() -> socket.socket:  # a blocking client: its handshake in a thread of its own
                raw = socket.socket()
                raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
                raw.connect(("127.0.0.1", port))
                client = client_context(pin).wrap_socket(raw) if pin else raw
                client.sendall(b"GET /pages HTTP/1.1\r\nHost: x\r\n\r\n")
                return client

            client = await asyncio.to_thread(connect)
            try:
                t0 = time.perf_counter()
                await asyncio.wait_for(released.wait(), 20)  # the response let go of its source
                waited = time.perf_counter() - t0
                assert STALL <= waited < 10 * STALL + 5, waited
                client.settimeout(10)  # what the kernel had buffered, then the end (not the timeout)
                got = 0
                with contextlib.suppress(ConnectionResetError, ssl.SSLEOFError):
                    while n := len(client.recv(1 << 20)):
                        got += n
                assert got < 64 << 20, got
                assert time.perf_counter() - t0 < 10
            finally:
                client.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())
    assert len(senders) == 1 and isinstance(senders[0].error, TimeoutError)


@pytest.mark.parametrize("transport", ["plain", "tls"])
def test_a_reader_that_hangs_up_releases_the_stream(transport, tls, senders):
    async def main():
        released = asyncio.Event()
        items, _ = frames(2)
        ctx, pin = tls if transport == "tls" else (None, None)
        async with serving(page_app(items, released, endless=True), "thread", ctx, stall=60) as port:
            r, w = await asyncio.open_connection("127.0.0.1", port, ssl=client_context(pin) if pin else None)
            w.write(b"GET /pages HTTP/1.1\r\nHost: x\r\n\r\n")
            await r.readuntil(b"\r\n\r\n")
            await r.readexactly(1 << 20)  # mid-stream
            w.transport.abort()
            await asyncio.wait_for(released.wait(), 10)  # long before the stall timeout
            for _ in range(100):  # the thread ends on its own, its descriptor closed
                if senders and senders[0].ended.done():
                    break
                await asyncio.sleep(0.05)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())
    assert len(senders) == 1 and senders[0].ended.done()


@pytest.fixture(scope="module")
def wide_tiny(smol_dir, tmp_path_factory):
    """A random-weight Llama with SmolLM2's page (30 layers x 3 KV heads x head_dim 64: 1.47 MB)
    and a fraction of its compute: the stream is as long in bytes, the prefills quicker."""
    from ..conftest import make_tiny_checkpoint

    shape = dict(hidden_size=192, intermediate_size=256, num_attention_heads=3, num_key_value_heads=3, head_dim=64)
    path = tmp_path_factory.mktemp("wide-tiny") / "m"
    return make_tiny_checkpoint(path, "llama", smol_dir, num_hidden_layers=30, max_position_embeddings=2048, **shape)


@pytest.mark.parametrize("tls_on", [False, True], ids=["plain", "tls"])
def test_an_agent_releases_a_handoff_whose_reader_hangs_up_mid_stream(wide_tiny, tmp_path, tls_on):
    """The agent's own sender (the thread, its default) and TLS layer: a decoder that reads part of
    a page stream (1 MiB of 35 MB: more than the kernel's buffers hold) and hangs up leaves no
    handoff, and the engine serves the next one."""
    from tests.agents import TEST_KEY, AgentProcess

    ids = [100 + (i * 7919) % 40000 for i in range(1500)]

    async def main(agent: AgentProcess):
        client = AgentClient(agent.url, TEST_KEY, pin=agent.fingerprint)
        try:
            contract = (await client.info())["contract"]["fingerprint"]

            async def handoff() -> dict:
                hid = uuid.uuid4().hex
                return {"id": hid, **await client.create_handoff(handoff_id=hid, token_ids=ids, contract=contract)}

            h = await handoff()
            host, port = agent.url.rsplit("//", 1)[1].rsplit(":", 1)
            r, w = await asyncio.open_connection(
                host, int(port), ssl=client_context(agent.fingerprint) if tls_on else None
            )
            w.write(
                f"GET /v1/handoffs/{h['id']}/pages HTTP/1.1\r\nHost: {host}\r\n"
                f"Authorization: Bearer {h['read_token']}\r\n\r\n".encode()
            )
            assert (await r.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            await r.readexactly(1 << 20)  # the first page, partly
            w.transport.abort()
            for _ in range(600):
                if not (await client.status())["handoffs"]:
                    break
                await asyncio.sleep(0.1)
            assert (await client.status())["handoffs"] == []
            h = await handoff()  # the engine is free again: a whole stream reads to its end
            async with client.page_stream(h["id"], None, token=h["read_token"]) as stream:
                items = [item async for item in stream]
            assert len(items) == h["pages"] + 1
        finally:
            await client.aclose()

    # one compute thread: OpenMP threads spin-waiting on a busy core slow every forward pass
    with AgentProcess("torch", wide_tiny, tmp_path / "p", tls=tls_on, env={"OMP_NUM_THREADS": "1"}) as agent:
        contract = agent.info()["contract"]
        assert (contract["layers"], contract["kv_heads"], contract["head_dim"]) == (30, 3, 64), contract
        asyncio.run(main(agent))


@pytest.mark.parametrize("transport", ["plain", "tls"])
@pytest.mark.parametrize("sender", ["thread", "loop"])
def test_a_tracked_frame_counts_as_written_only_once_it_is_in_the_socket(transport, sender, tls):
    """What the prefiller's staging window relies on (issue 23): a page's room comes back when its
    bytes are in the socket, not when it is queued. A reader takes nothing: the frames the response
    has taken from its source but not written — the sender thread's queue (DEPTH) and the one
    waiting for room in it, or the loop's chunk above the transport's low-water mark and the one
    waiting for it to drain — are not reported written; once the reader reads, every one is."""
    pages, piece = 48, bytes(1 << 20)  # 48 MiB: more than the kernel's buffers on both sides hold
    queued = page_sender.DEPTH + 1 if sender == "thread" else 2

    async def main():
        taken, written = [0], [0]

        async def pages_route(request):
            def count() -> None:
                written[0] += 1

            async def gen():
                for i in range(pages):
                    taken[0] += 1
                    yield TrackedFrame((b"%08d" % i, piece), count)

            return PageStreamResponse(gen())

        ctx, pin = tls if transport == "tls" else (None, None)
        app = Starlette(routes=[Route("/pages", pages_route)])
        async with serving(app, sender, ctx) as port:
            raw = socket.socket()
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            raw.setblocking(False)
            await asyncio.get_running_loop().sock_connect(raw, ("127.0.0.1", port))
            r, w = await asyncio.open_connection(
                sock=raw, ssl=client_context(pin) if pin else None, server_hostname="127.0.0.1" if pin else None
            )
            try:
                w.write(b"GET /pages HTTP/1.1\r\nHost: x\r\n\r\n")
                await r.readuntil(b"\r\n\r\n")
                last, still = -1, 0
                while still < 10:  # the response stops taking frames: every buffer between is full
                    await asyncio.sleep(0.05)
                    last, still = taken[0], still + 1 if taken[0] == last else 0
                assert taken[0] < pages, taken
                assert written[0] == taken[0] - queued, (taken, written)
                sizes, _ = await read_chunks(r)
                assert len(sizes) == pages + 1 and written[0] == taken[0] == pages
            finally:
                w.transport.abort()  # a failed check must not leave the server waiting on this reader

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())
