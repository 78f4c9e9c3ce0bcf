"""Migration 0006: every pair of an older panel becomes a two-node pool, settings and all."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import command
from sqlmodel import Session, select

from control_panel.db import alembic_config, open_db
from control_panel.models import Pool, PoolMember, RequestLog

from ..panel_db import insert_old_pair


def test_a_pair_becomes_a_pool_of_two_keeping_every_setting_and_back(tmp_path):
    db = tmp_path / "panel.db"
    engine = open_db(db, "0005")
    insert_old_pair(engine)
    settings = "local_threshold = 300, fallback = 'fail', page_encoding = 'zstd', decode_kv_bytes = 4096"
    with engine.begin() as c:
        c.execute(sa.text(f"UPDATE pair SET {settings} WHERE name = 'old'"))
        c.execute(sa.text("INSERT INTO requestlog (created, model, route) VALUES (1.0, 'old', 'pd')"))
    engine.dispose()

    engine = open_db(db)
    with Session(engine) as s:
        pool = s.exec(select(Pool)).one()
        assert (pool.name, pool.context_length, pool.local_threshold, pool.fallback, pool.page_encoding) == (
            "old",
            8192,
            300,
            "fail",
            "zstd",
        )
        members = s.exec(select(PoolMember).order_by(PoolMember.role)).all()
        assert [(m.pool_id, m.node_id, m.role, m.engine, m.model_path, m.budget_bytes) for m in members] == [
            (pool.id, 2, "decode", "mlx", "/m", 4096),
            (pool.id, 1, "prefill", "torch", "/m", 1024),
        ]
        row = s.exec(select(RequestLog)).one()  # older rows: no nodes, no id, nothing cached
        assert (row.model, row.decode_node, row.prefill_node, row.request_id, row.cached_tokens) == (
            "old",
            "",
            "",
            "",
            0,
        )
    engine.dispose()
    assert "pair" not in sa.inspect(sa.create_engine(f"sqlite:///{db}")).get_table_names()

    command.downgrade(alembic_config(f"sqlite:///{db}"), "0005")
    engine = sa.create_engine(f"sqlite:///{db}")
    with engine.connect() as c:
        pair = c.execute(sa.text("SELECT * FROM pair")).mappings().one()
    assert {k: pair[k] for k in ("name", "prefill_node_id", "decode_node_id", "staging_bytes", "decode_kv_bytes")} == {
        "name": "old",
        "prefill_node_id": 1,
        "decode_node_id": 2,
        "staging_bytes": 1024,
        "decode_kv_bytes": 4096,
    }
    assert (pair["local_threshold"], pair["fallback"], pair["page_encoding"]) == (300, "fail", "zstd")
    assert {"pool", "poolmember"}.isdisjoint(sa.inspect(engine).get_table_names())
    engine.dispose()
