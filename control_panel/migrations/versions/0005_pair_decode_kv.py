"""The decode node's KV budget of a pair, as that node reported it (0: not known).

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("pair") as batch:
        batch.add_column(sa.Column("decode_kv_bytes", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("pair") as batch:
        batch.drop_column("decode_kv_bytes")
