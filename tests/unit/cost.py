"""What a piece of work costs, for tests that bound it or compare two sizes of it (linear or not):
the calling thread's own CPU time, which the other processes of a loaded machine do not add to
(its wall time did, up to 2-3x), the least of a few runs."""

from __future__ import annotations

import time
from collections.abc import Callable


def cpu_seconds(run: Callable[[], object], times: int = 1) -> float:
    """The least CPU time of `times` runs of `run()`, in seconds."""
    best = float("inf")
    for _ in range(times):
        t0 = time.thread_time()
        run()
        best = min(best, time.thread_time() - t0)
    return best


def cpu_costs(small: Callable[[], object], large: Callable[[], object], times: int = 9) -> tuple[float, float]:
    """The least CPU times of `small()` and `large()`, run in turn `times` times each (in turn, so
    that whatever slows the machine for a while weighs on both)."""
    best_small = best_large = float("inf")
    for _ in range(times):
        best_small = min(best_small, cpu_seconds(small))
        best_large = min(best_large, cpu_seconds(large))
    return best_small, best_large
