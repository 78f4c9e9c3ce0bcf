"""What every Tandem process reads from its environment: the data dir, trust, the cluster key.

One `TandemSettings` per process, read at its first use — the start of a command (`tandem agent
serve`, `tandem panel`, …) — never at import, and kept for the life of the process; a test that
changes the environment calls `settings.cache_clear()`. Settings of one kind of process live with
it (the engines': `engine_adapters/settings.py`). `env_table` lists every variable for the README
and `tandem agent doctor`.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import TypeVar

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from .errors import TandemError

ENV_PREFIX = "TANDEM_"
AGENT_PORT = 7411  # where an agent listens unless told (`tandem agent serve --port`)
S = TypeVar("S", bound=BaseSettings)


class SettingsError(TandemError):
    """An environment variable with a value its setting cannot take."""


class TandemSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_ignore_empty=True, extra="ignore")

    home: Path = Field(
        Path("~/.local/share/tandem"),
        description="data dir: node identity, cluster key, models, the panel's database",
    )
    ca_file: Path | None = Field(None, description="CA certificate that agents' HTTPS certificates are checked against")
    cluster_key: str | None = Field(
        None, description="the cluster key (default: the key file in the data dir, created on first use)"
    )
    allowed_hosts: str = Field(
        "",
        description="more names (comma-separated) the panel and agents answer to, beside IP addresses, "
        "localhost and this machine's own names",
    )

    @property
    def data_dir(self) -> Path:
        """The data dir, created private (0700); one made open by an older Tandem is closed."""
        path = self.home.expanduser()
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        if path.stat().st_mode & 0o077 and path.stat().st_uid == os.getuid():
            path.chmod(0o700)
        return path


def load(cls: type[S]) -> S:
    """Read the settings `cls` from the environment; SettingsError names each bad variable."""
    try:
        return cls()
    except ValidationError as e:
        raise SettingsError(explain(e)) from None


@functools.cache
def settings() -> TandemSettings:
    """This process's settings (read from the environment on the first call)."""
    return load(TandemSettings)


def data_dir() -> Path:
    """Where this node keeps its state: `$TANDEM_HOME`, default `~/.local/share/tandem`."""
    return settings().data_dir


def hash_cache_path() -> Path:
    return data_dir() / "cache" / "file-hashes.json"


def explain(error: ValidationError) -> str:
    """A settings error as a user reads it: each variable, the value it had and what is wrong."""
    problems = [
        f"{ENV_PREFIX}{'_'.join(map(str, e['loc'])).upper()}={e.get('input')!r}: {e['msg']}" for e in error.errors()
    ]
    return "bad environment variable" + ("s" if len(problems) > 1 else "") + ": " + "; ".join(problems)


def env_table(model: type[BaseSettings]) -> list[tuple[str, str, str]]:
    """(variable, default, meaning) of each field of a settings class, as the README lists them."""
    prefix = model.model_config.get("env_prefix", "")
    rows = []
    for name, field in model.model_fields.items():
        default = "" if field.default is None else str(field.default)
        rows.append(((prefix + name).upper(), default, field.description or ""))
    return rows
