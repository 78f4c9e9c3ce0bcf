"""Continuous batching for the in-process engines: every running request's next token in one
forward per turn of the engine thread.

A request that has its first token joins the batch as a `Row` (its session, its last token, its
sampler and stop rules). One step computes the next token of every row with the engine's
`forward_rows` and hands each token to its request's queue; a row that reaches a stop token,
max_tokens or its cancel leaves at that step. Each step is its own task on the engine thread
and the next is queued behind whatever arrived meanwhile (a prompt chunk, a page import), so a
new request's prefill interleaves with the running decodes instead of waiting for them to end,
and a request joins at the next step. Rows are added and removed on the engine thread only, so
the step loop needs no lock; tokens reach the event loop with `call_soon_threadsafe`, and a
request waits for its next token on its own queue (no polling).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tandem_protocol.errors import Cancelled

from .sampler import Sampler


@dataclass(eq=False)
class Row:
    """One request in the batch. `token`: the last token it produced (the next step's input)."""

    request_id: str
    session: Any
    token: int
    sampler: Sampler
    stops: set[int]
    max_tokens: int
    produced: int
    cancelled: threading.Event
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)  # (token, last) or an exception

    def deliver(self, item: tuple[int, bool] | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class DecodeBatch:
    """The running rows of one engine and the step loop that advances them together."""

    def __init__(self, executor: Executor, forward_rows: Callable[[list[Any], list[int]], np.ndarray]):
        self._executor, self._forward_rows = executor, forward_rows
        self.rows: list[Row] = []  # engine thread only
        self._stepping = False  # a step is queued on the engine thread
        self.widest = 0  # the most rows one forward has stepped (tests check that a batch formed)

    # ---- engine thread ------------------------------------------------------------------
    def add(self, row: Row) -> None:
        self.rows.append(row)
        if not self._stepping:
            self._stepping = True
            self._executor.submit(self._step)

    def remove(self, row: Row) -> None:
        if row in self.rows:
            self.rows.remove(row)

    def _step(self) -> None:
        for row in [r for r in self.rows if r.cancelled.is_set()]:
            self.rows.remove(row)
            row.deliver(Cancelled(f"request {row.request_id} was cancelled"))
        rows = list(self.rows)
        if not rows:
            self._stepping = False
            return
        try:
            logits = self._forward_rows([r.session for r in rows], [r.token for r in rows])
        except Exception as e:  # the engine failed: every request in the step reports it
            for row in rows:
                self.rows.remove(row)
                row.deliver(e)
        else:
            self.widest = max(self.widest, len(rows))
            for row, row_logits in zip(rows, logits, strict=True):
                try:
                    token = row.sampler(row_logits)
                except Exception as e:  # this request's sampling failed (its grammar): it alone ends
                    self.rows.remove(row)
                    row.deliver(e)
                    continue
                row.token = token
                row.produced += 1
                last = row.produced >= row.max_tokens or token in row.stops
                if last:
                    self.rows.remove(row)
                row.deliver((token, last))
        try:
            self._executor.submit(self._step)  # behind what was queued meanwhile
        except RuntimeError:  # the engine is closing: its requests end with it
            self._stepping = False
