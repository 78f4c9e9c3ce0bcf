"""Failpoints: make a named step of the engine fail on purpose, for fault drills and tests.

    TANDEM_FAILPOINTS="prefill_chunk@2"   # the 2nd prefill chunk this process computes raises

Each `name@N` fires once, on the N-th time the step is reached in this process, with the error an
engine crash would give (a RuntimeError from inside the model call); everything after that runs
normally, so a drill sees a crash and then the recovery. Unset (the normal case), a check is one
dictionary lookup. Points: `prefill_chunk` (before each chunk's forward pass, any prefill).
"""

from __future__ import annotations

import os
import threading


class InjectedFault(RuntimeError):
    """What a failpoint raises: an engine failure, as far as everything above it can tell."""


def _parse(spec: str) -> dict[str, int]:
    points = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, nth = item.partition("@")
        if not nth.isdigit() or int(nth) < 1:
            raise ValueError(f"TANDEM_FAILPOINTS: {item!r} is not name@N (N >= 1)")
        points[name] = int(nth)
    return points


_armed = _parse(os.environ.get("TANDEM_FAILPOINTS", ""))
_seen: dict[str, int] = {}
_lock = threading.Lock()


def reach(name: str) -> None:
    """Called at a step: raises InjectedFault when this is the armed N-th time."""
    if name not in _armed:
        return
    with _lock:
        _seen[name] = _seen.get(name, 0) + 1
        if _seen[name] != _armed[name]:
            return
    raise InjectedFault(f"engine failure injected at {name} #{_armed[name]} (TANDEM_FAILPOINTS)")
