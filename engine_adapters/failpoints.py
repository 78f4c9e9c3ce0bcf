"""Failpoints: make a named step fail or misbehave on purpose, for fault drills and tests.

    TANDEM_FAILPOINTS="prefill_chunk@2"              # the 2nd prefill chunk this process computes raises
    TANDEM_FAILPOINTS="perturb_k@1,perturb_k@2"      # the first two handoffs send wrong K
    TANDEM_FAILPOINTS="slow_prefill_chunk@1"         # the first prefill chunk takes 8 s longer

Each `name@N` fires once, on the N-th time the step is reached in this process (repeat a name to
fire it more than once); everything else runs normally, so a drill sees the fault and then the
recovery. Unset (the normal case), a check is one dictionary lookup. Points:

- `prefill_chunk` (before each chunk's forward pass, any prefill): raises the error an engine
  crash would give (a RuntimeError from inside the model call).
- `slow_prefill_chunk` (before each chunk's forward pass, any in-process prefill): waits
  SLOW_CHUNK_SECONDS first, without blocking the agent, as a server engine's long chunk would.
- `perturb_k` (once per handoff, on the prefiller, before its pages are framed): every page of
  that handoff goes out with K of one layer negated (`perturb_k`). The frames are valid, so a
  decoder accepts them: the tests use it to prove each decoder computes with the pages it is sent.
"""

from __future__ import annotations

import asyncio
import os
import threading

from tandem_protocol.pages import KVPage

SLOW_CHUNK_SECONDS = 8.0

# of the layers tried (0, 1, 15, 29 of SmolLM2-135M), negating layer 1's K moved the next token's
# log-probabilities most
PERTURBED_LAYER = 1


class InjectedFault(RuntimeError):
    """What a failpoint raises: an engine failure, as far as everything above it can tell."""


def _parse(spec: str) -> dict[str, set[int]]:
    points: dict[str, set[int]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, nth = item.partition("@")
        if not nth.isdigit() or int(nth) < 1:
            raise ValueError(f"TANDEM_FAILPOINTS: {item!r} is not name@N (N >= 1)")
        points.setdefault(name, set()).add(int(nth))
    return points


_armed = _parse(os.environ.get("TANDEM_FAILPOINTS", ""))
_seen: dict[str, int] = {}
_lock = threading.Lock()


def fires(name: str) -> bool:
    """Called at a step: whether this is an armed N-th time."""
    if name not in _armed:
        return False
    with _lock:
        _seen[name] = _seen.get(name, 0) + 1
        return _seen[name] in _armed[name]


def reach(name: str) -> None:
    """Called at a step: raises InjectedFault when this is an armed N-th time."""
    if fires(name):
        raise InjectedFault(f"engine failure injected at {name} #{_seen[name]} (TANDEM_FAILPOINTS)")


async def pause(name: str) -> None:
    """Called at a step: waits SLOW_CHUNK_SECONDS when this is an armed N-th time."""
    if fires(name):
        await asyncio.sleep(SLOW_CHUNK_SECONDS)


def perturb_k(page: KVPage) -> KVPage:
    """A copy of `page` with K of PERTURBED_LAYER negated (the engine's own buffer is left alone).
    Only the valid tokens: the zeros past them would become -0.0, which a receiver refuses."""
    data, n = page.data.copy(), page.valid_tokens
    data[PERTURBED_LAYER, 0, :n] = -data[PERTURBED_LAYER, 0, :n]
    return KVPage(page.index, page.valid_tokens, data)
