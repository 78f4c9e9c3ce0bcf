"""The prefiller's handoffs (node_agent/handoffs.py) on every way a handoff ends, against a fake
engine whose prefill the test steps page by page: the subject is the manager's bookkeeping
(budget, engine cancel, staged frames, lease, the reader's last frame), not an engine.

After each path the same things must hold: the handoff is gone, its reservation is back, the
engine was told to stop and its prefill has ended (the manager waited for it), and the outcome
is counted once."""

from __future__ import annotations

import asyncio
import json
import uuid
from contextlib import aclosing
from types import SimpleNamespace

import numpy as np
import pytest

from node_agent.budget import BudgetExceeded, StagingBudget
from node_agent.engine_slot import EngineSlot
from node_agent.handoffs import HandoffError, HandoffManager
from node_agent.metrics import Metrics
from tandem_protocol.errors import Cancelled, RequestError
from tandem_protocol.handoff import FirstTokenMode, PrefillDone
from tandem_protocol.http_server import TrackedFrame
from tandem_protocol.pages import PageGeometry, make_page
from tandem_protocol.sampling import SamplingParams
from tandem_protocol.wire import DONE_MAGIC, ERROR_MAGIC, HEARTBEAT_MAGIC

GEOMETRY = PageGeometry(layers=2, kv_heads=1, head_dim=8)
COMMIT = FirstTokenMode.COMMIT_FIRST


class FakeEngine:
    """What HandoffManager calls of an engine. Prefill yields one page each time the test calls
    `allow`, stops with Cancelled at its next page once `cancel` is called (as a real engine stops
    at its next chunk), and records when it has ended (a real engine frees its memory then)."""

    name = "fake"
    geometry = GEOMETRY
    contract = SimpleNamespace(fingerprint_bytes=bytes(range(16)))
    holds_bytes = 1 << 30  # the KV this engine can hold (kv_budget_bytes)

    def __init__(self, fail_at: int | None = None):
        self.fail_at = fail_at  # raise a non-Tandem error before this page (an engine crash)
        self.gate = asyncio.Semaphore(0)
        self.cancelled: set[str] = set()
        self.running: set[str] = set()
        self.ended = asyncio.Event()
        self.fill: dict[int, float] = {}  # page index -> the value its data holds (default: the index)

    def allow(self, pages: int = 1) -> None:
        for _ in range(pages):
            self.gate.release()

    def kv_budget_bytes(self) -> int:
        return self.holds_bytes

    def validate(self, req, generates: bool) -> None:
        if not req.token_ids:
            raise RequestError("the prompt is empty: at least one token is needed")

    def cancel(self, request_id: str) -> bool:
        self.cancelled.add(request_id)
        self.gate.release()  # wake a prefill waiting for its next page
        return request_id in self.running

    async def prefill(self, req):
        self.running.add(req.request_id)
        try:
            n = len(req.token_ids)
            pages = GEOMETRY.pages_for(n)
            for i in range(pages):
                await self.gate.acquire()
                if req.request_id in self.cancelled:
                    raise Cancelled(f"request {req.request_id} was cancelled")
                if i == self.fail_at:
                    raise RuntimeError("device lost")
                tokens = min(GEOMETRY.page_tokens, n - i * GEOMETRY.page_tokens)
                if req.window is not None:  # the contract: a unit of the window per page yielded
                    await req.window.take()
                yield make_page(GEOMETRY, i, np.full((2, 2, tokens, 1, 8), self.fill.get(i, i), np.float32))
            yield PrefillDone(first_token=7, kv_tokens=n, pages=pages, prefill_seconds=0.01)
        finally:
            self.running.discard(req.request_id)
            self.ended.set()


def setup(capacity_pages: int = 8, ttl: float = 60.0, **engine):
    engine = FakeEngine(**engine)
    metrics = Metrics()
    budget = StagingBudget(capacity_pages * GEOMETRY.page_bytes)
    return engine, budget, metrics, HandoffManager(EngineSlot(engine), budget, metrics, ttl=ttl)


