"""A node's lasting identity in its data dir: a stable node id and the cluster key.

The cluster key is shared by every agent of a cluster (and given to the panel when pairing):
agents use it both to accept requests and to pull pages from each other. It is generated on
first start unless one is given, and kept in a file only its owner can read. It must be
recoverable (`tandem agent key` shows it), so it is stored as is, not hashed.
"""

from __future__ import annotations

import os
import secrets
import uuid
from pathlib import Path

from tandem_protocol.settings import data_dir, settings


def _read_or_create(path: Path, make) -> str:
    if path.is_file():
        value = path.read_text().strip()
        if value:
            return value
    path.parent.mkdir(parents=True, exist_ok=True)
    value = make()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return value


def node_id(home: Path | None = None) -> str:
    return _read_or_create((home or data_dir()) / "node-id", lambda: uuid.uuid4().hex)


def key_path(home: Path | None = None) -> Path:
    return (home or data_dir()) / "cluster-key"


def cluster_key(home: Path | None = None) -> str:
    """`$TANDEM_CLUSTER_KEY` if set, else the key file (created on first use)."""
    return settings().cluster_key or _read_or_create(key_path(home), lambda: "tdm_" + secrets.token_urlsafe(32))


def set_cluster_key(key: str, home: Path | None = None) -> None:
    if len(key) < 16:
        raise ValueError("a cluster key must be at least 16 characters")
    path = key_path(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
