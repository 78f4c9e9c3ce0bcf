"""What the panel does to its state: add nodes, pair them, remove them.

A node is its node id, not its URL: an agent that comes back at a new address (a `tandem up`
restart gives new ports, DHCP a new IP) keeps its row, pairs and `node/<name>` — once it has
proved at the new address that it holds the cluster key (`verify_identity`, no key sent).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
from pydantic import ValidationError
from sqlalchemy import Engine
from sqlmodel import Session, select

from tandem_protocol.auth import IDENTITY_PATH, IdentityAnswer, canonical_address, new_nonce, proof_matches
from tandem_protocol.client import AgentHTTPError, TransportError
from tandem_protocol.contract import ModelContract
from tandem_protocol.discovery import Peer
from tandem_protocol.pages import ENCODINGS
from tandem_protocol.tls import PinnedContext, client_context

from . import pins
from .models import Node, Pool, PoolMember

log = logging.getLogger("tandem.panel")
# The identity check's whole exchange (connect, TLS, challenge, answer) gets this long, however its
# bytes trickle in, and its answer this many bytes (one is a few hundred): the agent there is not
# trusted yet, and may be anyone on the LAN who announced an address.
IDENTITY_DEADLINE = 10.0
MAX_IDENTITY_ANSWER = 64 * 1024
# Identity checks mDNS announcements may start at once (a LAN host can announce without end);
# an announcement past them is not followed. A threading semaphore for its non-blocking acquire,
# which holds no event loop (tests run several).
MAX_ANNOUNCED_CHECKS = 4
_announced_checks = threading.BoundedSemaphore(MAX_ANNOUNCED_CHECKS)
# Unpaired nodes found by mDNS: at most this many are kept (the least recently seen goes first),
# and one not seen for FOUND_EXPIRE_SECONDS is forgotten. mDNS is unauthenticated: anyone on the
# LAN can announce as many nodes as they like.
MAX_FOUND = 64
FOUND_EXPIRE_SECONDS = 3600.0


class PanelError(Exception):
    """A user action that cannot be done; the message says why."""

    def __init__(self, message: str, fields: list[str] | None = None):
        super().__init__(message)
        self.fields = fields or []


async def agent_status(url: str, cluster_key: str) -> dict:
    """The agent's /v1/status (its /v1/info plus budget and totals), errors as PanelError."""
    client = pins.agent_client(url, cluster_key)
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


