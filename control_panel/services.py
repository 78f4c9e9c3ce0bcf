"""What the panel does to its state: add nodes, pair them, remove them."""

from __future__ import annotations

import time

from sqlalchemy import Engine
from sqlmodel import Session, select

from tandem_protocol.client import AgentClient, AgentHTTPError, TransportError
from tandem_protocol.contract import ModelContract
from tandem_protocol.discovery import Peer
from tandem_protocol.pages import ENCODINGS

from .models import Node, Pair


class PanelError(Exception):
    """A user action that cannot be done; the message says why."""

    def __init__(self, message: str, fields: list[str] | None = None):
        super().__init__(message)
        self.fields = fields or []


async def agent_status(url: str, cluster_key: str) -> dict:
    """The agent's /v1/status (its /v1/info plus budget and totals), errors as PanelError."""
    client = AgentClient(url, cluster_key)
    try:
        return await client.status()
    except AgentHTTPError as e:
        if e.status == 401:
            raise PanelError(f"{url} rejected the cluster key") from e
        raise PanelError(f"{url} answered {e.status}: {e}") from e
    except TransportError as e:
        raise PanelError(f"{url} is not reachable ({type(e).__name__})") from e
    finally:
        await client.aclose()


async def add_node(engine: Engine, url: str, cluster_key: str, source: str = "manual") -> Node:
    """Add (or refresh) a node by URL; it is paired once it accepts the cluster key."""
    url = url.rstrip("/")
    info = await agent_status(url, cluster_key)
    with Session(engine) as s:
        node = s.exec(select(Node).where(Node.url == url)).first() or Node(name=info["name"], url=url)
        node.name, node.node_id, node.source, node.paired = info["name"], info["node_id"], source, True
        node.engine, node.model, node.contract = info["engine"], info["model"], info["contract"]["fingerprint"]
        node.last_seen, node.last_error = time.time(), ""
        s.add(node)
        s.commit()
        s.refresh(node)
        return node


async def configure_node(
    url: str,
    cluster_key: str,
    role: str,
    engine: str | None,
    model_path: str | None,
    context_length: int | None,
    staging_bytes: int | None,
    dry_run: bool,
) -> dict:
    """Check (dry_run) or apply one node's part of a pair; returns the contract it would have (or
    has). Errors name the form field at fault (`prefill_model_path`, `decode_engine`, …)."""
    client = AgentClient(url, cluster_key)
    try:
        current = await client.info()
        if not engine and not model_path and context_length is None and staging_bytes is None:
            return current["contract"]  # the node keeps what it runs
        out = await client.configure(
            engine=engine or current["engine"],
            model_path=model_path or current["model_path"],
            context_length=context_length,
            staging_bytes=staging_bytes,
            dry_run=dry_run,
        )
        return out["contract"]
    except AgentHTTPError as e:
        field = e.detail.get("field")
        message = e.detail.get("message") or str(e)
        raise PanelError(f"{role} node: {message}", [f"{role}_{field}"] if field else [role]) from e
    except TransportError as e:
        raise PanelError(f"{role} node {url} is not reachable ({type(e).__name__})", [role]) from e
    finally:
        await client.aclose()


