"""vLLM's connector exports a prefill's pages without holding vLLM's step loop
(engine_adapters/vllm_connector.py): the agent reads a room's next page only when its handoff's
staging window has room, so the connector's writes may wait for seconds.

The real vLLM adapter's bridge reads its export rooms here as such an agent would: two pages,
then nothing until the test says (the window is full), then one page every READ_PAUSE seconds.
While an export is held:

- vLLM has finished the prefill (its request no longer runs) and holds its blocks (the KV pool
  is not empty); a whole `generate` on the same vLLM runs meanwhile (with the pages written on
  vLLM's step loop, as before, vLLM never got past the prefill's first step);
- the pages, once read, are those of a prefill read at full speed, byte for byte, in order;
- a cancel frees everything: the agent hanging up on the room (the connector's write fails) and
  vLLM aborting the request (the connector shuts the room's connection).

After each, vLLM's KV pool is empty again (its `kv_cache_usage` gauge, the adapter's engine_stats).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time

import numpy as np
import pytest

from engine_adapters.base import EngineRequest
from engine_adapters.bridge import Bridge
from engine_adapters.settings import EngineSettings
from tandem_protocol.errors import Cancelled, FrameError
from tandem_protocol.handoff import PrefillDone
from tandem_protocol.pages import KVPage
from tandem_protocol.sampling import SamplingParams

from .conftest import LONG_TEXT, collect, run

CONTEXT = 4096
PROMPT_TOKENS = 16 * 64 + 5
PAGES = 17  # the last partly filled
HELD_AFTER = 2  # pages read before the window is full
READ_PAUSE = 0.5  # seconds between pages once it has room again
GENERATE_TOKENS = 16


@pytest.fixture(scope="module")
def vllm(smol_dir):
    from engine_adapters import load_adapter

    os.environ.setdefault("TANDEM_VLLM_THREADS", "1")
    # prefix cache off: every prefill computes and exports its pages; chunks of 128 tokens: a
    # prefill takes many steps, so a cancel lands while vLLM still computes it
    settings = EngineSettings(prefix_caching=False, vllm_chunk_tokens=128)
    adapter = load_adapter("vllm", smol_dir, CONTEXT, settings)
    yield adapter
    adapter.close()


@pytest.fixture(scope="module")
def prompt_ids(vllm) -> list[int]:
    ids = vllm.chat_token_ids([{"role": "user", "content": LONG_TEXT * 8}])
    assert len(ids) >= PROMPT_TOKENS, len(ids)
    return ids[:PROMPT_TOKENS]


def request(name: str, ids: list[int], max_tokens: int = 1) -> EngineRequest:
    return EngineRequest(name, list(ids), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


class PacedStream:
    """An export connection's byte stream, read the way `pace(n)` says before the n-th frame
    (1-based): it may wait or sleep; False hangs up (the stream ends there)."""

    def __init__(self, stream, pace):
        self.stream, self.pace, self.frames = stream, pace, 0

    def read(self, n: int) -> bytes:
        if n == 4:  # a frame's magic: bridge.read_item starts every frame with it
            self.frames += 1
            if not self.pace(self.frames):
                self.stream.close()
                return b""
        return self.stream.read(n)


@contextlib.contextmanager
def paced_exports(adapter, pace):
    """The adapter's bridge reads its export rooms through `pace`, as an agent whose staging
    window decides when it takes the next page."""
    bridge = adapter.bridge

    def collect(stream, room) -> None:
        with contextlib.suppress(RuntimeError):  # a room's event loop ended with its test (asyncio.run)
            Bridge._collect(bridge, PacedStream(stream, pace), room)

    bridge._collect = collect
    try:
        yield
    finally:
        del bridge._collect


def held_then_paced(gate: threading.Event):
    def pace(n: int) -> bool:
        if n > HELD_AFTER:
            assert gate.wait(60), "the test never let the export go on"
            if n <= PAGES:  # not before the connection's end: the test's loop may be gone by then
                time.sleep(READ_PAUSE)
        return True

    return pace


async def stats(adapter) -> dict:
    return await adapter.engine_stats()


async def until(adapter, check, timeout: float, what: str) -> dict:
    """vLLM's figures once `check(stats)` holds (a gauge: polled)."""
    deadline = time.monotonic() + timeout
    while not check(s := await stats(adapter)):
        assert time.monotonic() < deadline, f"{what}: not after {timeout} s ({s})"
        await asyncio.sleep(0.05)
    return s


