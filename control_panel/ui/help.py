"""The Help page: how to start agents, pair them and call the API, in the user's language."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..deps import SIGNED_IN, Render

router = APIRouter(include_in_schema=False, dependencies=SIGNED_IN)


@router.get("/help")
async def help_page(request: Request, render: Render):
    return render("help.html", base_url=str(request.base_url).rstrip("/"))
