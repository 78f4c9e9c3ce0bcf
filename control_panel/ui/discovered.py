"""Agents found on the local network (mDNS) and not paired yet, and pairing one.

The panel's discovery watcher adds every agent that announces itself as an unpaired node
(`services.note_discovered`); the panel sends it nothing, the cluster key least of all, until the
user pairs it here by typing the cluster key (the page shows the certificate the agent presents, to
compare with `tandem agent key` on its machine), and then only once the agent has proved it holds
that key over that very certificate (`node_status.probe_proved`), which the panel then pins.
"""

from __future__ import annotations

import asyncio
from typing import Annotated
from urllib.parse import urlsplit

from fastapi import APIRouter, Form
from fastapi.responses import RedirectResponse
from sqlmodel import Session, select

from tandem_protocol.auth import key_matches
from tandem_protocol.tls import peer_fingerprint, spaced

from ..db import set_setting
from ..deps import SIGNED_IN, CsrfForm, DbSession, Panel, Render, Tr
from ..models import Node
from ..services import PanelError, add_node, ignore_found, show_ignored
from . import node_status
from .render import HEALTH

router = APIRouter(include_in_schema=False, dependencies=SIGNED_IN)


def discovered_rows(panel: Panel) -> list[dict]:
    """The unpaired nodes not ignored, each with whether it is announcing itself right now."""
    announcing = {p.url.rstrip("/") for p in panel.watcher.peers.values()} if panel.watcher else set()
    with Session(panel.db) as s:
        unpaired = select(Node).where(Node.paired == False, Node.ignored == False)  # noqa: E712 (SQL)
        nodes = list(s.exec(unpaired.order_by(Node.name)))
    return [{"node": n, "announcing": n.url in announcing} for n in nodes]


def ignored_count(panel: Panel) -> int:
    with Session(panel.db) as s:
        return len(s.exec(select(Node.id).where(Node.ignored == True)).all())  # noqa: E712 (SQL)


@router.get("/nodes/discovered")
async def discovered_list(panel: Panel, render: Render):
    """The section alone: htmx swaps it in every few seconds."""
    rows, ignored = discovered_rows(panel), ignored_count(panel)
    return render("_discovered.html", discovered=rows, ignored=ignored, mdns=panel.watcher is not None)


@router.post("/nodes/{node_id}/ignore")
async def node_ignore(_csrf: CsrfForm, node_id: int, panel: Panel):
    """Hide an agent found on the network (one the user does not know, or a flood of them)."""
    ignore_found(panel.db, node_id)
    return RedirectResponse("/nodes", status_code=303)


@router.post("/nodes/ignored/show")
async def nodes_show_ignored(_csrf: CsrfForm, panel: Panel):
    show_ignored(panel.db)
    return RedirectResponse("/nodes", status_code=303)


async def presented_fingerprint(url: str) -> str | None:
    """The certificate the agent at `url` presents now, as people compare it (None: plain HTTP, or
    no answer): the user checks it against `tandem agent key` on that machine. Only a handshake."""
    parts = urlsplit(url)
    if parts.scheme != "https":
        return None
    try:
        fp = await asyncio.wait_for(asyncio.to_thread(peer_fingerprint, parts.hostname, parts.port or 443, 3.0), 4.0)
    except (OSError, TimeoutError):  # ssl.SSLError is an OSError
        return None
    return spaced(fp)


def _pair_page(node: Node, fingerprint: str | None, error: str | None = None, status_code: int = 200):
    return {"node": node, "fingerprint": fingerprint, "error": error, "status_code": status_code}


@router.get("/nodes/{node_id}/pair")
async def node_pair_page(node_id: int, s: DbSession, render: Render):
    node = s.get(Node, node_id)
    if node is None:
        return RedirectResponse("/nodes", status_code=303)
    return render("node_pair.html", **_pair_page(node, await presented_fingerprint(node.url)))


async def pair_node(panel: Panel, node: Node, key: str, t: Tr) -> str | None:
    """Pair `node` with the cluster key the user typed: they vouch for the node by knowing it
    (never "blank for the panel's own": that would pair whatever announced itself). None, or why
    it could not be paired."""
    _ = t.gettext
    agents = panel.router
    key = key.strip()
    if not key:
        return _("Enter the cluster key (run `tandem agent key` on the agent's machine).")
    if agents.cluster_key and not key_matches(key, agents.cluster_key):
        return _("This key differs from the panel's cluster key: every node of a panel shares one key.")
    probed = await node_status.probe_proved(node.url, key)  # the typed key too: proved before it is sent
    if probed["health"] != "ok":
        error = _("Could not pair %(name)s: %(reason)s", name=node.name, reason=_(HEALTH[probed["health"]]))
        return error + (f" ({probed['detail']})" if probed["detail"] else "")
    if not agents.cluster_key:  # the first node paired gives the panel its cluster key
        set_setting(panel.db, "cluster_key", key)
        await agents.set_cluster_key(key)
    try:
        await add_node(panel.db, node.url, key, source=node.source)
    except PanelError as e:
        return _("Could not pair %(name)s: %(reason)s", name=node.name, reason=str(e))
    return None


@router.post("/nodes/{node_id}/pair")
async def node_pair(
    _csrf: CsrfForm, node_id: int, panel: Panel, s: DbSession, render: Render, t: Tr, key: Annotated[str, Form()] = ""
):
    """Pair a node found by mDNS: the user vouches for it by giving the cluster key."""
    node = s.get(Node, node_id)
    if node is None:
        return RedirectResponse("/nodes", status_code=303)
    error = await pair_node(panel, node, key, t)
    if error:
        return render("node_pair.html", **_pair_page(node, await presented_fingerprint(node.url), error, 400))
    return RedirectResponse("/nodes", status_code=303)
