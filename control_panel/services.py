"""What the panel does to its state: add nodes, pair them, log requests."""

from __future__ import annotations

import time

from sqlalchemy import Engine
from sqlmodel import Session, select

from engine_adapters.contract import ModelContract
from node_agent.client import AgentClient, AgentHTTPError, TransportError

from .models import Node, Pair, RequestLog


class PanelError(Exception):
    """A user action that cannot be done; the message says why."""

    def __init__(self, message: str, fields: list[str] | None = None):
        super().__init__(message)
        self.fields = fields or []


async def agent_info(url: str, cluster_key: str) -> dict:
    client = AgentClient(url, cluster_key)
    try:
        return await client.info()
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
    info = await agent_info(url, cluster_key)
    with Session(engine) as s:
        node = s.exec(select(Node).where(Node.url == url)).first() or Node(name=info["name"], url=url)
        node.name, node.node_id, node.source, node.paired = info["name"], info["node_id"], source, True
        node.engine, node.model, node.contract = info["engine"], info["model"], info["contract"]["fingerprint"]
        node.last_seen, node.last_error = time.time(), ""
        s.add(node)
        s.commit()
        s.refresh(node)
        return node


async def create_pair(engine: Engine, cluster_key: str, name: str, prefill_url: str, decode_url: str,
                      local_threshold: int = 0, fallback: str = "decode_alone") -> Pair:
    """Pair two nodes under a model name, after checking that their contracts agree."""
    if not name or "/" in name:
        raise PanelError("a pair needs a name without '/' (it becomes the model name on the API)", ["name"])
    p_info, d_info = await agent_info(prefill_url, cluster_key), await agent_info(decode_url, cluster_key)
    # names every differing field (weights, tokenizer, config, context_length, geometry)
    ModelContract.from_dict(d_info["contract"]).check_same(ModelContract.from_dict(p_info["contract"]))
    p_node = await add_node(engine, prefill_url, cluster_key)
    d_node = await add_node(engine, decode_url, cluster_key)
    with Session(engine) as s:
        pair = s.exec(select(Pair).where(Pair.name == name)).first() or Pair(
            name=name, prefill_node_id=p_node.id, decode_node_id=d_node.id, prefill_engine="", decode_engine="",
            prefill_model_path="", decode_model_path="", context_length=0)
        pair.prefill_node_id, pair.decode_node_id = p_node.id, d_node.id
        pair.prefill_engine, pair.decode_engine = p_info["engine"], d_info["engine"]
        pair.prefill_model_path, pair.decode_model_path = p_info["model_path"], d_info["model_path"]
        pair.context_length = d_info["context_length"]
        pair.local_threshold, pair.fallback = local_threshold, fallback
        s.add(pair)
        s.commit()
        s.refresh(pair)
        return pair


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


def log_request(engine: Engine, row: RequestLog) -> None:
    with Session(engine) as s:
        s.add(row)
        s.commit()
