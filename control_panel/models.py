"""The panel's state, as SQLModel tables (SQLite). Schema changes go through Alembic migrations."""

from __future__ import annotations

import time

from sqlalchemy import Index, text
from sqlmodel import Field, SQLModel


class Node(SQLModel, table=True):
    """An agent the panel knows, found by mDNS or added by URL: one row per node id (the agent's
    lasting identity), whatever its address. `url` is "" while the node's last address is known
    to be another node's (it gets one again when it proves itself at a new one)."""

    __table_args__ = (
        Index("ix_node_url", "url", unique=True, sqlite_where=text("url != ''")),
        Index("ix_node_node_id", "node_id", unique=True, sqlite_where=text("node_id != ''")),
    )

    id: int | None = Field(default=None, primary_key=True)
    name: str
    url: str
    node_id: str = ""
    source: str = "manual"  # "manual" or "mdns"
    paired: bool = False
    engine: str = ""
    model: str = ""
    contract: str = ""
    last_seen: float | None = None
    last_error: str = ""


class Pair(SQLModel, table=True):
    """A model name on the API: prefill on one node, decode on another."""

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(unique=True, index=True)
    prefill_node_id: int = Field(foreign_key="node.id")
    decode_node_id: int = Field(foreign_key="node.id")
    prefill_engine: str
    decode_engine: str
    prefill_model_path: str
    decode_model_path: str
    context_length: int
    staging_bytes: int = 512 << 20
    decode_kv_bytes: int = 0  # the decode node's KV budget as it reported it (0: not known)
    local_threshold: int = 0  # prompts shorter than this run on the decoder alone
    fallback: str = "decode_alone"  # or "fail"
    page_encoding: str = "raw"  # or "zstd": pages compressed on the wire (lossless), for slow links


class ApiKey(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    name: str
    prefix: str  # shown in the UI so a user can tell keys apart
    key_hash: str = Field(unique=True, index=True)
    created: float = Field(default_factory=time.time)


class RequestLog(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    created: float = Field(default_factory=time.time, index=True)
    model: str
    route: str  # "pd", "decode_alone", "node"
    reason: str = ""
    prompt_tokens: int = 0
    ttft_ms: float | None = None
    output_tokens: int = 0
    bytes_moved: int = 0
    outcome: str = "ok"  # ok, error, cancelled
    error: str = ""


class Setting(SQLModel, table=True):
    key: str = Field(primary_key=True)
    value: str
