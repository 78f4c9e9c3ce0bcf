"""An engine's prefix cache: full KV pages of recent prompts and outputs, kept in host memory in
the canonical page layout, addressed by their hash chain (`tandem_protocol.prefix`), evicted
least recently used within a byte budget.

A request that starts with a cached prefix imports those pages into its session (a copy: ~23 kB
a token for the embedded model, against a forward per token) and computes only the rest.

Eviction removes the ends of chains first: a lookup or an insert marks a chain's pages used from
its last page to its first, so page 0 of a conversation is its most recently used page and a
chain shortens from its tail instead of losing its head (which would strand every page after it).

Not thread-safe: an in-process engine uses it on its engine thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np


class PrefixCache:
    def __init__(self, capacity_bytes: int, page_bytes: int):
        self.capacity, self.page_bytes = capacity_bytes, page_bytes
        self._pages: OrderedDict[bytes, np.ndarray] = OrderedDict()  # least recently used first
        self.lookups = self.lookup_tokens = self.hit_tokens = self.evicted = 0

    @property
    def bytes(self) -> int:
        return len(self._pages) * self.page_bytes

    def __contains__(self, page_hash: bytes) -> bool:
        return page_hash in self._pages

    def match(self, hashes: Sequence[bytes], page_tokens: int) -> list[np.ndarray]:
        """The pages of the longest cached prefix of `hashes` (the chain of the tokens looked up)."""
        found = []
        for h in hashes:
            page = self._pages.get(h)
            if page is None:
                break
            found.append(page)
        self._touch(hashes[: len(found)])
        self.lookups += 1
        self.lookup_tokens += len(hashes) * page_tokens
        self.hit_tokens += len(found) * page_tokens
        return found

    def add(self, hashes: Sequence[bytes], pages: Sequence[np.ndarray], start: int = 0) -> None:
        """Keep `pages`, pages start, start + 1, … of the chain `hashes` (each
        [layers][2][page_tokens][heads][dim] FP16), and mark the whole chain used."""
        for h, page in zip(hashes[start:], pages, strict=True):
            self._pages.setdefault(h, page)
        self._touch(hashes)
        self._evict()

    def resize(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self._evict()

    def clear(self) -> None:
        self._pages.clear()

    def status(self) -> dict:
        return {
            "capacity": self.capacity,
            "bytes": self.bytes,
            "pages": len(self._pages),
            "lookups": self.lookups,
            "lookup_tokens": self.lookup_tokens,
            "hit_tokens": self.hit_tokens,
            "evicted_pages": self.evicted,
        }

    def _touch(self, hashes: Sequence[bytes]) -> None:
        for h in reversed(hashes):
            if h in self._pages:
                self._pages.move_to_end(h)

    def _evict(self) -> None:
        while self._pages and self.bytes > self.capacity:
            self._pages.popitem(last=False)
            self.evicted += 1
