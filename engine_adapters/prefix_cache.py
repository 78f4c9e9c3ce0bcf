"""An engine's prefix cache: full KV pages of recent prompts and outputs, kept in host memory in
the canonical page layout, addressed by their hash chain (`tandem_protocol.prefix`), evicted
least recently used within a byte budget.

A request that starts with a cached prefix imports those pages into its session (a copy: ~23 kB
a token for the embedded model, against a forward per token) and computes only the rest.

Beside whole pages it keeps *tails*: the partly filled last page of what a request left (its
prompt and answer), keyed by the chain it follows and its own tokens. The next turn of a
conversation on the same engine takes as many of those tokens as its prompt shares, so it computes
only what is new, not up to 63 tokens more. Tails stay on their engine: a handoff moves whole
pages only (a page is recomputed, never sent half-valid).

Eviction removes the ends of chains first: a lookup or an insert marks a chain's pages used from
its last page to its first, so page 0 of a conversation is its most recently used page and a
chain shortens from its tail instead of losing its head (which would strand every page after it).

Not thread-safe: an in-process engine uses it on its engine thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import xxhash

HASH_BYTES = 16  # a page's hash (xxh3-128); a tail's key is two of them


class PrefixCache:
    def __init__(self, capacity_bytes: int, page_bytes: int):
        self.capacity, self.page_bytes = capacity_bytes, page_bytes
        self._pages: OrderedDict[bytes, np.ndarray] = OrderedDict()  # least recently used first
        # chain end -> tail key (the chain end + a hash of the tail's tokens) -> the tail's tokens
        self._tails: dict[bytes, dict[bytes, tuple[int, ...]]] = {}
        self.lookups = self.lookup_tokens = self.hit_tokens = self.evicted = 0

    @property
    def bytes(self) -> int:
        return len(self._pages) * self.page_bytes

    def __contains__(self, page_hash: bytes) -> bool:
        return page_hash in self._pages

    def match(self, hashes: Sequence[bytes]) -> list[np.ndarray]:
        """The pages of the longest cached prefix of `hashes` (the chain of the tokens looked up)."""
        found = []
        for h in hashes:
            page = self._pages.get(h)
            if page is None:
                break
            found.append(page)
        self._touch(hashes[: len(found)])
        return found

    def add(self, hashes: Sequence[bytes], pages: Sequence[np.ndarray], start: int = 0) -> None:
        """Keep `pages`, pages start, start + 1, … of the chain `hashes` (each
        [layers][2][page_tokens][heads][dim] FP16), and mark the whole chain used."""
        for h, page in zip(hashes[start:], pages, strict=True):
            self._pages.setdefault(h, page)
        self._touch(hashes)
        self._evict()

    def add_tail(self, after: bytes, tokens: Sequence[int], kv: np.ndarray) -> None:
        """Keep `kv` ([layers][2][len(tokens)][heads][dim]) of `tokens`, which follow the chain
        ending in `after` (its last page's hash, or its seed). Stored as the oldest entry of its
        chain: a tail goes before any page it follows."""
        key = after + xxhash.xxh3_128_digest(np.asarray(tokens, dtype="<i8").tobytes())
        if key not in self._pages:
            self._pages[key] = kv
            self._pages.move_to_end(key, last=False)
            self._tails.setdefault(after, {})[key] = tuple(tokens)
        self._evict()

    def match_tail(self, after: bytes, tokens: Sequence[int]) -> tuple[int, np.ndarray | None]:
        """The most tokens of `tokens` a tail after `after` holds from its start, and its KV."""
        best, kv = 0, None
        for key, held in self._tails.get(after, {}).items():
            n = next((i for i, (a, b) in enumerate(zip(held, tokens)) if a != b), min(len(held), len(tokens)))
            if n > best:
                best, kv = n, self._pages[key]
        return best, kv

    def count(self, looked_up: int, found: int) -> None:
        """One request's lookup: the prompt tokens it looked up and how many the cache served."""
        self.lookups += 1
        self.lookup_tokens += looked_up
        self.hit_tokens += found

    def resize(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self._evict()

    def clear(self) -> None:
        self._pages.clear()
        self._tails.clear()

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
            key, _ = self._pages.popitem(last=False)
            if len(key) > HASH_BYTES:  # a tail: its key begins with the chain end it follows
                after = key[:HASH_BYTES]
                del self._tails[after][key]
                if not self._tails[after]:
                    del self._tails[after]
            self.evicted += 1
