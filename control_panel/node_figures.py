"""What the planner knows of each node and each link, measured: the figures it estimates time to
first token from (planner.py).

- prefill: seconds per new prompt token on a node, by prompt length (a node's CPU or GPU costs
  more per token as the context grows), from the requests it served: a decoder alone reports its
  own time to first token, a prefiller its prefill seconds in the P/D answer; and from a short
  calibration prompt the router sends an idle node it has no figure for.
- decode step: seconds between a node's streamed tokens.
- link: bytes per second and round trip from a prefiller to a decoder, measured by the decoder
  pulling synthetic pages from the prefiller (the agents' POST /v1/bench/link), when the pair is
  first used and again every LINK_STALE_SECONDS.
- KV bytes per prompt token of a pool's model, from the page size the link probe reports, and
  whether a decoder recomputes the last prompt token (one step more after its pages), from its
  /v1/info.

Each figure is an exponentially weighted mean (ALPHA) of its observations, so it follows a node
whose load or settings change.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

ALPHA = 0.3  # weight of a new observation
# A prefill of fewer new tokens is mostly a forward's fixed cost (about one decode step, which the
# planner counts as its floor): it says little of the cost per token, so it is not learned from.
MIN_LEARN_TOKENS = 64
LINK_STALE_SECONDS = 600.0  # a link's figure is measured again after this long
CALIBRATION_STALE_SECONDS = 600.0  # a node with no prefill figure is calibrated at most this often


def _mean(old: float | None, new: float) -> float:
    return new if old is None else (1 - ALPHA) * old + ALPHA * new


def length_bucket(tokens: int) -> int:
    """Prompt lengths by powers of two: 1-1, 2-3, 4-7, ..., 2048-4095, ..."""
    return max(0, int(math.log2(max(1, tokens))))


@dataclass
class Link:
    bytes_per_second: float
    rtt_seconds: float
    measured: float = field(default_factory=time.monotonic)


@dataclass
class Node:
    # seconds per new prompt token, by length_bucket of the whole prompt
    prefill: dict[int, float] = field(default_factory=dict)
    step_seconds: float | None = None
    recompute_last: bool | None = None  # a decoder that recomputes the last prompt token (vLLM's way)
    calibrated: float | None = None  # when a calibration prompt was last sent (monotonic)


class NodeFigures:
    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self.links: dict[tuple[str, str], Link] = {}
        self.link_tried: dict[tuple[str, str], float] = {}  # a probe's start (monotonic), failed or not
        self.kv_bytes_per_token: float | None = None  # the pools' pages, as the agents report them

    def node(self, url: str) -> Node:
        return self.nodes.setdefault(url, Node())

    # ---- observations ---------------------------------------------------------------------
    def prefilled(self, url: str, prompt_tokens: int, new_tokens: int, seconds: float) -> None:
        """`url` computed `new_tokens` of a `prompt_tokens`-token prompt in `seconds`."""
        if new_tokens < MIN_LEARN_TOKENS or seconds <= 0:
            return
        n = self.node(url)
        b = length_bucket(prompt_tokens)
        n.prefill[b] = _mean(n.prefill.get(b), seconds / new_tokens)

    def stepped(self, url: str, steps: int, seconds: float) -> None:
        if steps >= 1 and seconds > 0:
            n = self.node(url)
            n.step_seconds = _mean(n.step_seconds, seconds / steps)

    def linked(self, p_url: str, d_url: str, bytes_per_second: float, rtt_seconds: float, page_bytes: int) -> None:
        self.links[(p_url, d_url)] = Link(bytes_per_second, rtt_seconds)
        if page_bytes > 0:
            self.kv_bytes_per_token = page_bytes / 64

    def forget(self, url: str) -> None:
        self.nodes.pop(url, None)
        for table in (self.links, self.link_tried):
            for pair in [k for k in table if url in k]:
                del table[pair]

    # ---- what the planner asks ------------------------------------------------------------
    def seconds_per_token(self, url: str, prompt_tokens: int) -> float | None:
        """The node's prefill seconds per new token at this prompt length: the figure of the
        nearest length it was measured at (None: never measured)."""
        n = self.nodes.get(url)
        if n is None or not n.prefill:
            return None
        b = length_bucket(prompt_tokens)
        nearest = min(n.prefill, key=lambda k: (abs(k - b), -k))
        return n.prefill[nearest]

    def recomputes_last(self, url: str) -> bool:
        n = self.nodes.get(url)
        return bool(n and n.recompute_last)

    def step(self, url: str) -> float | None:
        n = self.nodes.get(url)
        return n.step_seconds if n else None

    def link(self, p_url: str, d_url: str) -> Link | None:
        return self.links.get((p_url, d_url))

    def link_stale(self, p_url: str, d_url: str) -> bool:
        """Due for a probe: never measured or long ago, and not tried lately (a failed probe
        waits as long as a measured one)."""
        now, link = time.monotonic(), self.links.get((p_url, d_url))
        if link is not None and now - link.measured <= LINK_STALE_SECONDS:
            return False
        tried = self.link_tried.get((p_url, d_url))
        return tried is None or now - tried > LINK_STALE_SECONDS

    def needs_calibration(self, url: str) -> bool:
        n = self.node(url)
        return not n.prefill and (n.calibrated is None or time.monotonic() - n.calibrated > CALIBRATION_STALE_SECONDS)
