"""SGLang's prefill export held back by the agent's staging window (engine_adapters/sglang_backend.py):
the bridge reads a page off an export room only once the request's window has room for it, so the
backend's writes may block for long. Here the window is given back slowly, or not at all: the
held-back export blocks neither SGLang's scheduler (another prefill on the same server finishes
meanwhile, and the waiting scheduler leaves the CPU alone) nor its pages (exact, in order), and
every ending frees the request's slots: the agent closing the room's connection, a cancel,
SGLang's own abort."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import psutil
import pytest

from engine_adapters.base import EngineRequest, PageWindow
from tandem_protocol.errors import Cancelled, TandemError
from tandem_protocol.handoff import FirstTokenMode, PrefillDone
from tandem_protocol.sampling import SamplingParams

from ..conftest import SGLANG_CPU_PYTHON, write_report
from ..prerequisites import requires
from .conftest import fresh_salt

pytestmark = requires(SGLANG_CPU_PYTHON.exists(), "SGLang's CPU test environment (make sglang-cpu-test)")

CHUNK = 1024  # SGLang's prefill chunk: the held prompt is one chunk, all its pages handed over at once
# prompt lengths: the held one five pages (one page read before the window is given back, the
# others one by one, DELAY apart), the other three (it runs while the held export is blocked)
HELD, OTHER = 320, 150
ENDED = 300  # an export ended while held back: five pages, more than its window of two
DELAY = 0.5  # seconds a page holds the window before it is given back


@pytest.fixture(scope="module")
def sglang(sglang_server):
    """The session's shared SGLang (tests/system/conftest.py), radix cache on but every request
    here with a cache salt of its own (`request`: every prefill computes), prefill chunks of
    CHUNK tokens, one thread. It starts in its decode role: the adapter switches it to its
    prefill role for these prefills (in milliseconds, once idle)."""
    assert sglang_server.settings.sglang_chunk_tokens == CHUNK
    return sglang_server


def ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(1000, 30000, n).tolist()


def request(name: str, token_ids: list[int], window: int | None = None) -> EngineRequest:
    """A prefill SGLang's radix cache serves nothing (a cache salt of its own): it computes every token."""
    sampling, mode = SamplingParams(max_tokens=1, temperature=0), FirstTokenMode.COMMIT_FIRST
    req = EngineRequest(name, token_ids, sampling, mode, cache_salt=fresh_salt(name))
    req.window = PageWindow(window) if window else None
    return req


async def prefill(
    adapter, req: EngineRequest, arrived: list | None = None, hold: float | None = 0.0, go: asyncio.Event | None = None
):
    """The prefill's pages and PrefillDone; each page's arrival time into `arrived`. A page holds its
    unit of the window until `go` is set (where given), then `hold` seconds more, then gives it back
    (None: for good)."""
    pages = []
    async for item in adapter.prefill(req):
        if isinstance(item, PrefillDone):
            return pages, item
        pages.append(item)
        if arrived is not None:
            arrived.append(time.monotonic())
        if req.window is not None and hold is not None:
            if go is not None:
                await go.wait()
            await asyncio.sleep(hold)
            req.window.give()
    raise AssertionError("the prefill ended without PrefillDone")


def cpu_seconds(pid: int) -> float:
    """CPU seconds used so far by a process and its children (SGLang's server, scheduler, …)."""
    root = psutil.Process(pid)
    return sum(sum(p.cpu_times()[:2]) for p in [root, *root.children(recursive=True)])


async def slots_freed(adapter, baseline: int) -> dict:
    """SGLang's pool back at `baseline` tokens in use and no prefill in flight (its metrics lag a
    little behind; its used tokens leave out what the radix cache keeps unlocked)."""
    deadline = time.monotonic() + 10
    while True:
        stats = await adapter.engine_stats()
        if (stats["kv_tokens_used"], stats["prefill_inflight"]) == (baseline, 0) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.2)