async def _addresses_of(url: str) -> set[str]:
    """The `host:port` forms a connection to `url` may reach (a name resolves to several)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    try:
        found = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        found = []
    return {canonical_address(host, port)} | {canonical_address(sockaddr[0], port) for *_, sockaddr in found}


def _reached(url: str) -> str:
    """The host:port the panel dials for `url`, as the identity proof writes it."""
    parts = urlsplit(url)
    return canonical_address(parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80))


@dataclass(frozen=True)
class Proved:
    """What an agent proved to hold the cluster key: its node id and the TLS certificate it serves."""

    node_id: str
    tls_fingerprint: str  # "" over plain HTTP


async def verify_identity(
    url: str, cluster_key: str, expect_node_id: str | None = None, expect_fingerprint: str | None = None
) -> Proved:
    """The node id and certificate of the agent at `url` once it has proved, for a fresh nonce,
    at this very address and over this very TLS connection, that it holds `cluster_key`
    (tandem_protocol/auth.py). The key itself is not sent, so an impostor at `url` learns
    nothing. `expect_node_id`: it must also be this node; `expect_fingerprint`: a known node's
    pinned certificate, which it must present again (plain HTTP included: a downgrade is refused)."""
    if not cluster_key:
        raise PanelError("the panel has no cluster key yet: pair a node with it first")
    nonce = new_nonce()
    https = urlsplit(url).scheme == "https"
    # First contact trusts no CA: the certificate is whatever the agent presents, accepted only
    # if the proof below names it. A known node's pin is checked in the handshake, before the challenge.
    context = client_context(expect_fingerprint or None) if https else None
    try:
        async with asyncio.timeout(IDENTITY_DEADLINE):  # in all, not per read: a trickle ends here too
            status, content = await _challenge(url, context, nonce)
    except TimeoutError as e:
        raise PanelError(f"{url} gave no whole answer to the identity check within {IDENTITY_DEADLINE:.0f} s") from e
    except httpx.HTTPError as e:
        if context is not None and context.seen and context.pin and context.seen != context.pin:
            raise PanelError(f"{url} presented another TLS certificate than the node's, pinned at pairing") from e
        raise PanelError(f"{url} is not reachable ({type(e).__name__})") from e
    seen = (context.seen or "") if context is not None else ""
    if expect_fingerprint and seen != expect_fingerprint:
        raise PanelError(f"{url} does not serve the TLS certificate pinned for the node (plain HTTP?)")
    if status == 404:
        raise PanelError(f"{url} cannot prove its identity: update Tandem on that machine")
    if status != 200:
        raise PanelError(f"{url} answered {status} to the identity check")
    try:
        answer = IdentityAnswer.model_validate_json(content)
    except ValidationError as e:
        raise PanelError(f"{url} answered the identity check with something else") from e
    if answer.address not in await _addresses_of(url):
        raise PanelError(
            f"{url} answered as {answer.address}: not the address reached (a relay, or a port forward, "
            "which the identity check does not pass)"
        )
    if https and answer.tls_fingerprint != seen:
        raise PanelError(
            f"{url} signed for TLS certificate {answer.tls_fingerprint[:16] or 'none'}… but the connection "
            f"presented {seen[:16]}…: something between the panel and the agent (refused)"
        )
    if not proof_matches(answer, cluster_key, nonce, expect_node_id or answer.node_id, answer.address, seen):
        who = f"node {expect_node_id[:8]}" if expect_node_id else "an agent"
        raise PanelError(f"{url} could not prove it is {who} holding the panel's cluster key")
    return Proved(answer.node_id, seen)


async def _challenge(url: str, context: PinnedContext | None, nonce: str) -> tuple[int, bytes]:
    """POST the identity challenge to `url`: the answer's status and, for a 200, its body, read as
    it arrives and refused past MAX_IDENTITY_ANSWER bytes (raw: nothing is inflated)."""
    challenge = {"nonce": nonce, "address": _reached(url)}
    async with (
        httpx.AsyncClient(verify=context or True, timeout=IDENTITY_DEADLINE) as c,
        c.stream("POST", url + IDENTITY_PATH, json=challenge, headers={"Accept-Encoding": "identity"}) as r,
    ):
        if r.status_code != 200:
            return r.status_code, b""
        body = bytearray()
        async for chunk in r.aiter_raw():
            body += chunk
            if len(body) > MAX_IDENTITY_ANSWER:
                raise PanelError(f"{url} answered the identity check with more than {MAX_IDENTITY_ANSWER} bytes")
        return r.status_code, bytes(body)


async def prove(url: str, cluster_key: str) -> None:
    """The node at `url` proves itself before it is sent the key: a known one with the
    certificate pinned for it, a new one with the certificate it then gets pinned with."""
    proved = await verify_identity(url, cluster_key, expect_fingerprint=pins.pinned(url))
    pins.pin(url, proved.tls_fingerprint)


def _place(s: Session, node_id: str, url: str, name: str, source: str) -> Node:
    """The row of node `node_id`, now at `url` (not committed). A node id has one row; another row
    that had this URL loses it (the node there is gone), so no row ever names a node it is not."""
    node = s.exec(select(Node).where(Node.node_id == node_id)).first()
    displaced = s.exec(select(Node).where(Node.url == url)).first()
    if displaced is not None and displaced is not node:
        displaced.url, displaced.last_error = "", f"its address {url} is now node {node_id[:8]}'s"
        s.add(displaced)
        s.flush()  # before the URL is taken again (it is unique)
    if node is None:
        node = Node(name=name, url=url, node_id=node_id, source=source)
    elif node.url != url:
        log.info("node %s (%s) moved from %s to %s", node.name, node_id[:8], node.url or "nowhere", url)
        node.url = url
    return node


async def add_node(engine: Engine, url: str, cluster_key: str, source: str = "manual") -> Node:
    """Add (or refresh, or move) a node by URL; it is paired once it has proved it holds the
    cluster key, and only then is the key sent to it."""
    url = url.rstrip("/")
    proved = await verify_identity(url, cluster_key)
    pins.pin(url, proved.tls_fingerprint)  # before the key is sent: only to the certificate that proved it
    info = await agent_status(url, cluster_key)
    if info["node_id"] != proved.node_id:
        raise PanelError(f"{url} proved to be node {proved.node_id[:8]} but reports {info['node_id'][:8]}: try again")
    with Session(engine) as s:
        node = _place(s, proved.node_id, url, info["name"], source)
        node.name, node.source, node.paired = info["name"], source, True
        node.tls_fingerprint = proved.tls_fingerprint
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
    decode_kv_bytes: int | None = None,
) -> dict:
    """Check (dry_run) or apply one node's part of a pair; returns the contract it would have (or
    has). Errors name the form field at fault (`prefill_model_path`, `decode_engine`, …).
    `decode_kv_bytes` (the decoder's KV budget) is sent only when given, to the decode node."""
    client = pins.agent_client(url, cluster_key)
    try:
        current = await (client.info() if decode_kv_bytes is None else client.status())
        if decode_kv_bytes is not None and "decode" not in current:  # an older agent would drop the budget
            message = f"{role} node: this agent takes no decode KV budget: update Tandem on that machine"
            raise PanelError(message, ["decode_kv_mib"])
        if not engine and not model_path and all(v is None for v in (context_length, staging_bytes, decode_kv_bytes)):
            return current["contract"]  # the node keeps what it runs
        body = {
            "engine": engine or current["engine"],
            "model_path": model_path or current["model_path"],
            "context_length": context_length,
            "staging_bytes": staging_bytes,
            "dry_run": dry_run,
        }
        if decode_kv_bytes is not None:
            body["decode_kv_bytes"] = decode_kv_bytes
        out = await client.configure(**body)
        return out["contract"]
    except AgentHTTPError as e:
        field = e.detail.get("field")
        message = e.detail.get("message") or str(e)
        raise PanelError(f"{role} node: {message}", [f"{role}_{field}"] if field else [role]) from e
    except TransportError as e:
        raise PanelError(f"{role} node {url} is not reachable ({type(e).__name__})", [role]) from e
    finally:
        await client.aclose()


@dataclass
class MemberSpec:
    """One node's part in a pool: its role and, blank for "as the node runs now", the engine,
    model path and budget (the staging budget of a prefill node, the KV budget of a decode node)
    to set on it."""

    url: str
    role: str  # "prefill" or "decode"
    engine: str | None = None
    model_path: str | None = None
    budget_bytes: int | None = None


async def create_pool(
    engine: Engine,
    cluster_key: str,
    name: str,
    members: list[MemberSpec],
    local_threshold: int = 0,
    fallback: str = "decode_alone",
    page_encoding: str = "raw",
    context_length: int | None = None,
) -> Pool:
    """Serve a model name from these nodes (replacing the pool of that name): check every node's
    engine and model path, switch them if asked, then check that their contracts agree, before
    any node loads anything. Errors name the form field at fault (`decode_model_path`, …)."""
    if not name or "/" in name:
        raise PanelError("a model needs a name without '/' (it is the model name on the API)", ["name"])
    if page_encoding not in ENCODINGS:
        raise PanelError(f"unknown page encoding {page_encoding!r} ({' or '.join(ENCODINGS)})", ["page_encoding"])
    if not any(m.role == "decode" for m in members):
        raise PanelError("a model needs a decode node", ["decode"])
    for m in members:  # before any is sent the key
        try:
            await prove(m.url.rstrip("/"), cluster_key)
        except PanelError as e:
            raise PanelError(f"{m.role} node: {e}", [m.role]) from e
    for dry_run in (True, False):  # check every node, and their contracts, before any loads anything
        contracts = [await _configure_member(m, cluster_key, context_length, dry_run) for m in members]
        first = ModelContract.from_dict(contracts[0])
        for other in contracts[1:]:  # names every differing field (weights, tokenizer, geometry, …)
            first.check_same(ModelContract.from_dict(other))
    infos = [await agent_status(m.url, cluster_key) for m in members]
    nodes = [await add_node(engine, m.url, cluster_key) for m in members]
    with Session(engine) as s:
        pool = s.exec(select(Pool).where(Pool.name == name)).first() or Pool(name=name, context_length=0)
        pool.context_length = infos[0]["context_length"]
        pool.local_threshold, pool.fallback, pool.page_encoding = local_threshold, fallback, page_encoding
        s.add(pool)
        s.flush()
        for old in s.exec(select(PoolMember).where(PoolMember.pool_id == pool.id)):
            s.delete(old)
        s.flush()
        for m, info, node in zip(members, infos, nodes, strict=True):
            s.add(PoolMember(pool_id=pool.id, node_id=node.id, role=m.role, **_as_set(m.role, info)))
        s.commit()
        s.refresh(pool)
        return pool


async def add_member(engine: Engine, cluster_key: str, pool_id: int, m: MemberSpec) -> PoolMember:
    """Add a node to a pool in a role, once its contract (after any switch) agrees with the pool's."""
    with Session(engine) as s:
        pool = s.get(Pool, pool_id)
        if pool is None:
            raise PanelError("no such model")
        peer = s.exec(select(Node).join(PoolMember).where(PoolMember.pool_id == pool_id)).first()
        if any(x.role == m.role for x in _members_at(s, pool_id, m.url)):
            raise PanelError(f"this node is already a {m.role} node of {pool.name}", ["node"])
    try:
        await prove(m.url.rstrip("/"), cluster_key)
    except PanelError as e:
        raise PanelError(str(e), ["node"]) from e
    pool_contract = ModelContract.from_dict((await agent_status(peer.url, cluster_key))["contract"]) if peer else None
    for dry_run in (True, False):
        contract = ModelContract.from_dict(await _configure_member(m, cluster_key, pool.context_length, dry_run))
        if pool_contract is not None:
            pool_contract.check_same(contract)
    info = await agent_status(m.url, cluster_key)
    node = await add_node(engine, m.url, cluster_key)
    with Session(engine) as s:
        member = PoolMember(pool_id=pool_id, node_id=node.id, role=m.role, **_as_set(m.role, info))
        s.add(member)
        s.commit()
        s.refresh(member)
        return member


def remove_member(engine: Engine, member_id: int) -> None:
    """Take a node out of a pool; a pool keeps at least one decode node (delete the model instead)."""
    with Session(engine) as s:
        member = s.get(PoolMember, member_id)
        if member is None:
            return
        decoders = s.exec(select(PoolMember).where(PoolMember.pool_id == member.pool_id, PoolMember.role == "decode"))
        if member.role == "decode" and len(list(decoders)) == 1:
            raise PanelError("a model needs a decode node: delete the model instead")
        s.delete(member)
        s.commit()


def delete_pool(engine: Engine, pool_id: int) -> None:
    with Session(engine) as s:
        _delete_pool(s, pool_id)
        s.commit()


def _delete_pool(s: Session, pool_id: int) -> None:
    for member in s.exec(select(PoolMember).where(PoolMember.pool_id == pool_id)):
        s.delete(member)
    s.flush()  # the members' foreign keys go before the pool they point at
    pool = s.get(Pool, pool_id)
    if pool is not None:
        s.delete(pool)


def _members_at(s: Session, pool_id: int, url: str) -> list[PoolMember]:
    query = select(PoolMember).join(Node).where(PoolMember.pool_id == pool_id, Node.url == url)
    return list(s.exec(query))


def _as_set(role: str, info: dict) -> dict:
    """A member's engine, model path and budget as the node reports them after configuring."""
    budget = info["budget"]["capacity"] if role == "prefill" else (info.get("decode") or {}).get("kv_capacity", 0)
    return {"engine": info["engine"], "model_path": info["model_path"], "budget_bytes": budget}


async def _configure_member(m: MemberSpec, cluster_key: str, context_length: int | None, dry_run: bool) -> dict:
    staging = m.budget_bytes if m.role == "prefill" else None
    kv = m.budget_bytes if m.role == "decode" else None
    return await configure_node(
        m.url, cluster_key, m.role, m.engine, m.model_path, context_length, staging, dry_run, kv
    )


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
    decode_kv_bytes: int | None = None,
) -> Pool:
    """The smallest pool: prefill on one node, decode on another."""
    members = [
        MemberSpec(prefill_url, "prefill", prefill_engine, prefill_model_path, staging_bytes),
        MemberSpec(decode_url, "decode", decode_engine, decode_model_path, decode_kv_bytes),
    ]
    return await create_pool(
        engine, cluster_key, name, members, local_threshold, fallback, page_encoding, context_length
    )


