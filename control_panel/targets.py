"""The `model` of a request to the pool or node that serves it."""

from __future__ import annotations

from dataclasses import replace

from sqlalchemy import Engine
from sqlmodel import Session, select

from .api.errors import OpenAIError
from .db import cached_until_state_changes
from .models import Node, Pool, PoolMember
from .router import Target
from .services import node_by_model_name


def resolve_target(engine: Engine, model: str, cache_salt: str | None = None) -> Target:
    """A pool by its name, or a single node as `node/<name>`, for a request whose prefix cache
    namespace is `cache_salt` (its API key's; None: unsalted)."""
    target = _find_target(engine, model)
    if target is None:
        raise OpenAIError(
            404, f"the model `{model}` does not exist (see GET /v1/models)", code="model_not_found", param="model"
        )
    return replace(target, cache_salt=cache_salt) if cache_salt else target


@cached_until_state_changes
def _find_target(engine: Engine, model: str) -> Target | None:
    with Session(engine) as s:
        pool = s.exec(select(Pool).where(Pool.name == model)).first()
        if pool is not None:
            rows = s.exec(
                select(PoolMember, Node)
                .join(Node)
                .where(PoolMember.pool_id == pool.id, Node.url != "")
                .order_by(PoolMember.id)
            ).all()
            urls = {role: tuple(n.url for m, n in rows if m.role == role) for role in ("prefill", "decode")}
            if not urls["decode"]:
                return None
            names = tuple((n.url, n.name) for _, n in rows)
            return Target(
                pool.name,
                urls["decode"],
                urls["prefill"],
                pool.local_threshold,
                pool.fallback,
                pool.page_encoding,
                node_names=names,
            )
        if model.startswith("node/"):
            node = node_by_model_name(s, model)
            if node is not None:
                return Target(model, (node.url,), is_node=True, node_names=((node.url, node.name),))
    return None
