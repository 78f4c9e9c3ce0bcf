"""Per-API-key limits: requests in flight at once, and tokens per minute (prompt plus generated
tokens, as the answer's `usage` counts them). Checked when a request comes in, before any agent is
asked anything; a request over a limit is refused at once (429 and a Retry-After), never queued,
so nothing here waits or polls. The state is in memory: one panel process serves the API.

A key's tokens are a bucket that holds one minute's worth and refills continuously. A request is
let in unless the bucket is below zero, and takes its tokens as they become known (its prompt once
tokenized, its answer once it ends), since they are not known before: a long answer may take the
bucket below zero, and the key's next requests are refused until it has refilled to zero.

A request of `n` choices runs `n` sequences: its extra `n - 1` count as requests in flight, and
their most tokens (`(n - 1) × max_tokens`) are held from the bucket up front (`Slot.widen`),
returned when the request ends, while what each choice really generated is charged as it ends.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from .api.errors import OpenAIError

# A request refused for the key's concurrency cannot know when a running one ends: ask the client
# to try again soon.
BUSY_RETRY_SECONDS = 1


class TokenBucket:
    def __init__(self, per_minute: int, now: float):
        self.per_minute, self.level, self.at = per_minute, float(per_minute), now

    def refill(self, now: float) -> None:
        self.level = min(self.per_minute, self.level + (now - self.at) * self.per_minute / 60)
        self.at = now

    def seconds_until_open(self, now: float) -> float:
        """0 unless the bucket is below zero, else how long until it has refilled to zero."""
        self.refill(now)
        return max(0.0, -self.level * 60 / self.per_minute)

    def resize(self, per_minute: int) -> None:
        """The limit was changed on the Settings page: keep what was used."""
        self.per_minute, self.level = per_minute, min(self.level, per_minute)


class Slot:
    """One admitted request's hold on its key: a place among the key's requests in flight, until
    `release` (called however the request ends; a second call does nothing), and what it takes
    from the key's bucket (`charge`)."""

    def __init__(self, limiter: RateLimiter, key_id: int, bucket: TokenBucket | None, concurrent: int | None = None):
        self.limiter, self.key_id, self.bucket, self.released = limiter, key_id, bucket, False
        self.concurrent, self.places, self.held = concurrent, 1, 0

    def widen(self, n: int, max_tokens: int) -> None:
        """Room for `n` choices of at most `max_tokens` each: `n - 1` more places among the key's
        requests in flight and their tokens held, or an OpenAIError (400 if they could never fit,
        429 if not now)."""
        extra, hold = n - 1, (n - 1) * max_tokens
        if extra <= 0:
            return
        running = self.limiter.in_flight[self.key_id]
        if self.concurrent is not None and n > self.concurrent:
            raise OpenAIError(
                400,
                f"n={n} choices run as {n} requests, and this API key may run {self.concurrent} at once",
                param="n",
            )
        if self.concurrent is not None and running + extra > self.concurrent:
            raise OpenAIError(
                429,
                f"n={n} choices run as {n} requests, and this API key already has {running - 1} other "
                f"requests running of its {self.concurrent}; try again when they end",
                kind="requests",
                code="rate_limit_exceeded",
                retry_after=BUSY_RETRY_SECONDS,
            )
        if self.bucket is not None:
            if hold > self.bucket.per_minute:
                raise OpenAIError(
                    400,
                    f"n={n} choices of max_tokens={max_tokens} may take {hold + max_tokens} tokens, "
                    f"more than this API key's {self.bucket.per_minute} a minute",
                    param="n",
                )
            now = self.limiter.clock()
            self.bucket.refill(now)
            if self.bucket.level < hold:
                wait = (hold - self.bucket.level) * 60 / self.bucket.per_minute
                raise OpenAIError(
                    429,
                    f"n={n} choices need {hold} more tokens of this API key's {self.bucket.per_minute} "
                    f"per minute than it has left; try again in {math.ceil(wait)} s",
                    kind="tokens",
                    code="rate_limit_exceeded",
                    retry_after=max(1, math.ceil(wait)),
                )
            self.bucket.level -= hold
            self.held = hold
        self.limiter.in_flight[self.key_id] += extra
        self.places += extra

    def charge(self, tokens: int) -> None:
        if self.bucket is not None and tokens > 0:
            self.bucket.refill(self.limiter.clock())
            self.bucket.level -= tokens

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.limiter.in_flight[self.key_id] -= self.places
            if self.held:  # what the choices really took was charged as each ended
                self.bucket.refill(self.limiter.clock())
                self.bucket.level += self.held


class RateLimiter:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.in_flight: dict[int, int] = {}  # key id -> its requests admitted and not yet ended
        self.buckets: dict[int, TokenBucket] = {}  # key id -> its tokens, for keys with a rate

    def admit(self, key_id: int, concurrent: int | None, tokens_per_minute: int | None) -> Slot:
        """A slot for one request of the key, or an OpenAIError 429 if a limit (None: none) is reached."""
        running = self.in_flight.get(key_id, 0)
        if concurrent is not None and running >= concurrent:
            raise OpenAIError(
                429,
                f"this API key already has {running} requests running, its limit; try again when one ends",
                kind="requests",
                code="rate_limit_exceeded",
                retry_after=BUSY_RETRY_SECONDS,
            )
        bucket = self._bucket(key_id, tokens_per_minute)
        if bucket is not None and (wait := bucket.seconds_until_open(self.clock())) > 0:
            raise OpenAIError(
                429,
                f"this API key used its {tokens_per_minute} tokens per minute; try again in {math.ceil(wait)} s",
                kind="tokens",
                code="rate_limit_exceeded",
                retry_after=max(1, math.ceil(wait)),
            )
        self.in_flight[key_id] = running + 1
        return Slot(self, key_id, bucket, concurrent)

    def _bucket(self, key_id: int, per_minute: int | None) -> TokenBucket | None:
        if per_minute is None:
            self.buckets.pop(key_id, None)
            return None
        bucket = self.buckets.get(key_id)
        if bucket is None:
            bucket = self.buckets[key_id] = TokenBucket(per_minute, self.clock())
        elif bucket.per_minute != per_minute:
            bucket.resize(per_minute)
        return bucket
