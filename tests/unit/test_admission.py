"""The decoder's admission (node_agent/admission.py) on its own: a request that can never fit is
refused at once, the rest wait FIFO for KV and a sequence slot, then 429; nothing is held after."""

from __future__ import annotations

import asyncio

import pytest

from node_agent.admission import Admission
from node_agent.budget import BudgetTimeout
from tandem_protocol.errors import RequestError


def held(a: Admission) -> tuple[int, int, int]:
    s = a.status()
    return s["kv_reserved"], s["running"], s["waiting"]


def test_a_request_larger_than_the_whole_budget_is_refused_at_once():
    a = Admission(kv_bytes=1000, max_sequences=4)
    with pytest.raises(RequestError, match=r"needs 1,001 bytes of KV.*whole KV budget is 1,000 bytes"):
        asyncio.run(a.admit(1001))
    assert held(a) == (0, 0, 0)


def test_kv_waits_in_fifo_order_and_is_woken_by_a_release():
    async def go():
        a = Admission(kv_bytes=1000, max_sequences=8, wait_timeout=5)
        first = await a.admit(700)
        order = []

        async def later(name, nbytes):
            ticket = await a.admit(nbytes)
            order.append(name)
            return ticket

        big = asyncio.ensure_future(later("big", 600))
        await asyncio.sleep(0.05)
        small = asyncio.ensure_future(later("small", 100))  # fits now, but must not overtake
        await asyncio.sleep(0.05)
        assert order == [] and held(a) == (700, 1, 2)
        first.release()
        tickets = await asyncio.gather(big, small)
        assert order == ["big", "small"] and held(a) == (700, 2, 0)
        for t in tickets:
            t.release()
            t.release()  # idempotent
        return held(a)

    assert asyncio.run(go()) == (0, 0, 0)


def test_past_the_sequence_cap_a_request_waits_then_gets_429_with_retry_after():
    async def go():
        a = Admission(kv_bytes=10_000, max_sequences=2, wait_timeout=0.2)
        running = [await a.admit(10), await a.admit(10)]
        with pytest.raises(BudgetTimeout, match=r"sequence slots stayed busy for 0\.2 s \(2 of 2 sequences") as e:
            await a.admit(10)
        assert e.value.retry_after >= 1
        assert held(a) == (20, 2, 0)
        running[0].release()
        third = await a.admit(10)  # a slot came free
        for t in (running[1], third):
            t.release()
        return held(a)

    assert asyncio.run(go()) == (0, 0, 0)


def test_a_request_cancelled_while_waiting_holds_nothing():
    async def go():
        a = Admission(kv_bytes=100, max_sequences=4, wait_timeout=5)
        first = await a.admit(100)
        waiting = asyncio.ensure_future(a.admit(50))
        await asyncio.sleep(0.05)
        assert held(a) == (100, 1, 1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        first.release()
        return held(a)

    assert asyncio.run(go()) == (0, 0, 0)
