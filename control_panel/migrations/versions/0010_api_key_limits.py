"""Per-API-key limits: requests in flight at once and tokens per minute (NULL: no limit).

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("apikey") as batch:
        batch.add_column(sa.Column("max_concurrent", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("tokens_per_minute", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("apikey") as batch:
        batch.drop_column("tokens_per_minute")
        batch.drop_column("max_concurrent")