def pool_empty(s: dict) -> bool:
    return s["kv_cache_usage"] == 0.0 and s["running"] == 0 and s["waiting"] == 0


async def timed_generate(adapter, ids: list[int], name: str) -> tuple[list[int], float]:
    t0 = time.monotonic()
    tokens = await collect(adapter.generate(request(name, ids[:200], GENERATE_TOKENS)))
    return tokens, time.monotonic() - t0


def test_a_held_export_keeps_its_blocks_and_holds_no_other_request(vllm, prompt_ids):
    fast = run(collect(vllm.prefill(request("fast", prompt_ids))))
    ref_tokens, alone = run(timed_generate(vllm, prompt_ids, "alone"))
    gate = threading.Event()

    async def held() -> dict:
        got: list = []

        async def read() -> None:
            async for item in vllm.prefill(request("held", prompt_ids)):
                got.append(item)

        task = asyncio.create_task(read())
        try:
            while len(got) < HELD_AFTER:
                assert not task.done(), task.exception()
                await asyncio.sleep(0.02)
            # vLLM finished the prefill while most of its pages wait for the window: its
            # request no longer runs, its blocks are still held
            during = await until(
                vllm, lambda s: s["running"] == 0 and s["waiting"] == 0, 60, "vLLM never finished the held prefill"
            )
            tokens, seconds = await timed_generate(vllm, prompt_ids, "beside")
            still_held = len(got)
        finally:
            gate.set()
        await task
        return {"got": got, "during": during, "tokens": tokens, "seconds": seconds, "held_pages": still_held}

    with paced_exports(vllm, held_then_paced(gate)):
        out = run(held())
    assert out["during"]["kv_cache_usage"] > 0, out["during"]
    assert out["held_pages"] == HELD_AFTER, "the export went on before the test let it"
    assert out["tokens"] == ref_tokens  # (its time is printed: on a shared CPU it is no figure to assert)
    pages, ref = [p for p in out["got"] if isinstance(p, KVPage)], [p for p in fast if isinstance(p, KVPage)]
    assert len(ref) == PAGES
    assert [(p.index, p.valid_tokens) for p in pages] == [(p.index, p.valid_tokens) for p in ref]
    for a, b in zip(pages, ref, strict=True):
        assert np.array_equal(a.kv.view(np.uint16), b.kv.view(np.uint16)), a.index
    done, ref_done = out["got"][-1], fast[-1]
    assert isinstance(done, PrefillDone) and done.first_token == ref_done.first_token
    run(until(vllm, pool_empty, 10, "vLLM's KV pool did not come back to empty"))
    _, after = run(timed_generate(vllm, prompt_ids, "after"))
    print(
        f"generate of {GENERATE_TOKENS} tokens: {alone:.2f} s alone before, {out['seconds']:.2f} s beside a held "
        f"export, {after:.2f} s alone after"
    )


@pytest.mark.parametrize("how", ["agent-hangs-up", "vllm-aborts"])
def test_a_cancelled_export_frees_its_blocks(vllm, prompt_ids, how):
    """The agent hangs up on the room after two pages (a cancelled handoff: the connector's next
    write fails), or vLLM aborts the request while it still computes it and the export waits for
    the window (the connector shuts the connection under its blocked write)."""
    gate = threading.Event()

    def pace(n: int) -> bool:
        if n <= HELD_AFTER:
            return True
        if how == "agent-hangs-up":
            return False
        assert gate.wait(60), "the test never let the export go on"
        return True

    async def cancelled() -> None:
        req = request(f"cancel-{how}", prompt_ids)
        async for item in vllm.prefill(req):
            if how == "vllm-aborts" and item.index == 0:
                # vLLM still computes the later chunks: the cancel aborts the request there
                assert (await stats(vllm))["running"] == 1
                vllm.cancel(req.request_id)

    try:
        with paced_exports(vllm, pace):
            with pytest.raises(FrameError if how == "agent-hangs-up" else Cancelled):
                run(cancelled())
            run(until(vllm, pool_empty, 10, "vLLM's KV pool did not come back to empty"))
    finally:
        gate.set()  # only now: the export must have ended without the reader's help
