"""A panel moves a known node only when the agent at the new address proves it is that node
(against a real agent; the proof itself, ids and the migration: tests/unit/test_node_identity.py)."""

from __future__ import annotations

import asyncio

import pytest
from sqlmodel import Session, select

from control_panel.db import open_db
from control_panel.models import Node
from control_panel.services import PanelError, add_node, model_names, note_discovered, verify_identity
from tandem_protocol.discovery import Peer

from ..agents import TEST_KEY, AgentProcess


@pytest.fixture(scope="module")
def agent(smol_dir, tmp_path_factory):
    with AgentProcess("torch", smol_dir, tmp_path_factory.mktemp("a"), tls=True) as a:
        yield a


def _peer(url: str, node_id: str) -> Peer:
    host, port = url.removeprefix("https://").rsplit(":", 1)
    return Peer("x._tandem._tcp.local.", [host], int(port), {"node_id": node_id, "name": "announced", "tls": "1"})


def test_a_node_moves_only_for_a_proof_at_its_new_address(agent, tmp_path):
    engine = open_db(tmp_path / "panel.db")
    node_id = agent.status()["node_id"]
    proved = asyncio.run(verify_identity(agent.url, TEST_KEY))
    assert proved.node_id == node_id and proved.tls_fingerprint == agent.fingerprint
    assert len(agent.fingerprint) == 64
    # a known node must present the certificate pinned for it, checked before the challenge is sent
    with pytest.raises(PanelError, match="another TLS certificate"):
        asyncio.run(verify_identity(agent.url, TEST_KEY, expect_fingerprint="0" * 64))
    with pytest.raises(PanelError, match="could not prove"):
        asyncio.run(verify_identity(agent.url, "tdm_wrong-key-of-another-cluster"))
    with pytest.raises(PanelError, match="could not prove it is node bbbbbbbb"):
        asyncio.run(verify_identity(agent.url, TEST_KEY, expect_node_id="b" * 32))
    # "localhost" reaches the agent at 127.0.0.1 (or ::1, where it does not listen): the name's
    # addresses count, and the agent signs the one it was reached at
    assert asyncio.run(verify_identity(agent.url.replace("127.0.0.1", "localhost"), TEST_KEY)).node_id == node_id

    stale = "http://127.0.0.1:9"  # where the node was before its restart
    with Session(engine) as s:
        s.add(Node(name="torch-before", url=stale, node_id=node_id, paired=True))
        s.add(Node(name="impostor-target", url="http://127.0.0.1:7", node_id="c" * 32, paired=True))
        s.commit()
    # an announcement that the agent is node cccc…: it cannot prove that, so nothing moves
    asyncio.run(note_discovered(engine, _peer(agent.url, "c" * 32), True, TEST_KEY))
    # a panel with another key cannot check the agent's claim, so nothing moves either
    asyncio.run(note_discovered(engine, _peer(agent.url, node_id), True, "tdm_wrong-key-of-another-cluster"))
    with Session(engine) as s:
        assert {n.node_id: n.url for n in s.exec(select(Node))} == {node_id: stale, "c" * 32: "http://127.0.0.1:7"}
    asyncio.run(note_discovered(engine, _peer(agent.url, node_id), True, TEST_KEY))  # the true claim
    with Session(engine) as s:
        assert {n.node_id: n.url for n in s.exec(select(Node))} == {node_id: agent.url, "c" * 32: "http://127.0.0.1:7"}

    # a node added by URL where another row's agent used to be takes the address, keeps one row
    with Session(engine) as s:
        row = s.exec(select(Node).where(Node.node_id == node_id)).one()
        row.url = "http://127.0.0.1:9"
        other = s.exec(select(Node).where(Node.node_id == "c" * 32)).one()
        other.url = agent.url
        s.add(row), s.add(other)
        s.commit()
    added = asyncio.run(add_node(engine, agent.url, TEST_KEY))
    with Session(engine) as s:
        assert {n.node_id: n.url for n in s.exec(select(Node))} == {node_id: agent.url, "c" * 32: ""}
    assert added.tls_fingerprint == agent.fingerprint  # pinned from the proof
    assert added.node_id == node_id and model_names(engine) == [
        f"node/{added.name}"
    ]  # the address-less one is not served