def test_a_held_back_export_lets_other_requests_run_and_its_pages_stay_exact(sglang):
    held_ids, pages, pid = ids(HELD, 1), sglang.geometry.pages_for(HELD), sglang.server.proc.pid
    assert pages == 5

    async def scenario() -> dict:
        baseline = (await sglang.engine_stats())["kv_tokens_used"]
        reference, reference_done = await prefill(sglang, request("reference", held_ids))
        arrived: list[float] = []
        go = asyncio.Event()  # the held export's window stays full until then
        held = asyncio.create_task(prefill(sglang, request("held", held_ids, window=1), arrived, DELAY, go))
        try:
            while not arrived:  # its one chunk is computed: the export is under way, its window full
                await asyncio.sleep(0.05)
            # another prefill, start to end, while the held export can send nothing at all
            other, _ = await asyncio.wait_for(prefill(sglang, request("other", ids(OTHER, 2))), 300)
            other_arrived = len(arrived)
            # then only the held export is left: SGLang waits for it without spinning a core
            cpu0, t1 = cpu_seconds(pid), time.monotonic()
            await asyncio.sleep(2)
            busy, busy_arrived = (cpu_seconds(pid) - cpu0) / (time.monotonic() - t1), len(arrived)
        finally:
            go.set()  # the window is given back, a page every DELAY seconds
        got, done = await held
        return dict(locals(), stats=await slots_freed(sglang, baseline))

    r = asyncio.run(scenario())
    # SGLang served the other prefill while the held one's pages waited for room
    assert len(r["other"]) == sglang.geometry.pages_for(OTHER)
    assert r["other_arrived"] == 1, f"{r['other_arrived']} held pages were read before the other prefill ended"
    assert r["busy_arrived"] == 1 and r["busy"] < 0.3, f"SGLang used {r['busy']:.2f} cores waiting for the window"
    # the held pages, in order and exact: those of the same prefill read at once
    got, reference, arrived = r["got"], r["reference"], r["arrived"]
    assert [p.index for p in got] == list(range(pages))
    assert all(np.array_equal(a.data, b.data) and a.valid_tokens == b.valid_tokens for a, b in zip(got, reference))
    assert r["done"].first_token == r["reference_done"].first_token
    assert arrived[-1] - arrived[1] >= (pages - 2) * DELAY  # they were held back: one by one
    assert (r["stats"]["kv_tokens_used"], r["stats"]["prefill_inflight"]) == (r["baseline"], 0), r["stats"]
    write_report("sglang_window_held", {k: r[k] for k in ("busy", "other_arrived", "busy_arrived")})


# how the export ends while the window is full, and why SGLang's log says its sender failed
ENDINGS = {
    "hangup": "the Tandem agent stopped reading",  # the agent closes the room's connection
    "cancel": "",  # the agent cancels the prefill: the room closes and SGLang aborts, either first
    "abort": "aborted by SGLang",  # SGLang aborts the request (its client went away) alone
}


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_an_export_ended_while_held_back_frees_its_slots(sglang, monkeypatch, ending):
    WINDOW = 2
    closed = []
    if ending == "abort":  # the room stays open: only SGLang's abort can stop the blocked sender
        monkeypatch.setattr(sglang.bridge, "close_room", closed.append)

    async def scenario() -> dict:
        baseline = (await sglang.engine_stats())["kv_tokens_used"]
        req, arrived = request(f"ended-{ending}", ids(ENDED, 3), window=WINDOW), []
        held = asyncio.create_task(prefill(sglang, req, arrived, hold=None))
        while len(arrived) < WINDOW:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # the window is full: SGLang's sender blocks on the socket
        (room,) = [name for name, box in sglang.bridge.rooms.items() if box.kind == "export"]
        if ending == "hangup":
            sglang.bridge.close_room(room)
        else:
            sglang.cancel(req.request_id)
        with pytest.raises((Cancelled, TandemError)):
            await held
        stats = await slots_freed(sglang, baseline)
        if closed:
            monkeypatch.undo()
            sglang.bridge.close_room(room)  # its reader, still waiting for room, lets go
        after, _ = await prefill(sglang, request(f"after-{ending}", ids(OTHER, 4)))  # SGLang serves on
        return dict(locals())

    r = asyncio.run(scenario())
    assert len(r["arrived"]) == WINDOW
    assert (r["stats"]["kv_tokens_used"], r["stats"]["prefill_inflight"]) == (r["baseline"], 0), r["stats"]
    assert f"Tandem export of room {r['room']} failed: {ENDINGS[ending]}" in sglang.server.log_tail(60)
    assert len(r["after"]) == sglang.geometry.pages_for(OTHER)
