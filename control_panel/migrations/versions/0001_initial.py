"""Initial schema: nodes, pairs, API keys, settings.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "node",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("url", sa.String(), nullable=False, unique=True, index=True),
        sa.Column("node_id", sa.String(), nullable=False, server_default=""),
        sa.Column("source", sa.String(), nullable=False, server_default="manual"),
        sa.Column("paired", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("engine", sa.String(), nullable=False, server_default=""),
        sa.Column("model", sa.String(), nullable=False, server_default=""),
        sa.Column("contract", sa.String(), nullable=False, server_default=""),
        sa.Column("last_seen", sa.Float(), nullable=True),
        sa.Column("last_error", sa.String(), nullable=False, server_default=""),
    )
    op.create_table(
        "pair",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(), nullable=False, unique=True, index=True),
        sa.Column("prefill_node_id", sa.Integer(), sa.ForeignKey("node.id"), nullable=False),
        sa.Column("decode_node_id", sa.Integer(), sa.ForeignKey("node.id"), nullable=False),
        sa.Column("prefill_engine", sa.String(), nullable=False),
        sa.Column("decode_engine", sa.String(), nullable=False),
        sa.Column("prefill_model_path", sa.String(), nullable=False),
        sa.Column("decode_model_path", sa.String(), nullable=False),
        sa.Column("context_length", sa.Integer(), nullable=False),
        sa.Column("staging_bytes", sa.Integer(), nullable=False),
        sa.Column("local_threshold", sa.Integer(), nullable=False, server_default="0"),
    )
    op.create_table(
        "apikey",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("prefix", sa.String(), nullable=False),
        sa.Column("key_hash", sa.String(), nullable=False, unique=True, index=True),
        sa.Column("created", sa.Float(), nullable=False),
    )
    op.create_table(
        "setting",
        sa.Column("key", sa.String(), primary_key=True),
        sa.Column("value", sa.String(), nullable=False),
    )


def downgrade() -> None:
    for table in ("setting", "apikey", "pair", "node"):
        op.drop_table(table)
