"""The agent's one engine, and replacing it (another engine, model or context length) between requests.

A panel reconfigures a node when a user saves a pair. The slot refuses while the node has work
(open handoffs, active requests, waiting reservations), checks the new model path first, then
closes the old engine before loading the new one (a GPU seldom holds two models), and reloads
the old one if the new one fails to load. While it loads, requests get 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from engine_adapters.base import EngineAdapter
from tandem_protocol.errors import TandemError

log = logging.getLogger("tandem.agent")

Loader = Callable[[str, Path, "int | None"], EngineAdapter]


class EngineBusy(TandemError):
    """The node has work in flight; it cannot switch engines now."""


class EngineLoading(TandemError):
    """The engine is being replaced; try again shortly."""

    retry_after = 5.0


class EngineSlot:
    def __init__(self, adapter: EngineAdapter, loader: Loader | None = None):
        self._adapter: EngineAdapter | None = adapter
        self._loader = loader
        self._lock = asyncio.Lock()
        self.loading: str | None = None  # "engine on model" while a switch is under way
        self.last_error = ""

    @property
    def adapter(self) -> EngineAdapter:
        if self._adapter is None:
            if self.loading is None:  # the new engine and the old one both failed to load
                raise TandemError(f"this node has no engine: {self.last_error}")
            raise EngineLoading(f"this node is loading {self.loading}; try again in a few seconds")
        return self._adapter

    @property
    def ready(self) -> bool:
        return self._adapter is not None

    async def replace(self, engine: str, path: Path, context_length: int, is_idle: Callable[[], bool]) -> bool:
        """Serve `engine` on `path`; False when that is already what runs (nothing reloads)."""
        if self._loader is None:
            raise EngineBusy("this agent was started with a fixed engine and cannot switch")
        async with self._lock:
            old = self.adapter
            if (old.name, old.model_dir.resolve(), old.context_length) == (engine, path, context_length):
                return False
            if not is_idle():
                raise EngineBusy("this node has requests in flight; switch engines when it is idle")
            self.loading = f"{engine} on {path.name}"
            old_spec = (old.name, old.model_dir, old.context_length)
            self._adapter = None
            try:
                await asyncio.to_thread(old.close)
                try:
                    self._adapter = await asyncio.to_thread(self._loader, engine, path, context_length)
                    self.last_error = ""
                except Exception as e:
                    log.warning("loading %s on %s failed (%s); reloading %s", engine, path, e, old_spec[0])
                    self.last_error = f"loading {engine} on {path} failed: {e}"
                    self._adapter = await asyncio.to_thread(self._loader, *old_spec)
                    raise TandemError(
                        self.last_error + f" (the node went back to {old_spec[0]} on {Path(old_spec[1]).name})"
                    ) from e
            finally:
                self.loading = None
            return True
