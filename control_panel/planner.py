"""Choosing, for one request, the nodes of its pool that serve it.

A pool has decode nodes and (usually) prefill nodes. The planner picks the decoder that would
start answering soonest by a simple cost in prompt tokens: the tokens this request would have to
move or compute there (the prompt less the pages the node holds, from the router's prefix index)
plus the node's queue: the new tokens of the requests it has not yet answered the first token of,
and RUNNING_TOKENS for each request it is decoding. So a conversation stays on the decoder that
holds its history (its next turn costs a few dozen tokens there, its whole history elsewhere)
unless that decoder is busy with more than the history's worth of prompts, and fresh prompts
spread over the decoders. The prefiller is chosen the same way. A prompt whose new part (past
what the decoder holds) is under the pool's threshold runs on the decoder alone. Nodes that failed
are skipped for DOWN_SECONDS (all of them, if every node did).

It does not yet estimate time from measured prefill rates, link rates and step times (issue 20's
planner): every node's token counts the same.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from tandem_protocol.pages import PAGE_TOKENS

from .prefix_index import PrefixIndex

# A request a node is decoding slows a new one there about as much as this many prompt tokens to
# compute (one more row in every step): a guess, to be replaced by measured step times.
RUNNING_TOKENS = 32
# A node that failed is not chosen again for this long unless no other can serve.
DOWN_SECONDS = 30.0


@dataclass
class Work:
    """A request's share of its nodes' queues, from its start until its end."""

    urls: tuple[str, ...]
    tokens: int  # the new tokens it moves or computes
    answering: bool = False  # past its first token


@dataclass(frozen=True)
class Plan:
    route: str  # "pd", "decode_alone", "node"
    decode_url: str
    prefill_url: str | None
    held_tokens: int  # prompt tokens the decoder holds, as the index believes
    reason: str


class Planner:
    def __init__(self, index: PrefixIndex | None = None):
        self.index = index or PrefixIndex()
        self.pending: Counter[str] = Counter()  # new tokens of requests before their first token
        self.running: Counter[str] = Counter()  # requests past their first token
        self._down_until: dict[str, float] = {}
        self._chosen = 0
        self._last_chosen: dict[str, int] = {}  # breaks ties: the node chosen longest ago

    def plan(
        self,
        decode_urls: tuple[str, ...],
        prefill_urls: tuple[str, ...],
        hashes: list[bytes],
        prompt_tokens: int,
        local_threshold: int = 0,
        is_node: bool = False,
        name_of: Callable[[str], str] = str,
    ) -> Plan | None:
        """The route for a prompt of `prompt_tokens` tokens whose full pages hash to `hashes`;
        None when no decoder is left to try. `name_of`: a node's name for the reason, by URL."""
        decoder = self._pick(decode_urls, hashes, prompt_tokens)
        if decoder is None:
            return None
        url, held = decoder
        held_tokens = held * PAGE_TOKENS
        if is_node:
            return Plan("node", url, None, held_tokens, "")
        new = prompt_tokens - held_tokens
        where = f"{name_of(url)} holds {held_tokens} of {prompt_tokens} prompt tokens"
        if not prefill_urls:
            return Plan("decode_alone", url, None, held_tokens, f"{where}; no prefill node is left to try")
        if new < local_threshold:
            return Plan("decode_alone", url, None, held_tokens, f"{where}: {new} new, under the threshold")
        others = tuple(u for u in prefill_urls if u != url)  # a node in both roles prefills for others
        if not others:
            return Plan("decode_alone", url, None, held_tokens, f"{where}; it is the pool's only prefill node")
        p_url = self._pick(others, hashes, prompt_tokens)[0]
        return Plan("pd", url, p_url, held_tokens, where)

    def _pick(self, urls: tuple[str, ...], hashes: list[bytes], prompt_tokens: int) -> tuple[str, int] | None:
        if not urls:
            return None
        now = time.monotonic()
        up = [u for u in urls if self._down_until.get(u, 0.0) <= now] or list(urls)
        held = {u: self.index.held_pages(u, hashes) for u in up}

        def cost(u: str) -> tuple[int, int]:
            uncached = prompt_tokens - held[u] * PAGE_TOKENS
            return uncached + self.load(u), self._last_chosen.get(u, -1)

        best = min(up, key=cost)
        self._chosen += 1
        self._last_chosen[best] = self._chosen
        return best, held[best]

    def load(self, url: str) -> int:
        """The node's queue, in prompt tokens."""
        return self.pending[url] + RUNNING_TOKENS * self.running[url]

    def started(self, plan: Plan, prompt_tokens: int) -> Work:
        work = Work(tuple(u for u in (plan.decode_url, plan.prefill_url) if u), prompt_tokens - plan.held_tokens)
        for u in work.urls:
            self.pending[u] += work.tokens
        return work

    def first_token(self, work: Work) -> None:
        if not work.answering:
            work.answering = True
            for u in work.urls:
                self.pending[u] -= work.tokens
                self.running[u] += 1

    def ended(self, work: Work) -> None:
        for u in work.urls:
            counter, n = (self.running, 1) if work.answering else (self.pending, work.tokens)
            counter[u] -= n
            if counter[u] <= 0:
                del counter[u]

    def failed(self, url: str) -> None:
        """The node could not serve: skip it for a while."""
        self._down_until[url] = time.monotonic() + DOWN_SECONDS

    def served(self, url: str) -> None:
        self._down_until.pop(url, None)

    def forget(self, url: str) -> None:
        self.index.forget(url)
        self._down_until.pop(url, None)