def finished(metrics: Metrics, outcome: str) -> float:
    return Metrics.value(metrics.handoffs_finished.labels(outcome=outcome))


async def written(frames):
    """A handoff's frames as the page-stream response passes them on: each page as its (header,
    payload) pieces, reported written (its room in the window back) as it is taken."""
    async with aclosing(frames):
        async for frame in frames:
            if isinstance(frame, TrackedFrame):
                frame.on_written()
                frame = frame.pieces
            yield frame


def kind(frame) -> str:
    if isinstance(frame, tuple):
        return "page"
    return {DONE_MAGIC: "done", ERROR_MAGIC: "error", HEARTBEAT_MAGIC: "heartbeat"}[frame[:4]]


def error_of(frame: bytes) -> dict:
    assert kind(frame) == "error", frame[:4]
    return json.loads(frame[8:])


def assert_released(engine: FakeEngine, budget: StagingBudget, manager: HandoffManager, handoff_id: str) -> None:
    assert handoff_id not in manager.handoffs and handoff_id not in manager.waiting
    assert (budget.reserved, budget.waiting) == (0, 0)
    assert not engine.running, "the manager returned before the engine's prefill ended"


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))  # a hang fails in 10 s instead of hanging the tier


async def create(manager: HandoffManager, tokens: int = 150, handoff_id: str | None = None, timeout: float = 5.0):
    handoff_id = handoff_id or uuid.uuid4().hex
    return await manager.create(handoff_id, list(range(1, tokens + 1)), SamplingParams(max_tokens=4), COMMIT, timeout)


def test_read_to_the_end():
    async def main():
        engine, budget, metrics, manager = setup()
        h = await create(manager, tokens=150)  # 3 pages
        assert budget.reserved == 3 * GEOMETRY.page_bytes  # reserved before any compute
        frames = written(await manager.stream(h.handoff_id))
        engine.allow(3)
        got = [f async for f in frames]
        assert [kind(f) for f in got] == ["page", "page", "page", "done"]
        assert h.pages_sent == 3 and h.state == "done"
        assert_released(engine, budget, manager, h.handoff_id)
        assert finished(metrics, "done") == 1 and Metrics.value(metrics.pages_sent) == 3

    run(main())


def test_a_reader_waiting_for_pages_gets_heartbeats(monkeypatch):
    """While prefill computes and nothing is queued the reader gets a heartbeat every
    HEARTBEAT_SECONDS, never while pages flow; they count as no page."""
    from node_agent import handoffs

    monkeypatch.setattr(handoffs, "HEARTBEAT_SECONDS", 0.05)

    async def main():
        engine, budget, metrics, manager = setup()
        h = await create(manager, tokens=150)
        frames = written(await manager.stream(h.handoff_id))
        loop = asyncio.get_running_loop()
        loop.call_later(0.4, engine.allow, 1)
        loop.call_later(0.8, engine.allow, 2)
        got = [kind(f) async for f in frames]
        pages = [i for i, k in enumerate(got) if k == "page"]
        assert got[:3] == ["heartbeat"] * 3, got  # ~8 in the first 0.4 s
        assert got[pages[0] + 1 : pages[0] + 4].count("heartbeat") >= 3, got  # between page 0 and 1
        assert pages[2] == pages[1] + 1 and got[-1] == "done", got  # no beat while pages are queued
        assert h.pages_sent == 3
        assert_released(engine, budget, manager, h.handoff_id)

    run(main())


def test_cancel_while_prefilling_with_no_reader():
    async def main():
        engine, budget, metrics, manager = setup()
        h = await create(manager)
        engine.allow(1)
        await asyncio.sleep(0)
        assert await manager.cancel(h.handoff_id) is True
        assert f"handoff-{h.handoff_id}" in engine.cancelled
        assert_released(engine, budget, manager, h.handoff_id)
        assert h.frames.empty(), "staged pages were kept after the handoff ended"
        assert await manager.cancel(h.handoff_id) is False  # idempotent: already gone
        assert finished(metrics, "cancelled") == 1

    run(main())


