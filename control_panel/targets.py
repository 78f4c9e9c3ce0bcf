"""The `model` of a request to the pair or node that serves it."""

from __future__ import annotations

from sqlalchemy import Engine
from sqlmodel import Session, select

from .api.errors import OpenAIError
from .db import cached_until_state_changes
from .models import Node, Pair
from .router import Target
from .services import node_by_model_name


def resolve_target(engine: Engine, model: str) -> Target:
    """A pair by its name, or a single node as `node/<name>`."""
    target = _find_target(engine, model)
    if target is None:
        raise OpenAIError(
            404, f"the model `{model}` does not exist (see GET /v1/models)", code="model_not_found", param="model"
        )
    return target


@cached_until_state_changes
def _find_target(engine: Engine, model: str) -> Target | None:
    with Session(engine) as s:
        pair = s.exec(select(Pair).where(Pair.name == model)).first()
        if pair is not None:
            p, d = s.get(Node, pair.prefill_node_id), s.get(Node, pair.decode_node_id)
            return Target(pair.name, d.url, p.url, pair.local_threshold, pair.fallback, pair.page_encoding)
        if model.startswith("node/"):
            node = node_by_model_name(s, model)
            if node is not None:
                return Target(model, node.url)
    return None
