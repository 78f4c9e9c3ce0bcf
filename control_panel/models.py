"""The panel's state, as SQLModel tables (SQLite). Schema changes go through Alembic migrations."""

from __future__ import annotations

import time

from sqlalchemy import Index, UniqueConstraint, text
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
    # SHA-256 of the TLS certificate the node proved at pairing, checked on every connection ("" over plain HTTP)
    tls_fingerprint: str = ""
    ignored: bool = False  # found on the network, and the user chose not to see it (not paired)


class Pool(SQLModel, table=True):
    """A model name on the API, served by any number of nodes with one contract (its members):
    prefill nodes run prompts for the decode nodes, which write the answers. A pair is the
    smallest pool: one prefill node and one decode node."""

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(unique=True, index=True)
    context_length: int
    local_threshold: int = 0  # prompts (less what the decoder holds) shorter than this run on D alone
    fallback: str = "decode_alone"  # or "fail"
    page_encoding: str = "raw"  # or zstd (lossless), fp8 or int8 (lossy): pages.ENCODINGS


class PoolMember(SQLModel, table=True):
    """One node of a pool in one role, with the engine, model path and budget it was set to."""

    __table_args__ = (UniqueConstraint("pool_id", "node_id", "role"),)

    id: int | None = Field(default=None, primary_key=True)
    pool_id: int = Field(foreign_key="pool.id", index=True)
    node_id: int = Field(foreign_key="node.id", index=True)
    role: str  # "prefill" or "decode"
    engine: str
    model_path: str
    # prefill: the node's staging budget; decode: its decode KV budget as it reported it (0: not known)
    budget_bytes: int = 0


class ApiKey(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    name: str
    prefix: str  # shown in the UI so a user can tell keys apart
    key_hash: str = Field(unique=True, index=True)
    created: float = Field(default_factory=time.time)
    # its limits (control_panel/rate_limits.py), None: none
    max_concurrent: int | None = None  # requests in flight at once
    tokens_per_minute: int | None = None  # prompt plus generated tokens


class RequestLog(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    created: float = Field(default_factory=time.time, index=True)
    model: str
    request_id: str = ""  # the `id` of the API's answer (chatcmpl-…, cmpl-…)
    route: str  # "pd", "decode_alone", "node"
    reason: str = ""
    prompt_tokens: int = 0
    ttft_ms: float | None = None
    predicted_ttft_ms: float | None = None  # the planner's estimate when it chose the route
    output_tokens: int = 0
    bytes_moved: int = 0
    cached_tokens: int = 0  # prompt tokens a prefix cache served (D's, or P's if more)
    decode_node: str = ""  # the nodes that served it, by name
    prefill_node: str = ""
    outcome: str = "ok"  # ok, error, cancelled
    error: str = ""


class Setting(SQLModel, table=True):
    key: str = Field(primary_key=True)
    value: str


class StoredResponse(SQLModel, table=True):
    """A /v1/responses answer, kept (unless the request said `store: false`) for a later request's
    `previous_response_id` and for GET /v1/responses/{id}, until it expires or the store's caps
    evict it (control_panel/response_store.py)."""

    # the caps' sums (a key's bytes, all bytes) read this index alone, never the rows
    __table_args__ = (Index("ix_storedresponse_key_size", "key_id", "size"),)

    id: str = Field(primary_key=True)  # resp_…
    # the API key that made it: only that key reads, continues or deletes it (another key is told
    # it does not exist), and revoking the key deletes it
    key_id: int
    created: float = Field(default_factory=time.time)
    expires: float = Field(index=True)
    size: int = 0  # bytes of the two JSON texts below, counted against the store's caps
    conversation: str  # JSON: the chat messages up to and with this answer, its instructions left out
    response: str  # JSON: the response object as it was returned


class UiSession(SQLModel, table=True):
    """A signed-in browser's session, live until it signs out, idles out or the password changes
    (its cookie names it by `sid`: a cookie whose row is gone opens nothing)."""

    sid: str = Field(primary_key=True)
    created: float = Field(default_factory=time.time)
    last_seen: float = Field(default_factory=time.time)
