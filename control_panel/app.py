"""The control panel's ASGI app: state in SQLite, the OpenAI-compatible API (`api/`) and the web UI (`ui/`).

`create_app(state)` builds the app around a `PanelState` (`state.py`) kept on `app.state.panel`,
where every route reaches it through `deps.py`; `create_panel_app(data_dir, ...)` opens one.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from tandem_protocol.gate import BodyTooLarge

from .api import chat, completions, models, responses
from .api.errors import OpenAIError, route_failure
from .deps import LoginRequired, login_required
from .gate import panel_gate, too_large
from .login_limit import LoginLimiter
from .router import RouteError
from .state import PanelState, open_state
from .ui import discovered, help, login, nodes, playground, pools, requests, settings
from .ui.render import STATIC_DIR

log = logging.getLogger("tandem.panel")

API_ROUTERS = (models, chat, completions, responses)
UI_ROUTERS = (login, nodes, discovered, pools, playground, requests, settings, help)


def create_panel_app(
    data_dir: Path,
    cluster_key: str | None = None,
    mdns: bool = False,
    mdns_interfaces: list[str] | None = None,
    login_limiter: LoginLimiter | None = None,
) -> FastAPI:
    """The panel on `data_dir`. With `mdns`, agents announcing on the LAN are added (unpaired) as
    they appear. `login_limiter` (default: 5 failed logins per address per minute) is for tests."""
    return create_app(open_state(data_dir, cluster_key, mdns, mdns_interfaces, login_limiter))


async def start_discovery(state: PanelState) -> None:
    """Start the mDNS watcher; where it cannot join the multicast group (two machines on a direct
    cable with no default route: ENODEV), the panel serves without discovery and says why on the
    Settings page, rather than fail its start after printing the one-time admin password."""
    try:
        await state.watcher.start()
    except OSError as e:
        await state.watcher.stop()  # whatever it had opened
        where = ", ".join(state.watcher.interfaces)
        state.discovery_error = f"{e.strerror or e} (on {where})"
        state.watcher = None
        log.warning("mDNS discovery is off: it could not start: %s", state.discovery_error)


def create_app(state: PanelState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if state.watcher is not None:
            await start_discovery(state)
        try:
            yield
        finally:
            await state.aclose()

    app = FastAPI(title="Tandem panel", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(panel_gate, db=state.db)  # the API key and the body's size, before the body
    app.state.panel = state
    app.state.db, app.state.router = state.db, state.router  # what the CLI and tests reach for
    add_error_handlers(app)

    @app.get("/healthz")
    async def healthz():
        return {"ok": True}

    for module in API_ROUTERS + UI_ROUTERS:
        app.include_router(module.router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(LoginRequired, login_required)

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, e: OpenAIError):
        return e.response()

    @app.exception_handler(RouteError)
    async def route_error(request: Request, e: RouteError):
        """A routing error the API did not log itself (it logs those of its answers): the panel's
        log has its detail, the client only what route_failure tells."""
        log.warning("%s %s failed: %s", request.method, request.url.path, e)
        return route_failure(e, None).response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        errors = e.errors()
        if errors and errors[0]["type"] == "json_invalid":
            return OpenAIError(
                400,
                f"the body is not valid JSON: {errors[0].get('ctx', {}).get('error', '')} "
                f"(at character {errors[0]['loc'][-1]})",
            ).response()
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'][1:]) or 'the body'}: {err['msg']}" for err in errors
        )
        where = errors[0]["loc"][1:] if errors else ()
        return OpenAIError(400, f"invalid request: {problems}", param=str(where[0]) if where else None).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        """Errors the framework raises itself (unknown path or method, a body too large or not
        decodable) in OpenAI's shape on the API; the web UI keeps FastAPI's."""
        if not request.url.path.startswith("/v1/"):
            return await http_exception_handler(request, e)
        if isinstance(e, BodyTooLarge):
            return too_large(request.url.path)
        if isinstance(e.__cause__, UnicodeDecodeError):  # FastAPI: "There was an error parsing the body"
            message = f"the body is not valid JSON: it is not UTF-8 ({e.__cause__.reason} at byte {e.__cause__.start})"
        elif e.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif e.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(e.detail)
        response = OpenAIError(e.status_code, message).response()
        response.headers.update(e.headers or {})  # e.g. Allow on a 405
        return response
