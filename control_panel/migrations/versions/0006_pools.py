"""Pools: a model name served by any number of nodes. Every pair becomes a two-node pool with
the same name, settings, engines, model paths and budgets. The request log records the nodes
that served each request, the prompt tokens a prefix cache served, and the answer's id.

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "pool",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("context_length", sa.Integer(), nullable=False),
        sa.Column("local_threshold", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("fallback", sa.String(), nullable=False, server_default="decode_alone"),
        sa.Column("page_encoding", sa.String(), nullable=False, server_default="raw"),
    )
    op.create_index("ix_pool_name", "pool", ["name"], unique=True)
    op.create_table(
        "poolmember",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("pool_id", sa.Integer(), sa.ForeignKey("pool.id"), nullable=False),
        sa.Column("node_id", sa.Integer(), sa.ForeignKey("node.id"), nullable=False),
        sa.Column("role", sa.String(), nullable=False),
        sa.Column("engine", sa.String(), nullable=False),
        sa.Column("model_path", sa.String(), nullable=False),
        sa.Column("budget_bytes", sa.Integer(), nullable=False, server_default="0"),
        sa.UniqueConstraint("pool_id", "node_id", "role"),
    )
    op.create_index("ix_poolmember_pool_id", "poolmember", ["pool_id"])
    op.create_index("ix_poolmember_node_id", "poolmember", ["node_id"])
    op.execute(
        "INSERT INTO pool (id, name, context_length, local_threshold, fallback, page_encoding) "
        "SELECT id, name, context_length, local_threshold, fallback, page_encoding FROM pair"
    )
    op.execute(
        "INSERT INTO poolmember (pool_id, node_id, role, engine, model_path, budget_bytes) "
        "SELECT id, prefill_node_id, 'prefill', prefill_engine, prefill_model_path, staging_bytes FROM pair"
    )
    op.execute(
        "INSERT INTO poolmember (pool_id, node_id, role, engine, model_path, budget_bytes) "
        "SELECT id, decode_node_id, 'decode', decode_engine, decode_model_path, decode_kv_bytes FROM pair"
    )
    op.drop_table("pair")  # and its index
    with op.batch_alter_table("requestlog") as batch:
        batch.add_column(sa.Column("request_id", sa.String(), nullable=False, server_default=""))
        batch.add_column(sa.Column("cached_tokens", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("decode_node", sa.String(), nullable=False, server_default=""))
        batch.add_column(sa.Column("prefill_node", sa.String(), nullable=False, server_default=""))


def downgrade() -> None:
    """Pools of one prefill and one decode node become pairs again; larger pools keep their first
    node of each role (by member id) and lose the others."""
    op.create_table(
        "pair",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("prefill_node_id", sa.Integer(), sa.ForeignKey("node.id"), nullable=False),
        sa.Column("decode_node_id", sa.Integer(), sa.ForeignKey("node.id"), nullable=False),
        sa.Column("prefill_engine", sa.String(), nullable=False),
        sa.Column("decode_engine", sa.String(), nullable=False),
        sa.Column("prefill_model_path", sa.String(), nullable=False),
        sa.Column("decode_model_path", sa.String(), nullable=False),
        sa.Column("context_length", sa.Integer(), nullable=False),
        sa.Column("staging_bytes", sa.Integer(), nullable=False, server_default=str(512 << 20)),
        sa.Column("local_threshold", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("fallback", sa.String(), nullable=False, server_default="decode_alone"),
        sa.Column("page_encoding", sa.String(), nullable=False, server_default="raw"),
        sa.Column("decode_kv_bytes", sa.Integer(), nullable=False, server_default="0"),
    )
    op.create_index("ix_pair_name", "pair", ["name"], unique=True)
    first = "(SELECT MIN(id) FROM poolmember m WHERE m.pool_id = pool.id AND m.role = '{role}')"
    p, d = first.format(role="prefill"), first.format(role="decode")
    op.execute(
        "INSERT INTO pair (id, name, prefill_node_id, decode_node_id, prefill_engine, decode_engine, "
        "prefill_model_path, decode_model_path, context_length, staging_bytes, local_threshold, fallback, "
        "page_encoding, decode_kv_bytes) "
        "SELECT pool.id, pool.name, p.node_id, d.node_id, p.engine, d.engine, p.model_path, d.model_path, "
        "pool.context_length, p.budget_bytes, pool.local_threshold, pool.fallback, pool.page_encoding, "
        f"d.budget_bytes FROM pool JOIN poolmember p ON p.id = {p} JOIN poolmember d ON d.id = {d}"
    )
    op.drop_table("poolmember")
    op.drop_table("pool")
