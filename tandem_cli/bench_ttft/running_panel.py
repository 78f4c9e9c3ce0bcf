"""`tandem bench ttft --panel URL`: the models of a panel that is already running (on the panel's
machine: its pairs and paired nodes come from its database); nothing is started or pinned to CPUs.

The benchmark sends the nodes this machine's cluster key, so it trusts them as the panel does: an
HTTPS node only with the certificate the panel pinned for it at pairing, checked in the TLS
handshake before anything is sent; a plain HTTP node only when told `--insecure-http`.

The link term of each pair comes from its decoder pulling synthetic pages from its prefiller
(POST /v1/bench/link): the product's page stream, not a raw TCP copy, which would need a program
on both machines (on a LAN-speed link the two agree: issue 7's G3); the bytes of each request
over that measured rate."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import typer

from .cluster import Agent
from .measure import Column, measure
from .probe_agents import decode_step_seconds


def bench_running_panel(
    result: dict,
    panel: str,
    api_key: str,
    panel_dir: Path,
    models: str | None,
    save: Callable[[], object],
    insecure_http: bool = False,
) -> None:
    from sqlmodel import Session, create_engine, select

    from control_panel.models import Node, Pool, PoolMember
    from node_agent.identity import cluster_key

    db = panel_dir / "panel.db"
    if not db.exists():
        raise typer.BadParameter(f"no panel database at {db}: run this on the panel's machine or give --panel-dir")
    with Session(create_engine(f"sqlite:///{db}")) as s:
        nodes = {n.id: n for n in s.exec(select(Node))}
        members = list(s.exec(select(PoolMember, Pool).join(Pool).order_by(Pool.name, PoolMember.id)))
    # Each pool's P/D routes: the pool's name, or "name P->D" for each route of a larger pool.
    pools: dict[str, dict] = {}
    for m, pool in members:
        pools.setdefault(pool.name, {"pool": pool, "prefill": [], "decode": []})[m.role].append(m.node_id)
    routes = [
        (name, x["pool"].page_encoding, p, d) for name, x in pools.items() for p in x["prefill"] for d in x["decode"]
    ]
    agents = {  # every node checked before the key goes to any
        node.id: trusted_agent(node.name, node.engine, node.url.rstrip("/"), node.tls_fingerprint, insecure_http)
        for node in nodes.values()
        if node.paired or any(node.id in (p, d) for *_, p, d in routes)
    }
    key = cluster_key()
    for agent in agents.values():
        ready_agent(agent, key)
    columns = [Column(f"node/{n.name}", None, agents[n.id]) for n in nodes.values() if n.paired]
    for name, encoding, p, d in routes:
        several = sum(r[0] == name for r in routes) > 1
        label = f"{name} {nodes[p].name}->{nodes[d].name}" if several else name
        columns.append(Column(label, agents[p], agents[d], encoding))
    if models:
        wanted = [m.strip() for m in models.split(",") if m.strip()]
        unknown = sorted(set(wanted) - {c.name for c in columns})
        if unknown:
            raise typer.BadParameter(
                f"the panel has no model {', '.join(unknown)} (it has {', '.join(c.name for c in columns)})"
            )
        columns = [c for c in columns if c.name in wanted]
    used = list({id(a): a for c in columns for a in (c.p, c.d) if a is not None}.values())
    result["agents"] = [
        {"name": a.name, "engine": a.engine, "url": a.url, "cpus": None, "accelerator": a.info.get("accelerator")}
        for a in used
    ]
    from ..progress import console

    with console.status("measuring each pair's link (its decoder pulls pages from its prefiller) and decode steps…"):
        result["link_measured"] = {}
        for c in columns:
            if c.p is not None and f"{c.p.name}->{c.d.name}" not in result["link_measured"]:
                result["link_measured"][f"{c.p.name}->{c.d.name}"] = pulled_link(c.p, c.d, key)
        result["vocab"] = min(int(a.info["vocab_size"]) for a in used)
        decoders = {c.d.name: c.d for c in columns}.values()
        result["decode_step_seconds"] = {a.name: decode_step_seconds(a, key, result["vocab"]) for a in decoders}

    def link(p: Agent, d: Agent, nbytes: int) -> tuple[float, str]:
        rate = result["link_measured"][f"{p.name}->{d.name}"]["bytes_per_second"]
        return nbytes / rate, "page stream rate (POST /v1/bench/link)"

    measure(result, panel, api_key, key, columns, link, save)


def trusted_agent(name: str, engine: str, url: str, fingerprint: str, insecure_http: bool) -> Agent:
    """A node of the panel, to be sent the cluster key only over HTTPS to the certificate the panel
    pinned for it, or over plain HTTP when told `--insecure-http`; refused otherwise (nothing sent)."""
    if url.startswith("https://"):
        if not fingerprint:
            raise typer.BadParameter(
                f"the panel has no TLS certificate pinned for node {name} at {url} (pair it in the panel): "
                "the cluster key was not sent"
            )
    elif not insecure_http:
        raise typer.BadParameter(
            f"node {name} is at {url}, plain HTTP, where the cluster key crosses the network readable: it was not "
            "sent. Pass --insecure-http for nodes started with it, on a link nobody else can reach."
        )
    return Agent(name, engine, url, None, tls_fingerprint=fingerprint)


def ready_agent(agent: Agent, key: str) -> None:
    """The agent's /v1/info, once it says it is ready (its engine as it reports it)."""
    r = httpx.get(agent.url + "/v1/info", headers={"Authorization": f"Bearer {key}"}, timeout=30, verify=agent.verify())
    if r.status_code != 200 or r.json().get("state") != "ready":
        raise typer.BadParameter(f"agent {agent.name} at {agent.url} is not ready: {r.status_code} {r.text[:200]}")
    agent.info, agent.engine = r.json(), r.json().get("engine") or agent.engine


def pulled_link(p: Agent, d: Agent, key: str) -> dict:
    body = {"peer": p.url, "megabytes": 64} | ({"peer_fingerprint": p.tls_fingerprint} if p.tls_fingerprint else {})
    r = httpx.post(
        d.url + "/v1/bench/link",
        json=body,  # with P's pin: D trusts P as the panel does
        headers={"Authorization": f"Bearer {key}"},
        timeout=600,
        verify=d.verify(),
    )
    if r.status_code != 200:
        raise RuntimeError(f"{d.name} could not measure its link from {p.name}: {r.status_code} {r.text[:300]}")
    return {**r.json(), "method": "page stream"}
