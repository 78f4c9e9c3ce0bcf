"""FP8 pages through the page stream, the codec in the caller's path against the codec pool.

    .venv/bin/python bench/bench_fp8_stream.py [--pages 64] [--rounds 3]

Pages of Llama-3.1-8B's geometry (8 MiB in FP16, 4 MiB as FP8). encode: frame every page as FP8
one after another (what the prefiller did before e53f05e, in the prefill's path) against all of
them submitted to `codec_pool()` and collected in order (what `HandoffManager` does now). receive:
a local server writes the FP8 stream; the product's `AgentClient` receives it, with the decode on
the event loop (`FrameReader` without a pool, as before) against the decode in the codec pool.
Figures are GB/s of FP16 pages delivered, best of the rounds, and the pool's ratio to inline.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tandem_protocol import page_receiver  # noqa: E402
from tandem_protocol.client import AgentClient  # noqa: E402
from tandem_protocol.handoff import PrefillDone  # noqa: E402
from tandem_protocol.pages import (  # noqa: E402
    FP8_E4M3,
    FrameExpectation,
    PageGeometry,
    codec_pool,
    encode_frame,
    frame_bytes,
    make_page,
)
from tandem_protocol.wire import done_frame  # noqa: E402

LLAMA8B = PageGeometry(layers=32, kv_heads=8, head_dim=128)
IDS = bytes(range(16)), bytes(range(16, 32)), bytes(range(32, 48))  # contract, handoff, tokens


def pages(n: int) -> list:
    rng = np.random.default_rng(0)
    shape = (LLAMA8B.layers, 2, LLAMA8B.page_tokens, LLAMA8B.kv_heads, LLAMA8B.head_dim)
    base = rng.standard_normal(shape).astype(np.float16)
    return [make_page(LLAMA8B, i, base) for i in range(n)]


def encode_seconds(ps: list, pooled: bool) -> float:
    kw = dict(contract=IDS[0], handoff_id=IDS[1], tokens=IDS[2], encoding=FP8_E4M3)
    t0 = time.perf_counter()
    if pooled:
        futures = [codec_pool().submit(encode_frame, p, **kw) for p in ps]
        for f in futures:
            f.result()
    else:
        for p in ps:
            encode_frame(p, **kw)
    return time.perf_counter() - t0


async def receive_seconds(body: bytes, n: int, pooled: bool) -> float:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readuntil(b"\r\n\r\n")
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-tandem-pages\r\ntransfer-encoding: chunked\r\n\r\n")
        w.write(b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n")
        await w.drain()
        w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    real = page_receiver.codec_pool
    page_receiver.codec_pool = real if pooled else (lambda: None)
    try:
        client = AgentClient(url, "k")
        t0 = time.perf_counter()
        async with client.page_stream(IDS[1].hex(), FrameExpectation(*IDS, LLAMA8B)) as stream:
            got = [item async for item in stream]
        seconds = time.perf_counter() - t0
        await client.aclose()
    finally:
        page_receiver.codec_pool = real
        server.close()
    assert len(got) == n + 1
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    ps = pages(args.pages)
    fp16 = args.pages * LLAMA8B.page_bytes / 1e9
    kw = dict(contract=IDS[0], handoff_id=IDS[1], tokens=IDS[2], encoding=FP8_E4M3)
    body = b"".join(frame_bytes(p, **kw) for p in ps) + done_frame(PrefillDone(7, args.pages * 64, args.pages, 0.1))
    workers = codec_pool()._max_workers
    print(f"{args.pages} pages of 8 MiB (8B geometry), codec pool of {workers} threads, best of {args.rounds}")
    for name, run in (
        ("encode", lambda pooled: encode_seconds(ps, pooled)),
        ("receive", lambda pooled: asyncio.run(receive_seconds(body, args.pages, pooled))),
    ):
        inline = min(run(False) for _ in range(args.rounds))
        pooled = min(run(True) for _ in range(args.rounds))
        print(
            f"{name:8s} inline {fp16 / inline:5.2f} GB/s of FP16   pool {fp16 / pooled:5.2f} GB/s   "
            f"pool ÷ inline {inline / pooled:.2f}x"
        )


if __name__ == "__main__":
    main()
