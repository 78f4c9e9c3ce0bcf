"""The TLS certificate each paired node must present, by URL: the panel's known_hosts.

A node's fingerprint is learned at pairing (`services.verify_identity`, bound to the node's
identity proof) and kept in its row; this is the copy every agent client of the panel is built
from, filled when the database is opened and kept in step by `services.py` as nodes are paired,
move or are removed. An HTTPS node with no pin is checked against the system's CAs (or
TANDEM_CA_FILE), so an unknown self-signed certificate is refused, never trusted silently.
"""

from __future__ import annotations

from sqlalchemy import Engine
from sqlmodel import Session, select

from tandem_protocol.client import AgentClient

from .models import Node

_pins: dict[str, str] = {}


def load(engine: Engine) -> None:
    with Session(engine) as s:
        for node in s.exec(select(Node).where(Node.url != "", Node.tls_fingerprint != "")):
            _pins[node.url] = node.tls_fingerprint


def pin(url: str, fingerprint: str) -> None:
    if fingerprint:
        _pins[url] = fingerprint
    else:
        _pins.pop(url, None)


def unpin(url: str) -> None:
    _pins.pop(url, None)


def pinned(url: str) -> str | None:
    return _pins.get(url)


def agent_client(url: str, key: str, **kwargs) -> AgentClient:
    """A client for the agent at `url` that accepts only the certificate pinned for it."""
    return AgentClient(url, key, pin=_pins.get(url.rstrip("/")), **kwargs)