async def note_discovered(engine: Engine, peer: Peer, present: bool, cluster_key: str) -> None:
    """Record an agent that appeared on (or withdrew from) the LAN. A new one is added unpaired:
    the panel sends it nothing, the cluster key least of all, until the user pairs it. mDNS is
    unauthenticated, so an announcement moves a known node (or takes a known node's address)
    only once the agent there has proved its identity (`verify_identity`), and at most
    MAX_ANNOUNCED_CHECKS such checks run at once. The database work runs on a thread: anyone on
    the LAN can announce, and the event loop serves the API."""
    url, node_id = peer.url.rstrip("/"), peer.properties.get("node_id", "")
    if not url or not node_id:
        return
    node, at_url = await asyncio.to_thread(_rows_of, engine, node_id, url)
    if not present:
        if node is not None and node.source == "mdns" and node.url == url:
            withdrawn = "withdrawn: the agent stopped announcing itself on the network"
            await asyncio.to_thread(_note, engine, node.id, withdrawn)
        return
    if node is not None and node.ignored:  # the user said so: not even its address is followed
        return
    if (node is not None and node.url != url) or (at_url is not None and at_url is not node):
        if not _announced_checks.acquire(blocking=False):
            log.warning(
                "announcement of node %s at %s not followed: %d identity checks already under way",
                node_id[:8],
                url,
                MAX_ANNOUNCED_CHECKS,
            )
            return
        try:
            pinned = node.tls_fingerprint if node is not None and node.paired else None
            proved = await verify_identity(url, cluster_key, expect_node_id=node_id, expect_fingerprint=pinned)
        except PanelError as e:
            log.warning("announcement of node %s at %s not followed: %s", node_id[:8], url, e)
            return
        finally:
            _announced_checks.release()
        if node is not None and node.paired:
            pins.unpin(node.url)
            pins.pin(url, proved.tls_fingerprint)
    await asyncio.to_thread(_record_found, engine, peer, node_id, url)


