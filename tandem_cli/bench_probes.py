"""The small programs `tandem bench ttft` runs at each end of a link (in a network namespace, on
an agent's CPU), one per subcommand:

    python -m tandem_cli.bench_probes sink HOST COUNT      listens; prints its port, then for each of
                                                           COUNT connections "BYTES SECONDS" (first
                                                           byte to last)
    python -m tandem_cli.bench_probes source HOST PORT BYTES COUNT
                                                           COUNT connections, BYTES each
    python -m tandem_cli.bench_probes echo HOST            listens; prints its port; echoes bytes
    python -m tandem_cli.bench_probes rtt HOST PORT        prints the median round trip of one byte
    python -m tandem_cli.bench_probes pages URL KEY COUNT CONTRACT LAYERS HEADS DIM
                                                           pulls COUNT synthetic pages from an agent
                                                           through the decoder's receiver; prints
                                                           "BYTES SECONDS" from the first page

Separate processes because each end must run where its agent runs (its namespace, its CPU).
Kept free of heavy imports: their start is not timed, but it is waited for.
"""

from __future__ import annotations

import socket
import sys
import time

CHUNK = 1 << 20


def sink(host: str, count: int) -> None:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, 0))
    s.listen(1)
    print(s.getsockname()[1], flush=True)
    buf = bytearray(CHUNK)
    for _ in range(count):
        c, _ = s.accept()
        n, t0 = 0, None
        while k := c.recv_into(buf):
            t0 = t0 or time.perf_counter()  # from the first byte: what the link, not the connect, takes
            n += k
        c.close()
        print(n, time.perf_counter() - (t0 or time.perf_counter()), flush=True)


def source(host: str, port: int, nbytes: int, count: int) -> None:
    chunk = bytes(CHUNK)
    for _ in range(count):
        with socket.create_connection((host, port)) as c:
            left = nbytes
            while left > 0:
                c.sendall(chunk[: min(left, CHUNK)])
                left -= CHUNK


def echo(host: str) -> None:
    s = socket.socket()
    s.bind((host, 0))
    s.listen(1)
    print(s.getsockname()[1], flush=True)
    c, _ = s.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while b := c.recv(1):
        c.sendall(b)


def rtt(host: str, port: int) -> None:
    with socket.create_connection((host, port)) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for _ in range(50):
            t0 = time.perf_counter()
            c.sendall(b"p")
            c.recv(1)
            times.append(time.perf_counter() - t0)
    print(sorted(times)[len(times) // 2])


def pages(url: str, key: str, count: int, contract: str, layers: int, heads: int, dim: int) -> None:

    from tandem_protocol.client import AgentClient
    from tandem_protocol.pages import FrameExpectation, PageGeometry

    async def pull() -> None:
        client = AgentClient(url, key)
        expect = FrameExpectation(bytes.fromhex(contract), bytes(16), bytes(16), PageGeometry(layers, heads, dim))
        t0 = b0 = None
        try:
            async with client.page_stream("", expect, path=f"/v1/bench/pages?count={count}") as stream:
                async for _ in stream:
                    if t0 is None:  # timed from the first page, as the raw sink times from its first byte
                        t0, b0 = time.perf_counter(), stream.bytes_read
            print(stream.bytes_read - b0, time.perf_counter() - t0, flush=True)
        finally:
            await client.aclose()

    import uvloop

    uvloop.run(pull())


def main(argv: list[str]) -> None:
    commands = {"sink": (sink, str, int), "source": (source, str, int, int, int), "echo": (echo, str)}
    commands |= {"rtt": (rtt, str, int), "pages": (pages, str, str, int, str, int, int, int)}
    if not argv or argv[0] not in commands:
        sys.exit(f"usage: python -m tandem_cli.bench_probes {{{','.join(commands)}}} ARGS…")
    fn, *types = commands[argv[0]]
    if len(argv) - 1 != len(types):
        sys.exit(f"{argv[0]} takes {len(types)} arguments, got {len(argv) - 1}")
    fn(*(t(a) for t, a in zip(types, argv[1:])))


if __name__ == "__main__":
    main(sys.argv[1:])
