"""Tandem's vLLM plugin (entry point `vllm.general_plugins: tandem`), run by vLLM in each of its
processes: readers of vLLM's shared-memory message queues wait for a message the way a small
machine needs.

vLLM 0.32's `SpinCondition` makes a reader spin on `sched_yield` for `busy_loop_s` (1 s) after
every message before it sleeps on its notify socket. Steps come far closer together than that,
so the engine core spins for as long as its worker computes, and both spin while a request waits
for its pages (the scheduler steps without work). On a two-core desk machine that is a core taken
from the prefiller beside it: a torch prefill of 2,360 tokens took 45–70 s instead of 10 s with a
vLLM decoder waiting next to it. vLLM has no setting for it yet (vllm-project/vllm#52814 proposes
one); a few milliseconds keep the fast path for messages that follow each other at once.
"""

from __future__ import annotations

import logging

SPIN_SECONDS = 0.002

log = logging.getLogger("vllm.tandem_plugin")


def register() -> None:
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:  # another vLLM: its queues are its own business
        return
    # A class property outranks the attribute each instance sets in __init__, so this holds for
    # queues made before the plugin ran as well as after.
    SpinCondition.busy_loop_s = property(lambda self: SPIN_SECONDS if self.is_reader else 0, lambda self, value: None)
    log.debug("Tandem: vLLM's message-queue readers spin at most %.0f ms", SPIN_SECONDS * 1000)