def _rows_of(engine: Engine, node_id: str, url: str) -> tuple[Node | None, Node | None]:
    """The row of node `node_id` and the row at `url` (either may be None)."""
    with Session(engine) as s:
        node = s.exec(select(Node).where(Node.node_id == node_id)).first()
        return node, s.exec(select(Node).where(Node.url == url)).first()


def _record_found(engine: Engine, peer: Peer, node_id: str, url: str) -> None:
    """Node `node_id` is at `url`, as `peer` announced it (read again: a check may have run since)."""
    with Session(engine) as s:
        node = _place(s, node_id, url, peer.properties.get("name") or peer.service.split(".")[0], "mdns")
        if not node.paired:  # a paired node's facts come from its authenticated /v1/status
            node.engine, node.model = peer.properties.get("engine", ""), peer.properties.get("model", "")
            node.contract, node.last_error = peer.properties.get("contract", ""), ""
        node.last_seen = time.time()
        s.add(node)
        s.flush()
        _bound_found(s, keep=node.id)
        s.commit()


def _bound_found(s: Session, keep: int) -> None:
    """Forget unpaired mDNS nodes that are stale or past MAX_FOUND (least recently seen first),
    but never `keep` (the one just announced)."""
    found = s.exec(
        select(Node)
        # an ignored node stays (forgotten, it would come back): only a user's click makes one
        .where(Node.source == "mdns", Node.paired == False, Node.ignored == False, Node.id != keep)  # noqa: E712 (SQL)
        .order_by(Node.last_seen.desc())
    ).all()
    stale = time.time() - FOUND_EXPIRE_SECONDS
    for i, node in enumerate(found):
        if i >= MAX_FOUND - 1 or (node.last_seen or 0) < stale:
            in_pools = s.exec(select(PoolMember).where(PoolMember.node_id == node.id)).first()
            if in_pools is None:
                s.delete(node)