def test_cancel_while_a_reader_waits_ends_its_stream_with_the_reason():
    async def main():
        engine, budget, metrics, manager = setup()
        h = await create(manager)
        frames = written(await manager.stream(h.handoff_id))
        engine.allow(1)
        first = await anext(frames)
        assert kind(first) == "page"
        cancelling = asyncio.create_task(manager.cancel(h.handoff_id))
        last = await anext(frames)  # the reader waited for its next page
        error = error_of(last)  # the engine's own Cancelled, or the manager's if the engine had ended
        assert error["code"] == "cancelled" and "was cancelled" in error["message"], error
        assert await cancelling is True
        with pytest.raises(StopAsyncIteration):
            await anext(frames)
        assert_released(engine, budget, manager, h.handoff_id)
        assert finished(metrics, "cancelled") == 1 and finished(metrics, "failed") == 0

    run(main())


def test_a_reader_that_goes_away_mid_stream_stops_prefill():
    async def main():
        engine, budget, metrics, manager = setup()
        h = await create(manager)
        frames = written(await manager.stream(h.handoff_id))
        engine.allow(1)
        assert kind(await anext(frames)) == "page"
        await frames.aclose()  # the decoder hung up
        assert f"handoff-{h.handoff_id}" in engine.cancelled
        assert_released(engine, budget, manager, h.handoff_id)
        assert finished(metrics, "reader_gone") == 1

    run(main())


def test_a_reader_task_cancelled_mid_teardown_still_releases_everything():
    """The server cancels a stream's task when its client disconnects: the teardown is shielded."""

    async def main():
        engine, budget, metrics, manager = setup()
        h = await create(manager)
        frames = written(await manager.stream(h.handoff_id))

        async def read():
            async for _ in frames:
                pass

        reader = asyncio.create_task(read())
        engine.allow(1)
        while h.pages_sent < 1:
            await asyncio.sleep(0)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        await asyncio.wait_for(engine.ended.wait(), 2)
        for _ in range(3):
            await asyncio.sleep(0)  # the shielded teardown's last synchronous steps
        assert_released(engine, budget, manager, h.handoff_id)
        assert finished(metrics, "reader_gone") == 1

    run(main())


def test_unread_pages_expire_with_the_lease():
    async def main():
        engine, budget, metrics, manager = setup(ttl=0.05)
        h = await create(manager)
        engine.allow(3)  # prefill finishes; nobody reads
        await asyncio.wait_for(engine.ended.wait(), 2)
        assert h.handoff_id in manager.handoffs and budget.reserved > 0  # pages wait for a reader
        while h.handoff_id in manager.handoffs or budget.reserved:
            await asyncio.sleep(0.01)
        assert_released(engine, budget, manager, h.handoff_id)
        assert h.frames.empty() and finished(metrics, "expired") == 1

    run(main())


def test_a_reader_cancels_the_lease_and_reads_a_prefill_longer_than_it():
    async def main():
        engine, budget, metrics, manager = setup(ttl=0.05)
        h = await create(manager)
        frames = written(await manager.stream(h.handoff_id))
        await asyncio.sleep(0.15)  # three leases long, prefill not even started
        assert h.handoff_id in manager.handoffs
        engine.allow(3)
        assert [kind(f) async for f in frames] == ["page", "page", "page", "done"]
        assert_released(engine, budget, manager, h.handoff_id)
        assert finished(metrics, "done") == 1 and finished(metrics, "expired") == 0

    run(main())


def test_an_engine_crash_ends_the_stream_with_an_error_frame():
    async def main():
        engine, budget, metrics, manager = setup(fail_at=1)
        h = await create(manager)
        frames = written(await manager.stream(h.handoff_id))
        engine.allow(3)
        got = [f async for f in frames]
        assert [kind(f) for f in got] == ["page", "error"]
        assert error_of(got[-1]) == {"code": "engine_error", "message": "prefill failed: device lost"}
        assert_released(engine, budget, manager, h.handoff_id)
        assert finished(metrics, "failed") == 1

    run(main())


