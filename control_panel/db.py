"""The panel's SQLite database: migrations applied on open, sessions for the routes."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, event
from sqlmodel import Session, create_engine, select

from .models import ApiKey, Node, Pool, PoolMember, Setting

T = TypeVar("T")

MIGRATIONS = Path(__file__).resolve().parent / "migrations"


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", url)
    return cfg


def open_db(path: Path, revision: str = "head") -> Engine:
    """Open (creating if needed) and migrate the database at `path` to `revision`."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    url = f"sqlite:///{path}"
    command.upgrade(alembic_config(url), revision)
    engine = create_engine(url, connect_args={"check_same_thread": False})
    event.listen(engine, "connect", _fast_commits)
    for f in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        if f.exists():  # it holds the cluster key, the session secret, the password's hash
            f.chmod(0o600)
    return engine


def _fast_commits(dbapi_connection, _record) -> None:
    # Write-ahead log, synced at checkpoints: a commit took ~16 ms here in SQLite's default mode
    # (an fsync per commit) and ~0.8 ms in this one, and every API request writes its log row.
    # A power cut may lose the last commits; an application crash loses nothing.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def get_setting(engine: Engine, key: str, default: str | None = None) -> str | None:
    with Session(engine) as s:
        row = s.get(Setting, key)
        return row.value if row else default


def set_setting(engine: Engine, key: str, value: str) -> None:
    with Session(engine) as s:
        row = s.get(Setting, key) or Setting(key=key, value=value)
        row.value = value
        s.add(row)
        s.commit()


def all_settings(engine: Engine) -> dict[str, str]:
    with Session(engine) as s:
        return {row.key: row.value for row in s.exec(select(Setting))}


# ---- what the API reads on every request, kept in memory --------------------------------------
# Checking the API key and resolving the model name were two SQLite sessions per request (~3 ms
# of a 51-token request's time to first token on this machine). They are cached until a row they
# depend on changes: every commit that adds, changes or deletes an ApiKey, Node or pool (all
# writes happen in the panel's own process) moves `_state_version`, which empties the caches.
_WATCHED = (ApiKey, Node, Pool, PoolMember)
_state_version = 0


@event.listens_for(Session, "after_flush")
def _note_change(session, _context) -> None:
    if any(isinstance(o, _WATCHED) for o in itertools.chain(session.new, session.dirty, session.deleted)):
        session.info["tandem_state_changed"] = True


@event.listens_for(Session, "after_commit")
def _bump_version(session) -> None:
    global _state_version
    if session.info.pop("tandem_state_changed", False):
        _state_version += 1


@event.listens_for(Session, "after_rollback")
def _forget_change(session) -> None:
    session.info.pop("tandem_state_changed", None)


def cached_until_state_changes(fn: Callable[..., T | None]) -> Callable[..., T | None]:
    """Memoize `fn(engine, *args)` while no ApiKey, Node or pool changes. Only found results
    (not None) are kept, so unknown keys or names cannot grow the cache."""
    cache: dict = {}
    seen = [-1]

    @functools.wraps(fn)
    def wrapper(engine: Engine, *args):
        if seen[0] != _state_version:
            cache.clear()
            seen[0] = _state_version
        key = (id(engine), *args)
        if key in cache:
            return cache[key]
        value = fn(engine, *args)
        if value is not None:
            cache[key] = value
        return value

    return wrapper
