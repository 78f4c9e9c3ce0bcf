"""What one panel process holds while it runs, opened once at start and kept on `app.state.panel`;
routes reach it through the dependencies in `deps.py`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import Engine

from tandem_protocol.discovery import Watcher

from . import pins
from .cache_salt import CacheSalts, load_cache_salts
from .db import get_setting, open_db, set_setting
from .i18n import load_all
from .login_limit import LoginLimiter
from .rate_limits import RateLimiter
from .request_log import RequestLogWriter, mark_interrupted
from .router import Router
from .services import note_discovered
from .ui.sessions import UiSessions

SHUTDOWN_GRACE_SECONDS = 5.0  # for cancelled requests to release their agents and log how they ended


@dataclass
class PanelState:
    db: Engine
    router: Router  # routes API requests to the agents, and holds the cluster key
    request_log: RequestLogWriter
    sessions: UiSessions
    login_limiter: LoginLimiter
    watcher: Watcher | None  # agents announcing on the LAN; None without mDNS
    data_dir: Path
    cache_salts: CacheSalts  # each API key's prefix cache namespace, unless the admin shares it
    limits: RateLimiter = field(default_factory=RateLimiter)  # the API keys' requests in flight and tokens
    discovery_error: str | None = None  # why mDNS was asked for and could not start (the panel runs on)

    async def aclose(self) -> None:
        await self.request_log.wait_finished(SHUTDOWN_GRACE_SECONDS)  # before the router's clients close
        if self.watcher is not None:
            await self.watcher.stop()
        await self.router.aclose()
        self.request_log.close()


def open_state(
    data_dir: Path,
    cluster_key: str | None = None,
    mdns: bool = False,
    mdns_interfaces: list[str] | None = None,
    login_limiter: LoginLimiter | None = None,
) -> PanelState:
    """Open the database (migrated), the router and the request log. With `mdns`, a watcher
    (started with the app) adds agents announcing on the LAN, unpaired, as they appear."""
    load_all()  # a broken translation catalog fails the start, not a page
    db = open_db(data_dir / "panel.db")
    if cluster_key:
        set_setting(db, "cluster_key", cluster_key)
    mark_interrupted(db)  # requests that were running when the panel last stopped
    pins.load(db)
    router = Router(get_setting(db, "cluster_key") or "")
    watcher = (
        Watcher(mdns_interfaces, lambda peer, present: note_discovered(db, peer, present, router.cluster_key))
        if mdns
        else None
    )
    return PanelState(
        db=db,
        router=router,
        request_log=RequestLogWriter(db),
        sessions=UiSessions(db),
        login_limiter=login_limiter or LoginLimiter(),
        watcher=watcher,
        data_dir=data_dir,
        cache_salts=load_cache_salts(db),
    )
