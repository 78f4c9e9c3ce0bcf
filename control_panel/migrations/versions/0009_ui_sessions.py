"""Server-side web UI sessions: signing out ends one for good, idle ones expire.

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "uisession",
        sa.Column("sid", sa.String(), primary_key=True),
        sa.Column("created", sa.Float(), nullable=False),
        sa.Column("last_seen", sa.Float(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("uisession")