def ignore_found(engine: Engine, node_id: int, ignored: bool = True) -> None:
    """Hide (or show again) an agent found on the network and not paired: its announcements are
    not followed while it is ignored."""
    with Session(engine) as s:
        node = s.get(Node, node_id)
        if node is not None and not node.paired:
            node.ignored = ignored
            s.add(node)
            s.commit()


def show_ignored(engine: Engine) -> None:
    with Session(engine) as s:
        for node in s.exec(select(Node).where(Node.ignored == True)):  # noqa: E712 (SQL)
            node.ignored = False
            s.add(node)
        s.commit()


def remove_node(engine: Engine, node_id: int) -> tuple[str, list[str]] | None:
    """Forget a node: it leaves every pool it is in, and a pool left without a decode node is
    removed (it cannot serve). Returns the node's URL and the names of the models removed with
    it; None if there is no such node. The agent itself is not told: it keeps running, and can
    be added or paired again."""
    with Session(engine) as s:
        node = s.get(Node, node_id)
        if node is None:
            return None
        url = node.url
        members = list(s.exec(select(PoolMember).where(PoolMember.node_id == node_id)))
        for member in members:
            s.delete(member)
        s.flush()
        removed = []
        pools = s.exec(select(Pool).where(Pool.id.in_({m.pool_id for m in members})).order_by(Pool.name)).all()
        for pool in pools:
            if not s.exec(select(PoolMember).where(PoolMember.pool_id == pool.id, PoolMember.role == "decode")).first():
                removed.append(pool.name)
                _delete_pool(s, pool.id)
        s.flush()  # the members' foreign keys go before the node they point at
        s.delete(node)
        s.commit()
    pins.unpin(url)
    return url, removed


