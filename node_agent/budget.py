"""The staging budget: how many bytes of KV pages a node may hold in flight at once. (The same
FIFO budget, under another name, counts the decoder's KV and sequence slots: admission.py.)

A prefill reserves `pages × page_bytes` *before* any compute. A request larger than the whole
budget is refused at once (`BudgetExceeded`). Otherwise it waits its turn in strict FIFO order
— a later small request never overtakes an earlier large one — until capacity frees up or its
deadline passes (`BudgetTimeout`, which carries a Retry-After hint). Waiting is event-driven:
each waiter sleeps on its own future and `release` wakes the head of the queue; nothing polls.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from tandem_protocol.errors import TandemError


class BudgetExceeded(TandemError):
    """The request alone is larger than the whole staging budget."""


class BudgetTimeout(TandemError):
    """The budget stayed busy past the request's deadline."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


class Reservation:
    """Bytes held against the budget; `release` is idempotent."""

    def __init__(self, budget: StagingBudget, nbytes: int):
        self.budget = budget
        self.nbytes = nbytes
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.budget._give_back(self.nbytes)


@dataclass
class _Waiter:
    nbytes: int
    future: asyncio.Future


class StagingBudget:
    def __init__(self, capacity: int, what: str = "staging budget", unit: str = "bytes"):
        if capacity <= 0:
            raise ValueError(f"the {what} must be positive")
        self.capacity, self.what, self.unit = capacity, what, unit
        self.reserved = 0
        self._waiters: deque[_Waiter] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def waiting_bytes(self) -> int:
        return sum(w.nbytes for w in self._waiters)

    def check_fits(self, nbytes: int) -> None:
        if nbytes > self.capacity:
            raise BudgetExceeded(
                f"this prompt needs {nbytes:,} bytes of KV staging but the node's whole budget is "
                f"{self.capacity:,} bytes: raise --staging-bytes or send a shorter prompt"
            )

    async def reserve(self, nbytes: int, timeout: float | None = None) -> Reservation:
        """Wait (FIFO) until `nbytes` fit, at most `timeout` seconds; return the reservation."""
        self.check_fits(nbytes)
        if not self._waiters and self.reserved + nbytes <= self.capacity:
            self.reserved += nbytes
            return Reservation(self, nbytes)
        waiter = _Waiter(nbytes, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        try:
            # not wait_for: on 3.11 it swallows a cancel that lands as the grant arrives, and a
            # request cancelled while waiting would go on to run
            async with asyncio.timeout(timeout):
                return await asyncio.shield(waiter.future)
        except (TimeoutError, asyncio.CancelledError) as e:
            if waiter.future.done() and not waiter.future.cancelled():
                waiter.future.result().release()  # granted at the moment we gave up
            else:
                waiter.future.cancel()
                self._waiters.remove(waiter)
                self._wake()  # the head may have been blocking smaller requests behind it
            if isinstance(e, asyncio.TimeoutError):
                raise BudgetTimeout(
                    f"the {self.what} stayed busy for {timeout:.1f} s ({self.reserved:,} of "
                    f"{self.capacity:,} {self.unit} reserved, {len(self._waiters)} waiting)",
                    retry_after=max(1.0, timeout or 1.0),
                ) from None
            raise

    def resize(self, capacity: int) -> None:
        """Change the capacity (a panel sets a pair's budget). Waiters that can no longer ever fit
        are refused as an oversize request would be; the others may now fit."""
        if capacity <= 0:
            raise ValueError(f"the {self.what} must be positive")
        self.capacity = capacity
        for waiter in [w for w in self._waiters if w.nbytes > capacity]:
            self._waiters.remove(waiter)
            if not waiter.future.done():
                waiter.future.set_exception(
                    BudgetExceeded(
                        f"the {self.what} shrank to {capacity:,} {self.unit}, below this request's {waiter.nbytes:,}"
                    )
                )
        self._wake()

    def _give_back(self, nbytes: int) -> None:
        self.reserved -= nbytes
        assert self.reserved >= 0, f"the {self.what} released more than it reserved"
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.reserved + self._waiters[0].nbytes <= self.capacity:
            waiter = self._waiters.popleft()
            if waiter.future.done():
                continue
            self.reserved += waiter.nbytes
            waiter.future.set_result(Reservation(self, waiter.nbytes))
