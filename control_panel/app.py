"""The control panel's ASGI app: state in SQLite, the OpenAI-compatible API and the web UI."""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.staticfiles import StaticFiles

from node_agent.discovery import Watcher

from .db import get_setting, open_db, set_setting
from .login_limit import LoginLimiter
from .openai_api import OpenAIError, make_openai_router
from .router import Router
from .request_log import RequestLogWriter, mark_interrupted
from .services import note_discovered
from .ui import STATIC_DIR, make_ui_router


def create_panel_app(data_dir: Path, cluster_key: str | None = None, mdns: bool = False,
                     mdns_interfaces: list[str] | None = None, login_limiter: LoginLimiter | None = None) -> FastAPI:
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
    app.state.db, app.state.router, app.state.watcher = engine, router, watcher

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, e: OpenAIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'][1:])}: {err['msg']}" for err in e.errors())
        return OpenAIError(400, f"invalid request: {problems}").response()

    @app.get("/healthz")
    async def healthz():
        return {"ok": True}

    app.include_router(make_openai_router(engine, router, request_log))
    app.include_router(make_ui_router(engine, router, watcher, data_dir, login_limiter))
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app