def _note(engine: Engine, row_id: int, last_error: str) -> None:
    with Session(engine) as s:
        node = s.get(Node, row_id)
        if node is not None:
            node.last_error = last_error
            s.add(node)
            s.commit()


def _served_nodes(s: Session) -> dict[str, Node]:
    """Paired nodes with an address, by model name: `node/<name>`, or `node/<name>@<id8>` for each
    of several nodes that share a name (one name must not pick a node at random)."""
    nodes = list(s.exec(select(Node).where(Node.paired == True, Node.url != "").order_by(Node.name)))  # noqa: E712
    names = [n.name for n in nodes]
    return {f"node/{n.name}" + (f"@{n.node_id[:8]}" if names.count(n.name) > 1 else ""): n for n in nodes}


def node_by_model_name(s: Session, model: str) -> Node | None:
    return _served_nodes(s).get(model)


def model_names(engine: Engine) -> list[str]:
    """The model names the API serves, each once: every pool with a decode node that has an
    address, and every paired node with one (see `_served_nodes`)."""
    with Session(engine) as s:
        serving = select(Pool.name).join(PoolMember).join(Node)
        serving = serving.where(PoolMember.role == "decode", Node.url != "").distinct().order_by(Pool.name)
        return list(s.exec(serving)) + list(_served_nodes(s))


def delete_row(engine: Engine, table: type, row_id: int) -> None:
    with Session(engine) as s:
        row = s.get(table, row_id)
        if row is not None:
            s.delete(row)
            s.commit()
