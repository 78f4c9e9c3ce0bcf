"""Where a node keeps its state: `$TANDEM_HOME`, default `~/.local/share/tandem`."""

from __future__ import annotations

import os
from pathlib import Path


def data_dir() -> Path:
    path = Path(os.environ.get("TANDEM_HOME") or Path.home() / ".local" / "share" / "tandem").expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def hash_cache_path() -> Path:
    return data_dir() / "cache" / "file-hashes.json"
