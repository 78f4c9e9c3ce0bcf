"""Responses API answers kept for `previous_response_id`.

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "storedresponse",
        sa.Column("id", sa.String(), primary_key=True),
        sa.Column("created", sa.Float(), nullable=False),
        sa.Column("expires", sa.Float(), nullable=False),
        sa.Column("conversation", sa.String(), nullable=False),
        sa.Column("response", sa.String(), nullable=False),
    )
    op.create_index("ix_storedresponse_expires", "storedresponse", ["expires"])


def downgrade() -> None:
    op.drop_index("ix_storedresponse_expires", table_name="storedresponse")
    op.drop_table("storedresponse")
