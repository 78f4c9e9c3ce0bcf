"""The control panel's ASGI app: state in SQLite, the OpenAI-compatible API and the web UI."""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from tandem_protocol.discovery import Watcher

from .body_limit import MAX_BODY_BYTES, BodyLimit, BodyTooLarge, too_large
from .db import get_setting, open_db, set_setting
from .login_limit import LoginLimiter
from .openai_api import OpenAIError, make_openai_router
from .request_log import RequestLogWriter, mark_interrupted
from .router import RouteError, Router
from .services import note_discovered
from .ui import STATIC_DIR, make_ui_router


def create_panel_app(
    data_dir: Path,
    cluster_key: str | None = None,
    mdns: bool = False,
    mdns_interfaces: list[str] | None = None,
    login_limiter: LoginLimiter | None = None,
) -> FastAPI:
    """The panel. With `mdns`, agents announcing on the LAN are added (unpaired) as they appear.
    `login_limiter` (default: 5 failed logins per address per minute) is a parameter for tests."""
    engine = open_db(data_dir / "panel.db")
    if cluster_key:
        set_setting(engine, "cluster_key", cluster_key)
    router = Router(get_setting(engine, "cluster_key") or "")
    mark_interrupted(engine)  # requests that were running when the panel last stopped
    request_log = RequestLogWriter(engine)
    watcher = Watcher(mdns_interfaces, lambda peer, present: note_discovered(engine, peer, present)) if mdns else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if watcher is not None:
            await watcher.start()
        try:
            yield
        finally:
            if watcher is not None:
                await watcher.stop()
            await router.aclose()
            request_log.close()

    app = FastAPI(title="Tandem panel", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)
    app.state.db, app.state.router, app.state.watcher = engine, router, watcher

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, e: OpenAIError):
        return e.response()

    @app.exception_handler(RouteError)
    async def route_error(request: Request, e: RouteError):
        return OpenAIError(e.status, str(e), kind=e.kind, retry_after=e.retry_after).response()

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

    @app.get("/healthz")
    async def healthz():
        return {"ok": True}

    app.include_router(make_openai_router(engine, router, request_log))
    app.include_router(make_ui_router(engine, router, watcher, data_dir, login_limiter))
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app
