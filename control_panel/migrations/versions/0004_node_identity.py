"""Nodes are their identity: one row per node id, any number of rows without an address.

Rows an older panel kept for one agent at each address it had (a `tandem up` restart gives
agents new ports) become one: the row seen last keeps the node, pairs that named the others
name it. Then node ids are unique, and URLs unique where known ("" = address taken by another
node).

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    db = op.get_bind()
    rows = db.execute(
        sa.text("SELECT id, node_id FROM node WHERE node_id != '' ORDER BY COALESCE(last_seen, 0) DESC, id DESC")
    ).all()
    keep: dict[str, int] = {}
    for row_id, node_id in rows:
        if node_id not in keep:
            keep[node_id] = row_id
            continue
        for column in ("prefill_node_id", "decode_node_id"):
            db.execute(
                sa.text(f"UPDATE pair SET {column} = :keep WHERE {column} = :twin"),
                {"keep": keep[node_id], "twin": row_id},
            )
        db.execute(sa.text("DELETE FROM node WHERE id = :twin"), {"twin": row_id})
    op.drop_index("ix_node_url", table_name="node")
    op.create_index("ix_node_url", "node", ["url"], unique=True, sqlite_where=sa.text("url != ''"))
    op.create_index("ix_node_node_id", "node", ["node_id"], unique=True, sqlite_where=sa.text("node_id != ''"))


def downgrade() -> None:
    op.drop_index("ix_node_node_id", table_name="node")
    op.drop_index("ix_node_url", table_name="node")
    op.create_index("ix_node_url", "node", ["url"], unique=True)
