"""The Nodes page: every paired agent with its live status, adding one by URL, removing one.

Agents found on the LAN but not paired yet have their own section (`discovered.py`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated
from urllib.parse import urlsplit

from fastapi import APIRouter, Form
from fastapi.responses import RedirectResponse
from sqlalchemy import Engine
from sqlmodel import Session, select

from tandem_protocol.settings import AGENT_PORT

from ..deps import SIGNED_IN, AgentRouter, CsrfForm, Db, Panel, Render, Tr
from ..models import Node, Pool, PoolMember
from ..services import PanelError, add_node, remove_node
from . import node_status
from .discovered import discovered_rows, ignored_count
from .render import HEALTH

router = APIRouter(include_in_schema=False, dependencies=SIGNED_IN)


def models_by_node(db: Engine) -> dict[int, list[str]]:
    """Node id -> the names of the models (pools) it serves in."""
    uses: dict[int, list[str]] = {}
    with Session(db) as s:
        for member, pool in s.exec(select(PoolMember, Pool).join(Pool).order_by(Pool.name)):
            names = uses.setdefault(member.node_id, [])
            if pool.name not in names:
                names.append(pool.name)
    return uses


def note_health(db: Engine, nodes: list[Node], results: list[dict]) -> None:
    """Keep what the probes found: the last time each node answered, or why it did not."""
    now = time.time()
    with Session(db) as s:
        for n, r in zip(nodes, results):
            row = s.get(Node, n.id)
            if row is not None:
                row.last_error = "" if r["health"] == "ok" else f"{r['health']}: {r['detail']}"[:500]
                if r["health"] == "ok":
                    row.last_seen = now
                s.add(row)
        s.commit()


def percent(part: int, whole: int) -> int:
    return round(100 * part / whole) if whole else 0


def decoding(status: dict) -> dict | None:
    """The decoder's admission: requests running and waiting, KV reserved of its budget; None
    from an agent that does not report it (one older than decoder admission)."""
    decode = status.get("decode")
    if not decode:
        return None
    cap, reserved = decode.get("kv_capacity") or 0, decode.get("kv_reserved") or 0
    return {
        "running": decode.get("running", 0),
        "waiting": decode.get("waiting", 0),
        "kv_capacity": cap,
        "kv_reserved": reserved,
        "percent": percent(reserved, cap),
    }


def prefix_caching(status: dict) -> dict | None:
    """The engine's prefix cache: bytes held of its capacity, and the share of the prompt tokens
    looked up in it that it served (None before any lookup); None from an engine that keeps no
    prefix cache, or from an agent that does not report one (one older than prefix caches)."""
    cache = status.get("prefix_cache")
    if not cache:
        return None
    cap, held = cache.get("capacity") or 0, cache.get("bytes") or 0
    looked_up, hit = cache.get("lookup_tokens") or 0, cache.get("hit_tokens") or 0
    return {
        "capacity": cap,
        "bytes": held,
        "percent": percent(held, cap),
        "lookup_tokens": looked_up,
        "hit_tokens": hit,
        "reused": percent(hit, looked_up) if looked_up else None,
    }


def table_row(node: Node, probed: dict, models: list[str]) -> dict:
    st = probed.get("status") or {}
    budget = st.get("budget") or {}
    cap, reserved = budget.get("capacity") or 0, budget.get("reserved") or 0
    return {
        "node": node,
        "health": probed["health"],
        "detail": probed["detail"],
        "status": st,
        "engine": st.get("engine") or node.engine,
        "model": st.get("model") or node.model,
        "accelerator": st.get("accelerator") or {},
        "contract": ((st.get("contract") or {}).get("fingerprint") or node.contract)[:12],
        "budget": {
            "capacity": cap,
            "reserved": reserved,
            "waiting": budget.get("waiting", 0),
            "percent": percent(reserved, cap),
        },
        "decode": decoding(st),
        "prefix_cache": prefix_caching(st),
        "open_handoffs": st.get("open_handoffs"),
        "totals": st.get("totals") or {},
        "models": models,
    }


async def node_rows(db: Engine, cluster_key: str) -> list[dict]:
    """The paired nodes, each probed now (all at once) for its live status."""
    with Session(db) as s:
        nodes = list(s.exec(select(Node).where(Node.paired == True).order_by(Node.name)))  # noqa: E712
    results = await asyncio.gather(*(node_status.probe(n.url, cluster_key) for n in nodes))
    note_health(db, nodes, results)
    uses = models_by_node(db)
    return [table_row(n, r, uses.get(n.id, [])) for n, r in zip(nodes, results)]


async def nodes_page_context(panel: Panel, **extra) -> dict:
    return {
        "rows": await node_rows(panel.db, panel.router.cluster_key),
        "discovered": discovered_rows(panel),
        "ignored": ignored_count(panel),
        "mdns": panel.watcher is not None,
        "error": None,
        "url_value": "",
        **extra,
    }


@router.get("/nodes")
async def nodes_page(panel: Panel, render: Render):
    return render("nodes.html", **(await nodes_page_context(panel)))


@router.get("/nodes/table")
async def nodes_table(db: Db, agents: AgentRouter, render: Render):
    """The table alone: htmx swaps it in every few seconds."""
    return render("_nodes_table.html", rows=await node_rows(db, agents.cluster_key))


@router.post("/nodes")
async def nodes_add(_csrf: CsrfForm, panel: Panel, render: Render, t: Tr, url: Annotated[str, Form()] = ""):
    _ = t.gettext
    url, key = agent_url(url), panel.router.cluster_key
    error = None
    if not url:
        error = _("Give the agent's URL, for example https://192.168.1.20:7411")
    else:
        url, probed = await prove_either_scheme(url, key)
        if probed["health"] != "ok":
            error = _("Could not add %(url)s: %(reason)s", url=url, reason=_(HEALTH[probed["health"]]))
            error += f" ({probed['detail']})" if probed["detail"] else ""
        else:
            try:
                await add_node(panel.db, url, key)
            except PanelError as e:
                error = _("Could not add %(url)s: %(reason)s", url=url, reason=str(e))
    if error:
        return render("nodes.html", status_code=400, **(await nodes_page_context(panel, error=error, url_value=url)))
    return RedirectResponse("/nodes", status_code=303)


def agent_url(typed: str) -> str:
    """What a user typed as an agent's address, as a URL: `host` or `host:port` is an agent's
    default, HTTPS (on AGENT_PORT unless a port is given); a URL stays as it is. "" if empty."""
    typed = typed.strip().rstrip("/")
    if not typed or typed.startswith(("http://", "https://")):
        return typed
    return f"https://{typed}" if urlsplit(f"//{typed}").port else f"https://{typed}:{AGENT_PORT}"


async def prove_either_scheme(url: str, key: str) -> tuple[str, dict]:
    """probe_proved at `url`; an http:// URL nothing answers is tried again as https:// (an agent
    serves HTTPS unless started with --insecure-http: its TLS port drops a plain request), and
    where that answers, the node is added at the HTTPS address. (url, what the probe found)"""
    probed = await node_status.probe_proved(url, key)
    if probed["health"] == "unreachable" and url.startswith("http://"):
        secure = "https://" + url.removeprefix("http://")
        if (again := await node_status.probe_proved(secure, key))["health"] != "unreachable":
            return secure, again
    return url, probed


@router.post("/nodes/{node_id}/delete")
async def nodes_remove(_csrf: CsrfForm, node_id: int, db: Db, agents: AgentRouter):
    """Remove a node from the panel and its models (the confirmation named them). Removing one that is
    gone already (a second click) is not an error."""
    removed = remove_node(db, node_id)
    if removed is not None:
        agents.forget(removed[0])
    return RedirectResponse("/nodes", status_code=303)
