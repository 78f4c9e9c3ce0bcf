"""Nodes are their identity, not their URL: the identity proof, per-agent ids, and the migration
that merges the twins an older panel kept of one agent."""

from __future__ import annotations

import sqlite3

import pytest
from sqlmodel import Session, select

from control_panel.db import open_db
from control_panel.models import Node, PoolMember
from control_panel.services import model_names
from node_agent.identity import NodeIdInUse, claim_node_id, node_id_path
from tandem_protocol.auth import identity_answer, new_nonce, proof_matches

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
        members = s.exec(select(PoolMember).order_by(PoolMember.role)).all()
        assert [(m.node_id, m.role) for m in members] == [(2, "decode"), (2, "prefill")]
    assert model_names(engine) == ["p", "node/decode-mlx"]
