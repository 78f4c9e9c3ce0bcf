"""The panel's SQLite database: migrations applied on open, sessions for the routes."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine
from sqlmodel import Session, create_engine, select

from .models import Setting

MIGRATIONS = Path(__file__).resolve().parent / "migrations"


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", url)
    return cfg


def open_db(path: Path, revision: str = "head") -> Engine:
    """Open (creating if needed) and migrate the database at `path` to `revision`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    url = f"sqlite:///{path}"
    command.upgrade(alembic_config(url), revision)
    return create_engine(url, connect_args={"check_same_thread": False})


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
