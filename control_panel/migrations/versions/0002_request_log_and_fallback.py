"""Request log, and a fallback policy per pair.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("pair") as batch:
        batch.add_column(sa.Column("fallback", sa.String(), nullable=False, server_default="decode_alone"))
    op.create_table(
        "requestlog",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("created", sa.Float(), nullable=False, index=True),
        sa.Column("model", sa.String(), nullable=False),
        sa.Column("route", sa.String(), nullable=False),
        sa.Column("reason", sa.String(), nullable=False, server_default=""),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("ttft_ms", sa.Float(), nullable=True),
        sa.Column("output_tokens", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("bytes_moved", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("outcome", sa.String(), nullable=False, server_default="ok"),
        sa.Column("error", sa.String(), nullable=False, server_default=""),
    )


def downgrade() -> None:
    op.drop_table("requestlog")
    with op.batch_alter_table("pair") as batch:
        batch.drop_column("fallback")
