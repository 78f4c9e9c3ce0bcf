"""Each node's pinned TLS certificate (the SHA-256 fingerprint it proved at pairing), and whether
the user chose to ignore an agent found on the network.

Revision ID: 0011
Revises: 0010
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("node") as batch:
        batch.add_column(sa.Column("tls_fingerprint", sa.String(), nullable=False, server_default=""))
        batch.add_column(sa.Column("ignored", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("node") as batch:
        batch.drop_column("ignored")
        batch.drop_column("tls_fingerprint")
