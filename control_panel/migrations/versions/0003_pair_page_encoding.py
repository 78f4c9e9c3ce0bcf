"""How a pair's pages travel: raw FP16 or compressed.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("pair") as batch:
        batch.add_column(sa.Column("page_encoding", sa.String(), nullable=False, server_default="raw"))


def downgrade() -> None:
    with op.batch_alter_table("pair") as batch:
        batch.drop_column("page_encoding")
