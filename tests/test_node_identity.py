"""Nodes are their identity, not their URL: the identity proof, per-agent ids, and a panel that
moves a known node only when the agent at the new address proves it is that node."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest
from sqlmodel import Session, select

from control_panel.db import open_db
from control_panel.models import Node, Pair
from control_panel.services import PanelError, add_node, model_names, note_discovered, verify_identity
from node_agent.identity import NodeIdInUse, claim_node_id, node_id_path
from tandem_protocol.auth import identity_answer, new_nonce, proof_matches
from tandem_protocol.discovery import Peer

from .agents import TEST_KEY, AgentProcess

KEY, NODE, ADDRESS = "tdm_" + "k" * 40, "a" * 32, "192.168.1.20:7411"


def test_proof_holds_only_for_its_key_nonce_node_and_address():
    nonce = new_nonce()
    answer = identity_answer(KEY, nonce, NODE, ADDRESS)
    assert proof_matches(answer, KEY, nonce, NODE, ADDRESS)
    assert not proof_matches(answer, "tdm_" + "x" * 40, nonce, NODE, ADDRESS)  # wrong key
    assert not proof_matches(answer, KEY, new_nonce(), NODE, ADDRESS)  # an old answer replayed
    assert not proof_matches(answer, KEY, nonce, "b" * 32, ADDRESS)  # another node
    assert not proof_matches(answer, KEY, nonce, NODE, "192.168.1.66:7411")  # another address
    forged = answer.model_copy(update={"address": "192.168.1.66:7411"})  # relabelled, same proof
    assert not proof_matches(forged, KEY, nonce, NODE, "192.168.1.66:7411")


def test_agents_sharing_a_data_dir_get_their_own_lasting_ids(tmp_path):
    (tmp_path / "node-id").write_text("legacy0000000000000000000000000\n")  # an older version's one id
    a, lock_a = claim_node_id(node_id_path("desk-torch", tmp_path), tmp_path)
    b, lock_b = claim_node_id(node_id_path("desk-mlx", tmp_path), tmp_path)
    assert a == "legacy0000000000000000000000000" and b != a and len(b) == 32  # the first takes it over
    with pytest.raises(NodeIdInUse, match="another --name"):  # the same agent twice
        claim_node_id(node_id_path("desk-torch", tmp_path), tmp_path)
    lock_a.close(), lock_b.close()  # the agents stop
    assert claim_node_id(node_id_path("desk-mlx", tmp_path), tmp_path)[0] == b  # and come back as themselves
    assert node_id_path("a b", tmp_path) != node_id_path("a_b", tmp_path)


def test_migration_merges_an_agents_dead_twins(tmp_path):
    """A database from before node ids were unique: one agent, a row per address it had."""
    db = tmp_path / "panel.db"
    open_db(db, revision="0003").dispose()
    with sqlite3.connect(db) as c:
        for row_id, url, seen in ((1, "http://127.0.0.1:4001", 10.0), (2, "http://127.0.0.1:4002", 20.0)):
            c.execute(
                "INSERT INTO node (id, name, url, node_id, source, paired, engine, model, contract, last_seen, "
                "last_error) VALUES (?, 'decode-mlx', ?, ?, 'manual', 1, 'mlx', 'm', 'c', ?, '')",
                (row_id, url, NODE, seen),
            )
        c.execute(
            "INSERT INTO pair (name, prefill_node_id, decode_node_id, prefill_engine, decode_engine, "
            "prefill_model_path, decode_model_path, context_length, staging_bytes, local_threshold, fallback, "
            "page_encoding) VALUES ('p', 1, 1, 'mlx', 'mlx', '', '', 8192, 1, 0, 'fail', 'raw')"
        )
    engine = open_db(db)
    with Session(engine) as s:
        assert [(n.id, n.url) for n in s.exec(select(Node))] == [(2, "http://127.0.0.1:4002")]  # seen last
        pair = s.exec(select(Pair)).one()
        assert (pair.prefill_node_id, pair.decode_node_id) == (2, 2)
    assert model_names(engine) == ["p", "node/decode-mlx"]


@pytest.fixture(scope="module")
def agent(smol_dir, tmp_path_factory):
    with AgentProcess("torch", smol_dir, tmp_path_factory.mktemp("a")) as a:
        yield a


def _peer(url: str, node_id: str) -> Peer:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return Peer("x._tandem._tcp.local.", [host], int(port), {"node_id": node_id, "name": "announced"})


def test_a_node_moves_only_for_a_proof_at_its_new_address(agent, tmp_path):
    engine = open_db(tmp_path / "panel.db")
    node_id = agent.status()["node_id"]
    assert asyncio.run(verify_identity(agent.url, TEST_KEY)) == node_id
    with pytest.raises(PanelError, match="could not prove"):
        asyncio.run(verify_identity(agent.url, "tdm_wrong-key-of-another-cluster"))
    with pytest.raises(PanelError, match="could not prove it is node bbbbbbbb"):
        asyncio.run(verify_identity(agent.url, TEST_KEY, expect_node_id="b" * 32))
    # "localhost" reaches the agent at 127.0.0.1 (or ::1, where it does not listen): the name's
    # addresses count, and the agent signs the one it was reached at
    assert asyncio.run(verify_identity(agent.url.replace("127.0.0.1", "localhost"), TEST_KEY)) == node_id

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
    assert added.node_id == node_id and model_names(engine) == [
        f"node/{added.name}"
    ]  # the address-less one is not served
