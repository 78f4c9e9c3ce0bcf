"""Failed logins are limited per client address and in all, so the admin password cannot be
guessed quickly.

After `max_failures` wrong passwords within `window` seconds, POST /login from that address is
answered 429 with Retry-After until the oldest failure leaves the window — without checking the
password, so a blocked guesser learns nothing, not even from timing. A successful login clears the
address's count. The address is the TCP peer's: X-Forwarded-For is not trusted (anyone can send it);
behind a reverse proxy every client shares the proxy's address, which limits them together — the
safe side. An IPv6 client counts by its /64, the block one host gets: rotating source addresses
within it buys nothing.

The panel has one account, so the limit also holds for all addresses together (`max_total`
failures a window), as a per-user lockout would: a guesser with many addresses gets no more
tries a minute than that. The admin's own session keeps working meanwhile, and
`tandem panel --reset-admin-password` needs no login.
"""

from __future__ import annotations

import ipaddress
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
        max_total: int = 20,
    ):
        self.max_failures, self.window, self.clock = max_failures, window, clock
        self.max_addresses = max_addresses  # bounds memory when many addresses fail
        self._failures: dict[str, deque[float]] = {}
        self._all: deque[float] = deque(maxlen=max_total)  # every address's failures, newest last

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

    def _wait(self, failures: deque[float] | None) -> int | None:
        """Seconds until the oldest of a full window of failures leaves it, or None if not full."""
        if failures is None or len(failures) < failures.maxlen:
            return None
        wait = failures[0] + self.window - self.clock()
        return max(1, math.ceil(wait)) if wait > 0 else None

    def retry_after(self, address: str) -> int | None:
        """Whole seconds until `address` may try again, or None if it may try now."""
        waits = [w for w in (self._wait(self._recent(client_of(address))), self._wait(self._all)) if w]
        return max(waits) if waits else None

    def failed(self, address: str) -> None:
        self._all.append(self.clock())
        address = client_of(address)
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
        self._failures.pop(client_of(address), None)


def client_of(address: str) -> str:
    """The key an address is counted under: itself, or its /64 for IPv6."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if ip.version == 6:
        if ip.ipv4_mapped:  # a dual-stack socket's IPv4 client
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)
