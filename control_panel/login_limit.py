"""Failed logins are limited per client address, so the admin password cannot be guessed quickly.

After `max_failures` wrong passwords within `window` seconds, POST /login from that address is
answered 429 with Retry-After until the oldest failure leaves the window — without checking the
password, so a blocked guesser learns nothing, not even from timing. A successful login clears the
address's count. The address is the TCP peer's: X-Forwarded-For is not trusted (anyone can send it);
behind a reverse proxy every client shares the proxy's address, which limits them together — the
safe side.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable


class LoginLimiter:
    def __init__(
        self,
        max_failures: int = 5,
        window: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        max_addresses: int = 10_000,
    ):
        self.max_failures, self.window, self.clock = max_failures, window, clock
        self.max_addresses = max_addresses  # bounds memory when many addresses fail
        self._failures: dict[str, deque[float]] = {}

    def _recent(self, address: str) -> deque[float] | None:
        failures = self._failures.get(address)
        if failures is not None:
            cutoff = self.clock() - self.window
            while failures and failures[0] <= cutoff:
                failures.popleft()
            if not failures:
                del self._failures[address]
                return None
        return failures

    def retry_after(self, address: str) -> int | None:
        """Whole seconds until `address` may try again, or None if it may try now."""
        failures = self._recent(address)
        if failures is None or len(failures) < self.max_failures:
            return None
        return max(1, math.ceil(failures[0] + self.window - self.clock()))  # the oldest of the last few

    def failed(self, address: str) -> None:
        failures = self._recent(address)
        if failures is None:
            if len(self._failures) >= self.max_addresses:
                for stale in list(self._failures):  # forget expired addresses, then the oldest
                    self._recent(stale)
                if len(self._failures) >= self.max_addresses:
                    del self._failures[next(iter(self._failures))]
            failures = self._failures[address] = deque(maxlen=self.max_failures)
        failures.append(self.clock())

    def succeeded(self, address: str) -> None:
        self._failures.pop(address, None)
