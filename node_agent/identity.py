"""A node's lasting identity in its data dir: a stable node id and the cluster key.

Every agent has its own node id, kept per agent name in `$TANDEM_HOME/node-ids/<name>` (or a file
given with `--node-id-file`), so agents that share a data dir (and its models and key) are still
different nodes, and one agent keeps its id across restarts whatever port it gets. A running agent
holds a lock on its id file: a second agent with the same name and data dir is refused instead of
passing for the first. The single `node-id` file of older versions is taken over, once, by the
first agent started.

The cluster key is shared by every agent of a cluster (and given to the panel when pairing):
agents use it both to accept requests and to pull pages from each other. It is generated on
first start unless one is given, and kept in a file only its owner can read. It must be
recoverable (`tandem agent key` shows it), so it is stored as is, not hashed.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import secrets
import uuid
from pathlib import Path
from typing import IO

from tandem_protocol.settings import data_dir, settings
from tandem_protocol.tls import certificate_fingerprint


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


def node_id_path(name: str, home: Path | None = None) -> Path:
    """Where the agent called `name` keeps its id (a name unsafe as a file name gets a digest)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:64].lstrip(".") or "agent"
    if safe != name:  # "a b" and "a_b" must not share a file
        safe += "-" + hashlib.sha256(name.encode()).hexdigest()[:8]
    return (home or data_dir()) / "node-ids" / safe


class NodeIdInUse(RuntimeError):
    pass


def claim_node_id(path: Path, home: Path | None = None) -> tuple[str, IO]:
    """The id kept at `path` (created on first use), and the open, locked file that keeps another
    agent from claiming it too: hold it for as long as the agent runs (the lock goes with the
    process)."""
    legacy = (home or data_dir()) / "node-id"
    if not path.exists() and legacy.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(legacy, path)  # atomic: of agents starting together, one takes it over
        except FileNotFoundError:
            pass
    value = _read_or_create(path, lambda: uuid.uuid4().hex)
    lock = open(path)  # noqa: SIM115 -- held open by the caller for the agent's lifetime
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise NodeIdInUse(
            f"another agent runs with the node id in {path}: give this one another --name "
            "(or its own --node-id-file or TANDEM_HOME)"
        ) from None
    return value, lock


def known_node_ids(home: Path | None = None) -> dict[str, str]:
    """The node ids kept in a data dir, by file name (what `tandem agent doctor` shows)."""
    folder = (home or data_dir()) / "node-ids"
    return {p.name: p.read_text().strip() for p in sorted(folder.glob("*"))} if folder.is_dir() else {}


def tls_dir(home: Path | None = None) -> Path:
    """Where each agent keeps its TLS certificate and key, by node id (tandem_protocol/tls.py)."""
    return (home or data_dir()) / "tls"


def known_certificates(home: Path | None = None) -> dict[str, str]:
    """The TLS certificate fingerprint of each agent of a data dir that has one, by agent name:
    what a user compares with the fingerprint a panel shows when pairing."""
    folder = tls_dir(home)
    found = {name: folder / f"{node_id}.pem" for name, node_id in known_node_ids(home).items()}
    return {name: certificate_fingerprint(path) for name, path in found.items() if path.is_file()}


def key_path(home: Path | None = None) -> Path:
    return (home or data_dir()) / "cluster-key"


def new_cluster_key() -> str:
    return "tdm_" + secrets.token_urlsafe(32)


def cluster_key(home: Path | None = None) -> str:
    """`$TANDEM_CLUSTER_KEY` if set, else the key file (created on first use)."""
    return settings().cluster_key or _read_or_create(key_path(home), new_cluster_key)


def set_cluster_key(key: str, home: Path | None = None) -> None:
    if len(key) < 16:
        raise ValueError("a cluster key must be at least 16 characters")
    path = key_path(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
