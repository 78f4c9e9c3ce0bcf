"""The panel's declared dependencies: each route states what it needs through these aliases.

Signed out, a page is redirected to /login (a GET comes back after login: `next`) and an htmx or
fetch() call gets 401 with HX-Redirect, by `LoginRequired`'s handler. A form's POST cannot be
replayed as a GET, so it comes back to nothing. The CSRF checks run after the session check.
The OpenAI-compatible API's routes need an API key instead (`API_KEY`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Annotated

from fastapi import Depends, Form, Header, Request
from fastapi.responses import RedirectResponse, Response
from sqlalchemy import Engine
from sqlmodel import Session

from tandem_protocol.auth import bearer_token

from .api.errors import OpenAIError
from .i18n import COOKIE as LANG_COOKIE
from .i18n import Translator, pick_language
from .models import ApiKey
from .rate_limits import Slot
from .request_log import RequestLogWriter
from .router import Router
from .security import presented_key
from .state import PanelState
from .ui.render import Renderer
from .ui.sessions import wants_fragment


class LoginRequired(Exception):
    """Raised by `admin_session` when the request has no valid session."""


async def login_required(request: Request, _exc: LoginRequired) -> Response:
    if wants_fragment(request):
        return Response("login required", status_code=401, headers={"HX-Redirect": "/login"})
    back = f"?next={request.url.path}" if request.method == "GET" else ""
    return RedirectResponse(f"/login{back}", status_code=303)


def panel_state(request: Request) -> PanelState:
    return request.app.state.panel


Panel = Annotated[PanelState, Depends(panel_state)]


def db_engine(panel: Panel) -> Engine:
    return panel.db


Db = Annotated[Engine, Depends(db_engine)]


def db_session(db: Db) -> Iterator[Session]:
    with Session(db) as session:
        yield session


DbSession = Annotated[Session, Depends(db_session)]


def agent_router(panel: Panel) -> Router:
    return panel.router


AgentRouter = Annotated[Router, Depends(agent_router)]


def translator(request: Request) -> Translator:
    """The language: the switcher's cookie, else the best of Accept-Language, else English."""
    return Translator(pick_language(request.cookies.get(LANG_COOKIE), request.headers.get("accept-language")))


Tr = Annotated[Translator, Depends(translator)]


def renderer(request: Request, panel: Panel, t: Tr) -> Renderer:
    return Renderer(request, panel.sessions, t)


Render = Annotated[Renderer, Depends(renderer)]


def admin_session(request: Request, panel: Panel) -> dict:
    """The signed-in admin's session (its CSRF token in "csrf"); signed out: `LoginRequired`."""
    data = panel.sessions.of(request)
    if data is None:
        raise LoginRequired()
    return data


AdminSession = Annotated[dict, Depends(admin_session)]
SIGNED_IN = [Depends(admin_session)]  # a router's `dependencies`: every route on it needs a session


def csrf_form(request: Request, panel: Panel, _session: AdminSession, csrf: Annotated[str, Form()] = "") -> None:
    """A signed-in form POST whose `csrf` field (or X-CSRF-Token header) is the session's token."""
    panel.sessions.check_csrf(request, csrf)


CsrfForm = Annotated[None, Depends(csrf_form)]


def csrf_header(request: Request, panel: Panel, _session: AdminSession) -> None:
    """A signed-in fetch() POST (a JSON body) whose X-CSRF-Token header is the session's token."""
    panel.sessions.check_csrf(request, None)


CsrfHeader = Annotated[None, Depends(csrf_header)]


# ---- the OpenAI-compatible API (control_panel/api/) ---------------------------------------------
def request_log_writer(panel: Panel) -> RequestLogWriter:
    return panel.request_log


RequestLogs = Annotated[RequestLogWriter, Depends(request_log_writer)]


async def api_key(panel: Panel, authorization: Annotated[str | None, Header()] = None) -> ApiKey:
    """The valid API key sent as a bearer token: the route's declared credential (the panel's gate,
    control_panel/gate.py, has already refused a request without one, before reading its body)."""
    key = presented_key(panel.db, bearer_token(authorization))
    if key is None:
        raise OpenAIError.bad_api_key()
    return key


async def key_slot(panel: Panel, key: Annotated[ApiKey, Depends(api_key)]) -> AsyncIterator[Slot]:
    """A place among the key's requests in flight, within its token rate (else 429), before any
    agent is asked anything. Held until the answer has been sent, a stream's last byte included,
    however it ends: FastAPI runs the code after `yield` once the response is done or broken off."""
    slot = panel.limits.admit(key.id, key.max_concurrent, key.tokens_per_minute)
    try:
        yield slot
    finally:
        slot.release()


KeySlot = Annotated[Slot, Depends(key_slot)]  # what a route that asks the agents declares
CallerKey = Annotated[ApiKey, Depends(api_key)]  # what a route that asks no agent declares (its owner's rows)


async def cache_salt(panel: Panel, key: CallerKey) -> str | None:
    """The prefix cache namespace of the key's requests (cache_salt.py): None while shared."""
    return panel.cache_salts.of(key)


CacheSalt = Annotated[str | None, Depends(cache_salt)]  # what a route that asks the agents declares too


async def json_only(request: Request) -> None:
    """A POST's body sent as JSON. FastAPI parses a body as JSON only under a JSON media type, and
    validates anything else as one opaque value ("Input should be a valid dictionary"): this says
    what is wrong instead."""
    if request.method != "POST":
        return
    given = request.headers.get("content-type", "")
    media = given.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise OpenAIError(
            415,
            f"the body must be JSON sent with Content-Type: application/json (got {given or 'no Content-Type'})",
            code="unsupported_media_type",
        )


API_KEY = [Depends(api_key), Depends(json_only)]  # a router's `dependencies`: every API route
