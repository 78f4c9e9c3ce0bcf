"""GET /v1/models (the pairs, and the nodes as `node/<name>`) and the API's OpenAPI document."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..deps import API_KEY, Db
from ..services import model_names

router = APIRouter(dependencies=API_KEY)


@router.get("/v1/openapi.json", include_in_schema=False)
async def openapi(request: Request):
    """This API's OpenAPI document (behind the key, like the agent's /v1/openapi.json)."""
    return request.app.openapi()


@router.get("/v1/models")
async def models(db: Db):
    return {
        "object": "list",
        "data": [{"id": n, "object": "model", "created": 0, "owned_by": "tandem"} for n in model_names(db)],
    }
