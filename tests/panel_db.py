"""Databases of older panels, for the migration tests: the rows an earlier schema held."""

from __future__ import annotations

import sqlalchemy as sa


def insert_old_pair(engine: sa.Engine) -> None:
    """Nodes a and b and a torch→MLX pair 'old' between them, in the columns every revision
    since 0001 has (the ones later revisions added take their defaults)."""
    nodes = "(1, 'a', 'http://a:1'), (2, 'b', 'http://b:1')"
    with engine.begin() as c:
        c.execute(sa.text(f"INSERT INTO node (id, name, url) VALUES {nodes}"))
        c.execute(
            sa.text(
                "INSERT INTO pair (name, prefill_node_id, decode_node_id, prefill_engine, decode_engine, "
                "prefill_model_path, decode_model_path, context_length, staging_bytes) "
                "VALUES ('old', 1, 2, 'torch', 'mlx', '/m', '/m', 8192, 1024)"
            )
        )