def test_cancelled_while_waiting_for_budget():
    async def main():
        engine, budget, metrics, manager = setup(capacity_pages=3)
        first = await create(manager, tokens=150)  # takes the whole budget
        handoff_id = uuid.uuid4().hex
        waiting = asyncio.create_task(create(manager, tokens=100, handoff_id=handoff_id))
        while handoff_id not in manager.waiting or not budget.waiting:
            await asyncio.sleep(0)
        assert budget.waiting == 1
        assert await manager.cancel(handoff_id) is True
        with pytest.raises(Cancelled, match=f"handoff {handoff_id} was cancelled while waiting for staging budget"):
            await waiting
        assert handoff_id not in manager.waiting and handoff_id not in manager.handoffs
        assert budget.waiting == 0 and budget.reserved == 3 * GEOMETRY.page_bytes  # only the first's
        assert manager.prefill_calls == 1 and finished(metrics, "cancelled_waiting") == 1
        await manager.cancel(first.handoff_id)
        assert_released(engine, budget, manager, first.handoff_id)

    run(main())


def test_refusals_hold_nothing_and_compute_nothing():
    async def main():
        engine, budget, metrics, manager = setup(capacity_pages=2)
        engine.holds_bytes = 149 * GEOMETRY.token_bytes
        with pytest.raises(BudgetExceeded, match="more than the fake engine on this node can hold"):
            await create(manager, tokens=150)  # more KV than the engine holds: refused, not waited for
        engine.holds_bytes = FakeEngine.holds_bytes
        with pytest.raises(RequestError, match="empty"):
            await manager.create(uuid.uuid4().hex, [], SamplingParams(), COMMIT, 5.0)
        assert manager.prefill_calls == 0 and (budget.reserved, budget.waiting) == (0, 0)
        h = await create(manager, tokens=10)
        with pytest.raises(HandoffError) as e:
            await create(manager, tokens=10, handoff_id=h.handoff_id)
        assert e.value.status == 409 and "already exists" in str(e.value)
        await manager.stream(h.handoff_id)
        with pytest.raises(HandoffError) as e:
            await manager.stream(h.handoff_id)
        assert e.value.status == 409 and "already being read" in str(e.value)
        with pytest.raises(HandoffError) as e:
            await manager.stream(uuid.uuid4().hex)
        assert e.value.status == 404
        assert budget.reserved == GEOMETRY.page_bytes  # the refusals took nothing of the budget
        await manager.close()
        assert_released(engine, budget, manager, h.handoff_id)

    run(main())


def test_shutdown_ends_every_handoff_and_tells_the_readers():
    async def main():
        engine, budget, metrics, manager = setup()
        read, unread = await create(manager), await create(manager)
        frames = written(await manager.stream(read.handoff_id))
        await manager.close()
        got = [f async for f in frames]
        assert [kind(f) for f in got] == ["error"] and error_of(got[0])["code"] == "shutdown"
        assert manager.handoffs == {} and (budget.reserved, budget.waiting) == (0, 0)
        assert not engine.running and {f"handoff-{read.handoff_id}", f"handoff-{unread.handoff_id}"} <= engine.cancelled
        assert finished(metrics, "shutdown") == 2

    run(main())


def test_a_prompt_larger_than_the_budget_streams_through_its_window():
    """Six pages through a two-page budget: the reservation is the window, never the prompt; the
    engine's third page waits (in the engine) until the reader has taken one off the window."""

    async def main():
        engine, budget, metrics, manager = setup(capacity_pages=2)
        h = await create(manager, tokens=6 * GEOMETRY.page_tokens)
        assert budget.reserved == 2 * GEOMETRY.page_bytes and h.window.pages == 2
        engine.allow(6)
        for _ in range(20):
            await asyncio.sleep(0)
        assert h.frames.qsize() == 2 and h.window.held == 2  # the rest wait for room
        assert manager.staged_bytes() == 2 * GEOMETRY.page_bytes
        frames = written(await manager.stream(h.handoff_id))
        got, peak = [], 0
        async for f in frames:
            got.append(kind(f))
            peak = max(peak, h.window.held)
        assert got == ["page"] * 6 + ["done"] and peak <= 2
        assert_released(engine, budget, manager, h.handoff_id)

    run(main())