async def create_pair(
    engine: Engine,
    cluster_key: str,
    name: str,
    prefill_url: str,
    decode_url: str,
    local_threshold: int = 0,
    fallback: str = "decode_alone",
    page_encoding: str = "raw",
    *,
    prefill_engine: str | None = None,
    prefill_model_path: str | None = None,
    decode_engine: str | None = None,
    decode_model_path: str | None = None,
    context_length: int | None = None,
    staging_bytes: int | None = None,
) -> Pair:
    """Pair two nodes under a model name: check both nodes' engine and model path, switch them
    if asked, then check that their contracts agree. Blank engine/path: what the node runs."""
    if not name or "/" in name:
        raise PanelError("a pair needs a name without '/' (it becomes the model name on the API)", ["name"])
    if page_encoding not in ENCODINGS:
        raise PanelError(f"unknown page encoding {page_encoding!r} ({' or '.join(ENCODINGS)})", ["page_encoding"])
    nodes = [
        ("prefill", prefill_url, prefill_engine, prefill_model_path, staging_bytes),
        ("decode", decode_url, decode_engine, decode_model_path, None),
    ]
    for dry_run in (True, False):  # check both nodes, and their contracts, before either loads anything
        p_contract, d_contract = [
            await configure_node(url, cluster_key, role, eng, path, context_length, staging, dry_run)
            for role, url, eng, path, staging in nodes
        ]
        # names every differing field (weights, tokenizer, config, context_length, geometry)
        ModelContract.from_dict(d_contract).check_same(ModelContract.from_dict(p_contract))
    p_info, d_info = await agent_status(prefill_url, cluster_key), await agent_status(decode_url, cluster_key)
    p_node = await add_node(engine, prefill_url, cluster_key)
    d_node = await add_node(engine, decode_url, cluster_key)
    with Session(engine) as s:
        pair = s.exec(select(Pair).where(Pair.name == name)).first() or Pair(
            name=name,
            prefill_node_id=p_node.id,
            decode_node_id=d_node.id,
            prefill_engine="",
            decode_engine="",
            prefill_model_path="",
            decode_model_path="",
            context_length=0,
        )
        pair.prefill_node_id, pair.decode_node_id = p_node.id, d_node.id
        pair.prefill_engine, pair.decode_engine = p_info["engine"], d_info["engine"]
        pair.prefill_model_path, pair.decode_model_path = p_info["model_path"], d_info["model_path"]
        pair.context_length = d_info["context_length"]
        pair.staging_bytes = p_info["budget"]["capacity"]
        pair.local_threshold, pair.fallback, pair.page_encoding = local_threshold, fallback, page_encoding
        s.add(pair)
        s.commit()
        s.refresh(pair)
        return pair


def note_discovered(engine: Engine, peer: Peer, present: bool) -> None:
    """Record an agent that appeared on (or withdrew from) the LAN. A new one is added unpaired:
    the panel sends it nothing, the cluster key least of all, until the user pairs it. mDNS is
    unauthenticated, so an announcement never changes the address of a node already known."""
    url, node_id = peer.url.rstrip("/"), peer.properties.get("node_id", "")
    if not url:
        return
    with Session(engine) as s:
        node = s.exec(select(Node).where(Node.url == url)).first()
        if not present:
            if node is not None and node.source == "mdns":
                node.last_error = "withdrawn: the agent stopped announcing itself on the network"
                s.add(node)
                s.commit()
            return
        if node is None:
            node = Node(
                name=peer.properties.get("name") or peer.service.split(".")[0],
                url=url,
                source="mdns",
                paired=False,
                node_id=node_id,
            )
        if not node.paired:  # a paired node's facts come from its authenticated /v1/status
            node.engine, node.model = peer.properties.get("engine", ""), peer.properties.get("model", "")
            node.contract, node.last_error = peer.properties.get("contract", ""), ""
        node.last_seen = time.time()
        s.add(node)
        s.commit()


def remove_node(engine: Engine, node_id: int) -> tuple[str, list[str]] | None:
    """Forget a node, and every pair that uses it (a pair without one of its nodes cannot serve):
    returns the node's URL and the names of the pairs removed with it; None if there is no such
    node. The agent itself is not told: it keeps running, and can be added or paired again."""
    with Session(engine) as s:
        node = s.get(Node, node_id)
        if node is None:
            return None
        url = node.url
        uses = (Pair.prefill_node_id == node_id) | (Pair.decode_node_id == node_id)
        pairs = list(s.exec(select(Pair).where(uses).order_by(Pair.name)))
        names = [p.name for p in pairs]
        for pair in pairs:
            s.delete(pair)
        s.flush()  # the pairs' foreign keys go before the node they point at
        s.delete(node)
        s.commit()
    return url, names


def model_names(engine: Engine) -> list[str]:
    """The model names the API serves: every pair, and every paired node as `node/<name>`."""
    with Session(engine) as s:
        names = [p.name for p in s.exec(select(Pair).order_by(Pair.name))]
        names += [f"node/{n.name}" for n in s.exec(select(Node).where(Node.paired == True).order_by(Node.name))]  # noqa: E712
    return names


def delete_row(engine: Engine, table: type, row_id: int) -> None:
    with Session(engine) as s:
        row = s.get(table, row_id)
        if row is not None:
            s.delete(row)
            s.commit()
