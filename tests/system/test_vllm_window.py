"""vLLM's connector exports a prefill's pages without holding vLLM's step loop
(engine_adapters/vllm_connector.py): the agent reads a room's next page only when its handoff's
staging window has room (engine_adapters.base.PageWindow), so the connector's writes may wait for
seconds.

The real vLLM adapter's prefill runs here with a window of WINDOW pages, read as an agent on a
frozen link would: no page is given back until the test says, then one every READ_PAUSE seconds.
While the export is held:

- vLLM has finished the prefill (its request no longer runs) and holds its blocks (the KV pool
  is not empty); a whole `generate` on the same vLLM runs meanwhile (with the pages written on
  vLLM's step loop, as before, vLLM never got past the step that filled the window);
- the pages, once read, are those of a prefill read at full speed, byte for byte, in order;
- a cancel frees everything: the handoff ending after vLLM finished the prefill (the bridge closes
  the room's connection: the connector's blocked write fails) and a cancel while vLLM still
  computes it (vLLM aborts the request too).

After each, vLLM's KV pool is empty again (its `kv_cache_usage` gauge, the adapter's engine_stats:
the blocks its prefix cache keeps are free ones to it).
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from engine_adapters.base import EngineRequest, PageWindow
from tandem_protocol.errors import Cancelled
from tandem_protocol.handoff import PrefillDone
from tandem_protocol.pages import KVPage
from tandem_protocol.sampling import SamplingParams

from ..conftest import LONG_TEXT, collect, run
from ..server_engines import counter, server_metrics
from .conftest import fresh_salt

# Five prefill chunks of 128 tokens (the shared server's): a cancel at the first page out leaves
# vLLM four steps to compute, and a held export more pages than its window.
PROMPT_TOKENS = 8 * 64 + 5
PAGES = 9  # the last partly filled
WINDOW = 2  # pages of staging window: the bridge reads two pages, then the engine waits
READ_PAUSE = 0.5  # seconds between pages once it has room again
GENERATE_TOKENS = 16
BESIDE_TOKENS = 64  # the prompt of the generate that runs beside a held export: one page
ENDED_TOKENS = 4 * 64 + 5  # a cancel after vLLM finished needs only more pages than the window


@pytest.fixture(scope="module")
def vllm(vllm_server):
    """The session's shared vLLM (tests/system/conftest.py): prefix cache on, but every request
    here carries a cache salt of its own (`request`), so every prefill computes and exports its
    pages; chunks of 128 tokens, so a prefill takes many steps and a cancel lands while vLLM still
    computes it; one thread."""
    assert vllm_server.settings.vllm_chunk_tokens == 128
    return vllm_server


@pytest.fixture(scope="module")
def prompt_ids(vllm) -> list[int]:
    ids = vllm.chat_token_ids([{"role": "user", "content": LONG_TEXT * 4}])
    assert len(ids) >= PROMPT_TOKENS, len(ids)
    return ids[:PROMPT_TOKENS]


def request(name: str, ids: list[int], max_tokens: int = 1) -> EngineRequest:
    """A request vLLM's prefix cache serves nothing (a cache salt of its own): it computes every token."""
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return EngineRequest(name, list(ids), sampling, cache_salt=fresh_salt(name))


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
    tokens = await collect(adapter.generate(request(name, ids[:BESIDE_TOKENS], GENERATE_TOKENS)))
    return tokens, time.monotonic() - t0


def windowed(name: str, ids: list[int]) -> EngineRequest:
    req = request(name, ids)
    req.window = PageWindow(WINDOW)
    return req


async def finished_requests(adapter) -> float:
    """The requests vLLM finished (its own counter: counted as each one's answer leaves, where
    the running gauge is only updated by steps that answer something)."""
    metrics = await asyncio.to_thread(server_metrics, adapter.server.url)
    return counter(metrics, "vllm:request_success_total")


