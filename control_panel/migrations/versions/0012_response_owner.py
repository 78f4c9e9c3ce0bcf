"""Each stored response belongs to the API key that made it (`key_id`), and counts its bytes
(`size`) against the store's caps.

Responses stored before this revision have no known owner: they are deleted. Giving them to any
one key would hand that key the others' conversations, and leaving them readable by every key is
the hole this revision closes. What is lost is at most 30 days of `previous_response_id`
continuations; a client whose id is gone is told 404, as for an expired one, and resends its input.

Revision ID: 0012
Revises: 0011
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("DELETE FROM storedresponse")
    # before the two JSON texts (a copied table: SQLite's ALTER adds columns last), so reading `size`
    # never walks a long row's overflow pages
    with op.batch_alter_table("storedresponse", recreate="always") as batch:
        batch.add_column(sa.Column("key_id", sa.Integer(), nullable=False), insert_after="id")
        batch.add_column(sa.Column("size", sa.Integer(), nullable=False, server_default="0"), insert_after="key_id")
        batch.create_index("ix_storedresponse_key_size", ["key_id", "size"])


def downgrade() -> None:
    with op.batch_alter_table("storedresponse") as batch:
        batch.drop_index("ix_storedresponse_key_size")
        batch.drop_column("size")
        batch.drop_column("key_id")
