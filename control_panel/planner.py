"""Choosing, for one request, the nodes of its pool that serve it and the route.

For every feasible route — P/D for each (prefill node, decode node), and each decode node alone
— the planner estimates the time to first token from measured figures (node_figures.py):

    compute(X, new) = X's queue x X's seconds per token + max(new x X's seconds per token,
                      one decode step of X: a forward's floor)
    alone(D)  = compute(D, prompt tokens D does not hold)
    P/D(P, D) = max(compute(P, tokens P does not hold), bytes of the pages D lacks / link rate)
                + 2 round trips + PD_OVERHEAD_SECONDS + D's queue
                + D's decode step if D recomputes the last prompt token (vLLM)

The prompt tokens a node holds come from the router's prefix index (prefix_index.py), so a
conversation's next turn is cheap on the decoder that holds its history; a queue is the new
tokens of the requests a node has not answered yet plus RUNNING_TOKENS for each it is decoding,
so fresh prompts spread over the decoders. The fastest estimate wins; ties go to the node chosen
longest ago. The estimate is the request's predicted TTFT, logged beside the actual one.

Until every node and link of the choice has been measured, or where the pool sets a threshold
(an override), the rule is the older one in token counts: the decoder with the fewest uncached
plus queued tokens, on its own when the new part of the prompt is under the threshold, else with
the prefiller of fewest. A node in both roles never prefills for itself. Nodes that failed are
skipped for DOWN_SECONDS (all of them, if every node did).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from tandem_protocol.pages import PAGE_TOKENS

from .node_figures import NodeFigures
from .prefix_index import PrefixIndex

# A request a node is decoding slows a new one there about as much as this many prompt tokens to
# compute (one more row in every step): a guess, to be replaced by measured step times.
RUNNING_TOKENS = 32
# What P/D adds to P's own prefill besides the link and D's step: the handshake, P's last frame,
# D's import of the last page (bench/results/ttft-loopback-fast-prefiller-184-6000-20261203.md:
# TTFT less P's own prefill +11 to +55 ms on loopback for commit-first decoders).
PD_OVERHEAD_SECONDS = 0.03
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
    predicted_seconds: float | None = None  # estimated TTFT (None: not every figure was measured)


@dataclass(frozen=True)
class Estimate:
    seconds: float
    decode_url: str
    prefill_url: str | None
    how: str  # the terms, for the reason


class Planner:
    def __init__(self, index: PrefixIndex | None = None, figures: NodeFigures | None = None):
        self.index = index or PrefixIndex()
        self.figures = figures or NodeFigures()
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
        decoders, prefillers = self._up(decode_urls), self._up(prefill_urls)
        if not decoders:
            return None
        held = {u: self.index.held_pages(u, hashes) * PAGE_TOKENS for u in (*decoders, *prefillers)}
        if is_node:
            url = decoders[0]
            alone = self._alone(url, held[url], prompt_tokens)
            return self._chose(Plan("node", url, None, held[url], "", alone and alone.seconds))
        if not local_threshold:
            estimates = self._estimates(decoders, prefillers, held, prompt_tokens, name_of)
            if estimates is not None:
                return self._fastest(estimates, held, name_of)
        return self._by_tokens(decoders, prefillers, held, prompt_tokens, local_threshold, name_of)

    # ---- the estimates ----------------------------------------------------------------------
    def _estimates(self, decoders, prefillers, held, n, name_of) -> list[Estimate] | None:
        """Every feasible route's estimate, or None if a figure one needs was never measured."""
        out = []
        for d in decoders:
            out.append(self._alone(d, held[d], n, name_of))
            out += [self._pd(p, d, held[p], held[d], n, name_of) for p in prefillers if p != d]
        return None if any(e is None for e in out) else out

    def _compute(self, url: str, new: int, spt: float) -> float:
        """Seconds for `url` to start and compute `new` prompt tokens."""
        return self.load(url) * spt + max(new * spt, self.figures.step(url) or 0.0)

    def _alone(self, d: str, held_d: int, n: int, name_of: Callable[[str], str] = str) -> Estimate | None:
        spt = self.figures.seconds_per_token(d, n)
        if spt is None:
            return None
        new = max(1, n - held_d)  # the last prompt token is always computed
        seconds = self._compute(d, new, spt)
        return Estimate(seconds, d, None, f"{name_of(d)} alone {seconds:.2f} s ({new} new tokens)")

    def _pd(self, p: str, d: str, held_p: int, held_d: int, n: int, name_of: Callable[[str], str]) -> Estimate | None:
        f = self.figures
        spt_p, spt_d, link, bpt = (
            f.seconds_per_token(p, n),
            f.seconds_per_token(d, n),
            f.link(p, d),
            f.kv_bytes_per_token,
        )
        if spt_p is None or spt_d is None or link is None or bpt is None:
            return None
        new_p = max(1, n - held_p)  # P computes past its own cached prefix
        compute = self._compute(p, new_p, spt_p)
        transfer = max(0, n - held_d) * bpt / link.bytes_per_second  # only the pages D lacks
        # a commit-first decoder streams P's first token once the pages are in; a recompute-last one
        # runs the last prompt token first (one step)
        last = (f.step(d) or 0.0) if f.recomputes_last(d) else 0.0
        d_ready = last + self.load(d) * spt_d
        seconds = max(compute, transfer) + 2 * link.rtt_seconds + PD_OVERHEAD_SECONDS + d_ready
        how = (
            f"{name_of(p)}->{name_of(d)} {seconds:.2f} s (prefill {new_p} tokens {compute:.2f} s, "
            f"link {transfer:.2f} s)"
        )
        return Estimate(seconds, d, p, how)

    def _fastest(self, estimates: list[Estimate], held: dict[str, int], name_of) -> Plan:
        def rank(e: Estimate) -> tuple[float, int]:
            return e.seconds, self._last_chosen.get(e.decode_url, -1)

        ranked = sorted(estimates, key=rank)
        best = ranked[0]
        reason = f"est. {best.how}" + (f"; next {ranked[1].how}" if len(ranked) > 1 else "")
        route = "pd" if best.prefill_url else "decode_alone"
        return self._chose(Plan(route, best.decode_url, best.prefill_url, held[best.decode_url], reason, best.seconds))

    def _chose(self, plan: Plan) -> Plan:
        for u in (plan.decode_url, plan.prefill_url):
            if u:
                self._chosen += 1
                self._last_chosen[u] = self._chosen
        return plan

    # ---- the rule in tokens (figures missing, or a threshold set) ------------------------------
    def _by_tokens(self, decoders, prefillers, held, n, local_threshold, name_of) -> Plan:
        url = self._fewest_tokens(decoders, held, n)
        held_tokens = held[url]
        new = max(1, n - held_tokens)  # the last prompt token is always computed
        where = f"{name_of(url)} holds {held_tokens} of {n} prompt tokens"
        if not prefillers:
            return self._chose(Plan("decode_alone", url, None, held_tokens, f"{where}; no prefill node is left to try"))
        if new < local_threshold:
            return self._chose(Plan("decode_alone", url, None, held_tokens, f"{where}: {new} new, under the threshold"))
        others = tuple(u for u in prefillers if u != url)  # a node in both roles prefills for others
        if not others:
            return self._chose(
                Plan("decode_alone", url, None, held_tokens, f"{where}; it is the pool's only prefill node")
            )
        p_url = self._fewest_tokens(others, held, n)
        if local_threshold:
            where += f", {new} new: not under the threshold"
        else:
            where += "; not every node and link is measured yet"
        return self._chose(Plan("pd", url, p_url, held_tokens, where))

    def _fewest_tokens(self, urls, held: dict[str, int], n: int) -> str:
        def cost(u: str) -> tuple[int, int]:
            return n - held[u] + self.load(u), self._last_chosen.get(u, -1)

        return min(urls, key=cost)

    def _up(self, urls: tuple[str, ...]) -> tuple[str, ...]:
        now = time.monotonic()
        return tuple(u for u in urls if self._down_until.get(u, 0.0) <= now) or urls

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

    def busy(self) -> set[str]:
        """The nodes with requests queued or running."""
        return {u for c in (self.pending, self.running) for u, n in c.items() if n > 0}

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
        self.figures.forget(url)
        self._down_until.pop(url, None)