async def until_finished(adapter, before: float) -> dict:
    """vLLM's figures once it finished the prefill (it answered) while its export waits for the
    window."""
    deadline = time.monotonic() + 60
    while await finished_requests(adapter) == before:
        assert time.monotonic() < deadline, "vLLM never finished the held prefill"
        await asyncio.sleep(0.05)
    return await stats(adapter)


def test_a_held_export_keeps_its_blocks_and_holds_no_other_request(vllm, prompt_ids):
    fast = run(collect(vllm.prefill(request("fast", prompt_ids))))
    ref_tokens, alone = run(timed_generate(vllm, prompt_ids, "alone"))

    async def held() -> dict:
        req, got, link = windowed("held", prompt_ids), [], asyncio.Event()

        async def read() -> None:
            async for item in vllm.prefill(req):
                got.append(item)
                if isinstance(item, KVPage):
                    await link.wait()  # frozen until the test lets it go, then slow
                    await asyncio.sleep(READ_PAUSE)
                    req.window.give()  # the page is on the wire: its room is free again

        before = await finished_requests(vllm)
        task = asyncio.create_task(read())
        try:
            while not got:  # vLLM runs the prefill: its first page is out, the window full
                assert not task.done(), task.exception()
                await asyncio.sleep(0.02)
            during = await until_finished(vllm, before)
            tokens, seconds = await timed_generate(vllm, prompt_ids, "beside")
            held = {"read": len(got), "window_free": req.window.free}
        finally:
            link.set()
        await task
        return {"got": got, "during": during, "tokens": tokens, "seconds": seconds, "held": held}

    out = run(held())
    assert out["during"]["kv_cache_usage"] > 0, out["during"]
    assert out["held"] == {"read": 1, "window_free": 0}, "the export went on before the test let it"
    assert out["tokens"] == ref_tokens  # (its time is printed: on a shared CPU it is no figure to assert)
    pages, ref = [p for p in out["got"] if isinstance(p, KVPage)], [p for p in fast if isinstance(p, KVPage)]
    assert len(ref) == PAGES
    assert [(p.index, p.valid_tokens) for p in pages] == [(p.index, p.valid_tokens) for p in ref]
    for a, b in zip(pages, ref, strict=True):
        assert np.array_equal(a.kv.view(np.uint16), b.kv.view(np.uint16)), a.index
    done, ref_done = out["got"][-1], fast[-1]
    assert isinstance(done, PrefillDone) and done.first_token == ref_done.first_token
    run(until(vllm, pool_empty, 10, "vLLM's KV pool did not come back to empty"))
    print(f"generate of {GENERATE_TOKENS} tokens: {alone:.2f} s alone, {out['seconds']:.2f} s beside a held export")


@pytest.mark.parametrize("when", ["after-vllm-finished", "while-vllm-computes"])
def test_a_cancelled_export_frees_its_blocks(vllm, prompt_ids, when):
    """The handoff ends while the window is full: after vLLM finished the prefill (only the
    connector's blocked write holds its blocks; a prompt of a few pages more than the window) or
    while vLLM still computes it (cancelled as soon as its first page is out: with chunks of 128
    tokens it has four steps to go, and its success counter shows it never finished)."""
    ids = prompt_ids[:ENDED_TOKENS] if when == "after-vllm-finished" else prompt_ids

    async def cancelled() -> None:
        req = windowed(f"cancel-{when}", ids)
        before = await finished_requests(vllm)
        pages = vllm.prefill(req)
        try:
            assert isinstance(await pages.__anext__(), KVPage)
            if when == "after-vllm-finished":
                await until_finished(vllm, before)
            else:
                vllm.cancel(req.request_id)  # at once: nothing between the first page and the cancel
                with pytest.raises(Cancelled):
                    async for _ in pages:  # the page the bridge read already, then the cancel
                        pass
        finally:
            await pages.aclose()  # the agent's teardown: the room closes, and its connection
        await until(vllm, pool_empty, 10, "vLLM's KV pool did not come back to empty")
        if when == "while-vllm-computes":  # an aborted request is not counted as finished
            assert await finished_requests(vllm) == before, "vLLM finished the prefill before its cancel"

    run(cancelled())
