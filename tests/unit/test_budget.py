"""The staging budget (node_agent/budget.py) on its own: fit, FIFO order, timeout, cancel, resize."""

from __future__ import annotations

import asyncio

import pytest

from node_agent.budget import BudgetExceeded, BudgetTimeout, StagingBudget


def run(coro):
    return asyncio.run(coro)


async def settled() -> None:
    """Let woken waiters run (each wake resolves a future; its waiter resumes on the next turn)."""
    for _ in range(3):
        await asyncio.sleep(0)


def test_capacity_must_be_positive():
    for capacity in (0, -1):
        with pytest.raises(ValueError, match="positive"):
            StagingBudget(capacity)
    budget = StagingBudget(10)
    with pytest.raises(ValueError, match="positive"):
        budget.resize(0)
    assert budget.capacity == 10


def test_an_oversize_request_is_refused_at_once_and_names_both_sizes():
    async def main():
        budget = StagingBudget(1000)
        with pytest.raises(BudgetExceeded, match=r"1,001 bytes.*1,000 bytes"):
            await budget.reserve(1001, timeout=None)  # no timeout: it would wait forever if it waited
        assert (budget.reserved, budget.waiting) == (0, 0)

    run(main())


def test_reserve_and_release_account_exactly_and_release_is_idempotent():
    async def main():
        budget = StagingBudget(100)
        a = await budget.reserve(60)
        b = await budget.reserve(40)  # exactly full
        assert budget.reserved == 100
        a.release()
        a.release()
        assert budget.reserved == 40
        b.release()
        assert budget.reserved == 0

    run(main())


def test_waiters_are_served_in_fifo_order_and_a_small_one_never_overtakes():
    async def main():
        budget = StagingBudget(100)
        held = await budget.reserve(90)
        order: list[str] = []

        async def want(name: str, nbytes: int):
            r = await budget.reserve(nbytes, timeout=5)
            order.append(name)
            return r

        big = asyncio.create_task(want("big", 80))
        await settled()
        small = asyncio.create_task(want("small", 5))  # would fit now (90 + 5), but is behind big
        await settled()
        assert (order, budget.waiting, budget.waiting_bytes) == ([], 2, 85)
        held.release()
        await settled()
        assert order == ["big", "small"] and budget.reserved == 85
        (await big).release(), (await small).release()
        assert (budget.reserved, budget.waiting) == (0, 0)

    run(main())


def test_a_wait_past_its_deadline_times_out_with_retry_after_and_leaves_nothing():
    async def main():
        budget = StagingBudget(100)
        held = await budget.reserve(100)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(BudgetTimeout, match=r"busy for 0\.1 s \(100 of 100 bytes reserved") as e:
            await budget.reserve(10, timeout=0.1)
        assert 0.1 <= loop.time() - t0 < 1.0
        assert e.value.retry_after == 1.0  # never less than a second
        assert (budget.reserved, budget.waiting) == (100, 0)
        held.release()
        assert budget.reserved == 0

    run(main())


def test_a_timed_out_head_wakes_the_smaller_waiters_behind_it():
    async def main():
        budget = StagingBudget(100)
        held = await budget.reserve(50)
        head = asyncio.create_task(budget.reserve(80, timeout=0.05))
        await settled()
        behind = asyncio.create_task(budget.reserve(30, timeout=5))
        await settled()
        assert not behind.done()  # fits, but waits behind the head
        with pytest.raises(BudgetTimeout):
            await head
        r = await asyncio.wait_for(behind, 1)
        assert budget.reserved == 80
        r.release(), held.release()
        assert budget.reserved == 0

    run(main())


def test_a_cancelled_waiter_leaves_the_queue_and_holds_nothing():
    async def main():
        budget = StagingBudget(100)
        held = await budget.reserve(100)
        waiter = asyncio.create_task(budget.reserve(10, timeout=5))
        await settled()
        assert budget.waiting == 1
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert (budget.reserved, budget.waiting) == (100, 0)
        held.release()
        assert budget.reserved == 0

    run(main())


def test_a_waiter_cancelled_as_it_is_granted_gives_the_grant_back():
    """The release wakes the waiter (its future resolved) and the waiter is cancelled before it
    resumes: the reservation it was handed must go back, not leak."""

    async def main():
        budget = StagingBudget(100)
        held = await budget.reserve(100)
        waiter = asyncio.create_task(budget.reserve(40, timeout=5))
        await settled()
        held.release()  # grants 40 to the waiter synchronously
        assert budget.reserved == 40
        waiter.cancel()  # before it ran again
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert (budget.reserved, budget.waiting) == (0, 0)

    run(main())


def test_resize_refuses_waiters_that_can_never_fit_and_wakes_those_that_now_do():
    async def main():
        budget = StagingBudget(100)
        held = await budget.reserve(100)
        huge = asyncio.create_task(budget.reserve(90, timeout=5))
        await settled()
        small = asyncio.create_task(budget.reserve(20, timeout=5))
        await settled()
        budget.resize(50)  # huge can never fit now; small still waits (100 of 50 reserved)
        with pytest.raises(BudgetExceeded, match=r"shrank to 50 bytes, below this request's 90"):
            await huge
        assert budget.waiting == 1 and not small.done()
        budget.resize(200)  # now small fits beside what is held
        r = await asyncio.wait_for(small, 1)
        assert budget.reserved == 120
        r.release(), held.release()
        assert (budget.reserved, budget.waiting) == (0, 0)
        with pytest.raises(BudgetExceeded):  # the new capacity is what oversize is measured against
            await budget.reserve(201)

    run(main())


def test_a_page_window_lends_its_pages_and_waits_for_them_back():
    from engine_adapters.base import PageWindow
    from tandem_protocol.errors import Cancelled

    async def main():
        window = PageWindow(2)
        assert window.try_take() and window.try_take() and not window.try_take()
        assert window.held == 2
        taker = asyncio.create_task(window.take())
        await asyncio.sleep(0)
        assert not taker.done()  # full: the third page waits
        window.give()
        await taker  # woken by the page given back, and holds it now
        assert window.held == 2
        waiting = asyncio.create_task(window.take())
        await asyncio.sleep(0)
        window.close()  # the handoff ended
        with pytest.raises(Cancelled, match="handoff ended"):
            await waiting
        assert not window.try_take()
        with pytest.raises(AssertionError):
            window.give(3)  # more back than was taken is a bug, not a page

    asyncio.run(main())
