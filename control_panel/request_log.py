"""The request log: every API request is a row from the moment it is routed.

A request is written as "running" when routing starts and updated with its outcome when it ends,
so a request cut off by the panel stopping (a crash, a kill, a power cut) is not lost: the next
start marks such rows "interrupted". Writes go through one thread of their own, in order: the
"running" row is written beside the request's first steps instead of on its path to the first
token, and the final update (waited for, so a client that has its answer finds it logged)
always lands after it.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future, ThreadPoolExecutor

from sqlalchemy import Engine
from sqlmodel import Session, select

from .models import RequestLog

INTERRUPTED = "the panel stopped while this request ran"
# An error is kept (and logged) up to this many characters: every line of ours fits, with a
# server engine's log tail; an agent's error body (64 KiB) or error line (1 MiB) does not.
MAX_ERROR = 4000

log = logging.getLogger("tandem.panel")


def bounded(error: str) -> str:
    """`error` as the request log keeps it: at most MAX_ERROR characters, and how many more there were."""
    if len(error) <= MAX_ERROR:
        return error
    return f"{error[:MAX_ERROR]} … ({len(error) - MAX_ERROR} more characters)"


def save(engine: Engine, row: RequestLog) -> RequestLog:
    """Insert the row, or update it when it has an id; returns it detached, id filled in."""
    row.error = bounded(row.error)
    with Session(engine) as s:
        row = s.merge(row)
        s.commit()
        s.refresh(row)
        s.expunge(row)
    return row


def mark_interrupted(engine: Engine) -> int:
    """Rows still "running" when the panel starts were cut off when it last stopped."""
    with Session(engine) as s:
        rows = s.exec(select(RequestLog).where(RequestLog.outcome == "running")).all()
        for row in rows:
            row.outcome, row.error = "interrupted", INTERRUPTED
            s.add(row)
        s.commit()
        return len(rows)


class RequestLogWriter:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="request-log")
        self._running = 0  # rows started and not yet finished
        self._none_running = asyncio.Event()
        self._none_running.set()

    def start(self, row: RequestLog) -> tuple[RequestLog, Future]:
        """Log a request as running (not waited for); pass what this returns to `finish`."""
        row.outcome = "running"
        self._running += 1
        self._none_running.clear()
        return row, self._writer.submit(save, self.engine, row.model_copy())

    def finish(self, started: tuple[RequestLog, Future], **fields) -> None:
        """Record how the request ended; returns once it is written. A failure goes to the panel's
        log too, as the row keeps it (`bounded`): the API's client is told less (api/errors.py,
        `route_failure`)."""
        if fields.get("outcome") == "error":
            log.warning("API request %s failed: %s", started[0].request_id, bounded(fields.get("error", "")))
        try:
            self._writer.submit(self._finish, started, fields).result()
        except RuntimeError:  # the writer has shut down (a request ending as the panel stops)
            self._finish(started, fields)
        finally:
            self._running -= 1
            if self._running == 0:
                self._none_running.set()

    async def wait_finished(self, timeout: float) -> None:
        """Until every running request has written how it ended, or `timeout`: on shutdown the
        server cancels the requests still streaming, and each needs a moment to let go of its
        agents and log itself as cancelled before the process exits (else the next start would
        call it interrupted)."""
        try:
            await asyncio.wait_for(self._none_running.wait(), timeout)
        except TimeoutError:
            pass  # those left are marked interrupted at the next start

    def _finish(self, started: tuple[RequestLog, Future], fields: dict) -> None:
        row, written = started
        try:
            row = written.result()  # done already: this thread wrote it first
        except Exception:  # the first write failed: write the whole row now
            pass
        for name, value in fields.items():
            setattr(row, name, value)
        save(self.engine, row)

    def close(self) -> None:
        self._writer.shutdown(wait=True)
