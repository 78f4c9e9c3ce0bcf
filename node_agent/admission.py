"""Admission on the decoder: a request decodes (or generates) only once its KV fits the node's
decode budget and one of its sequence slots is free.

A request's KV is counted at the model's canonical size (FP16: `page_bytes / page_tokens` a
token) for its prompt plus max_tokens, and reserved before anything is computed — before the
prefiller is asked — until its token stream ends, however it ends. A request that can never fit
is refused at once (400, naming the budget). Otherwise it waits its turn in FIFO order, woken by
the releases of the requests ahead (no polling), at most `wait_timeout` seconds in all; then 429
with Retry-After. The sequence cap bounds how many requests the engine runs at once, which for
torch and MLX is the widest their decode batch gets.
"""

from __future__ import annotations

import asyncio

from tandem_protocol.errors import RequestError

from .budget import Reservation, StagingBudget

MAX_SEQUENCES = 64  # default cap: a household's or an agent's parallel calls; the CPU batch stays fast
WAIT_SECONDS = 30.0  # as the prefiller's staging budget waits


class Ticket:
    """What an admitted request holds; `release` is idempotent."""

    def __init__(self, admission: Admission, sequence: Reservation, kv: Reservation):
        self.admission, self.sequence, self.kv = admission, sequence, kv
        admission.running += 1

    def release(self) -> None:
        if not self.kv.released:
            self.admission.running -= 1
        self.kv.release()
        self.sequence.release()


class Admission:
    def __init__(self, kv_bytes: int, max_sequences: int = MAX_SEQUENCES, wait_timeout: float = WAIT_SECONDS):
        self.kv = StagingBudget(kv_bytes, what="decode KV budget")
        self.sequences = StagingBudget(max_sequences, what="decoder's sequence slots", unit="sequences")
        self.wait_timeout = wait_timeout
        self.running = 0  # admitted and not yet released (a waiter may hold a slot while KV frees)

    def check_fits(self, nbytes: int) -> None:
        if nbytes > self.kv.capacity:
            raise RequestError(
                f"this request needs {nbytes:,} bytes of KV (its prompt plus max_tokens) but the decode "
                f"node's whole KV budget is {self.kv.capacity:,} bytes: lower max_tokens, send a shorter "
                "prompt or raise the node's decode KV budget"
            )

    async def admit(self, nbytes: int) -> Ticket:
        """Wait (FIFO) for a sequence slot and `nbytes` of KV, `wait_timeout` in all."""
        self.check_fits(nbytes)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_timeout
        sequence = await self.sequences.reserve(1, self.wait_timeout)
        try:
            kv = await self.kv.reserve(nbytes, max(0.0, deadline - loop.time()))
        except BaseException:
            sequence.release()
            raise
        return Ticket(self, sequence, kv)

    def resize(self, kv_bytes: int | None = None, max_sequences: int | None = None) -> None:
        if kv_bytes is not None:
            self.kv.resize(kv_bytes)
        if max_sequences is not None:
            self.sequences.resize(max_sequences)

    def status(self) -> dict:
        return {
            "kv_capacity": self.kv.capacity,
            "kv_reserved": self.kv.reserved,
            "max_sequences": self.sequences.capacity,
            "running": self.running,
            "waiting": self.sequences.waiting + self.kv.waiting,
        }
