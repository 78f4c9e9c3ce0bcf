"""Page codec throughput, as a ratio to a plain memory copy of the same bytes in the same run.

    .venv/bin/python bench/bench_pages.py [--tokens 4096] [--repeats 7]

encode = build each page from an engine-export block [layers][2][n][heads][dim] (one vectorised
copy into page layout) + frame header with xxh3 checksum; measured into freshly allocated pages
and into a reused ring of page buffers (what a streaming sender with a staging pool does). decode = parse + verify checksum and
expectation + view the payload as a page (no copy). Goal: both >= 0.5x memcpy.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tandem_protocol.pages import FrameExpectation, PageGeometry, decode_frame, encode_frame, make_page  # noqa: E402

SMOLLM2 = PageGeometry(layers=30, kv_heads=3, head_dim=64)


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    g, P = SMOLLM2, SMOLLM2.page_tokens
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((g.layers, 2, args.tokens, g.kv_heads, g.head_dim)).astype("<f2")
    n_pages = g.pages_for(args.tokens)
    total = n_pages * g.page_bytes
    contract, handoff_id, tokens = b"c" * 16, b"r" * 16, b"t" * 16
    expect = FrameExpectation(contract, handoff_id, tokens, g)

    src = np.empty(total, dtype=np.uint8)
    src[:] = 1
    dst = np.empty_like(src)
    memcpy = best_of(lambda: np.copyto(dst, src), args.repeats)

    frames: list[bytes] = []

    def encode() -> None:
        frames.clear()
        for i in range(n_pages):
            header, payload = encode_frame(
                make_page(g, i, kv[:, :, i * P : (i + 1) * P]), contract=contract, handoff_id=handoff_id, tokens=tokens
            )
            frames.append((header, payload))

    enc = best_of(encode, args.repeats)
    pool = [np.empty(g.page_shape, dtype="<f2") for _ in range(8)]  # a sender's staging ring

    def encode_pooled() -> None:
        for i in range(n_pages):
            encode_frame(
                make_page(g, i, kv[:, :, i * P : (i + 1) * P], out=pool[i % len(pool)]),
                contract=contract,
                handoff_id=handoff_id,
                tokens=tokens,
            )

    enc_pooled = best_of(encode_pooled, args.repeats)
    wire = [h + bytes(p) for h, p in frames]

    def decode() -> None:
        for frame in wire:
            decode_frame(frame, expect)

    dec = best_of(decode, args.repeats)
    back = np.concatenate([decode_frame(f, expect)[1].kv for f in wire], axis=2)
    assert np.array_equal(back.view(np.uint16), kv.view(np.uint16)), "round trip is not bit-exact"

    gbps = lambda s: total / s / 1e9  # noqa: E731
    print(f"{n_pages} pages of {g.page_bytes:,} bytes ({args.tokens} tokens of SmolLM2-135M KV, {total / 1e6:.1f} MB)")
    print(f"memcpy (reference)  {gbps(memcpy):6.2f} GB/s")
    print(f"encode (new pages)  {gbps(enc):6.2f} GB/s   ratio {memcpy / enc:.2f}x memcpy  (goal >= 0.5x)")
    print(f"encode (page pool)  {gbps(enc_pooled):6.2f} GB/s   ratio {memcpy / enc_pooled:.2f}x memcpy  (goal >= 0.5x)")
    print(f"decode              {gbps(dec):6.2f} GB/s   ratio {memcpy / dec:.2f}x memcpy  (goal >= 0.5x)")


if __name__ == "__main__":
    main()