def test_cancel_while_the_prefill_waits_for_room_frees_everything():
    async def main():
        engine, budget, metrics, manager = setup(capacity_pages=2)
        h = await create(manager, tokens=6 * GEOMETRY.page_tokens)
        engine.allow(6)
        while h.window.held < 2:
            await asyncio.sleep(0)
        assert await manager.cancel(h.handoff_id) is True  # the prefill waits in `take`: woken, ends
        assert_released(engine, budget, manager, h.handoff_id)
        assert finished(metrics, "cancelled") == 1

    run(main())


def test_a_budget_below_one_page_is_refused():
    async def main():
        engine, budget, metrics, manager = setup()
        budget.resize(GEOMETRY.page_bytes - 1)
        with pytest.raises(BudgetExceeded, match="smaller than one page"):
            await create(manager)
        assert manager.prefill_calls == 0 and budget.reserved == 0

    run(main())


def test_encoded_pages_are_made_apart_from_the_prefill_and_leave_in_order(monkeypatch):
    """FP8 pages are encoded in worker threads: the prefill yields its next page while earlier ones
    are still being encoded (encoded one after another in its path, they held the engine back:
    8k tokens of an 8B model, prefill 0.49 s -> 3.6 s on an H100), and the reader gets every
    page, in order, as the codec makes it."""
    import threading

    from node_agent import handoffs as handoffs_module
    from tandem_protocol.pages import ENCODINGS, decode_frame, encode_frame

    release = threading.Event()
    started = []

    def slow_encode(page, **kw):
        started.append(page.index)
        release.wait(5)  # every encode waits until the prefill has yielded all its pages
        return encode_frame(page, **kw)

    monkeypatch.setattr(handoffs_module, "encode_frame", slow_encode)

    async def main():
        engine, budget, metrics, manager = setup()
        h = await create_encoded(manager, 4 * GEOMETRY.page_tokens, ENCODINGS["fp8"])
        engine.allow(4)
        while not engine.ended.is_set():  # all four pages and the final item left the engine
            await asyncio.sleep(0.001)
        assert h.state == "prefilled" and h.frames.qsize() == 5  # four pages (being encoded) + done
        release.set()
        frames = written(await manager.stream(h.handoff_id))
        got = [f async for f in frames]
        assert [kind(f) for f in got] == ["page"] * 4 + ["done"]
        pages = [decode_frame(b"".join(f))[1] for f in got[:4]]
        assert [p.index for p in pages] == [0, 1, 2, 3]
        assert [float(p.data.max()) for p in pages] == [0.0, 1.0, 2.0, 3.0]  # exact in FP8
        assert_released(engine, budget, manager, h.handoff_id)

    run(main())


def test_a_page_that_cannot_be_encoded_ends_the_stream_with_an_error_and_frees_everything():
    from tandem_protocol.pages import ENCODINGS

    async def main():
        engine, budget, metrics, manager = setup()
        engine.fill = {1: np.inf}  # FP8 has no infinities: page 1 cannot be encoded
        h = await create_encoded(manager, 3 * GEOMETRY.page_tokens, ENCODINGS["fp8"])
        frames = written(await manager.stream(h.handoff_id))
        engine.allow(3)
        got = [f async for f in frames]
        assert [kind(f) for f in got] == ["page", "error"]
        assert "page encoding failed" in error_of(got[-1])["message"]
        assert_released(engine, budget, manager, h.handoff_id)
        assert finished(metrics, "failed") == 1

    run(main())


async def create_encoded(manager: HandoffManager, tokens: int, encoding: int):
    ids = list(range(1, tokens + 1))
    return await manager.create(uuid.uuid4().hex, ids, SamplingParams(max_tokens=4), COMMIT, 5.0, encoding=encoding)
