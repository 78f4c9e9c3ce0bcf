"""The planner's predicted time to first token of each request, beside the actual one.

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("requestlog") as batch:
        batch.add_column(sa.Column("predicted_ttft_ms", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("requestlog") as batch:
        batch.drop_column("predicted_ttft_ms")
