"""How the agent answers an error: the status code of each kind and the JSON body
`{"error": {"type", "message", ...}}`, and the exception handlers that send them."""

from __future__ import annotations

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from tandem_protocol.api import PREFILLER_FAILED
from tandem_protocol.client import AgentHTTPError
from tandem_protocol.errors import Cancelled, ContractMismatch, FrameError, RequestError, TandemError, UnsupportedModel
from tandem_protocol.wire import PeerError

from .budget import BudgetExceeded, BudgetTimeout
from .engine_slot import EngineBusy, EngineLoading
from .handoffs import HandoffError
from .handshake import PrefillerFailed, PrefillerRefused


class ConfigError(RequestError):
    """A node configuration the node cannot take; `field` names the form field at fault."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


class Unauthorized(Exception):
    """Raised by the cluster-key check (`deps.cluster_key`), and by a page stream asked without
    its handoff's read token."""

    def __init__(self, message: str = "missing or wrong cluster key"):
        super().__init__(message)


_STATUS = [
    (BudgetExceeded, 413),
    (BudgetTimeout, 429),
    (ContractMismatch, 409),
    (UnsupportedModel, 400),
    (RequestError, 400),
    (Cancelled, 499),
    (FrameError, 502),
    (PeerError, 502),
    (EngineBusy, 409),
    (EngineLoading, 503),
]


def error_body(e: Exception) -> dict:
    body = {"type": type(e).__name__, "message": str(e)}
    if isinstance(e, ContractMismatch):
        body["fields"] = e.fields
    if isinstance(e, PeerError):
        body["peer_code"] = e.code
    if isinstance(e, ConfigError):
        body["field"] = e.field
    if isinstance(e, PrefillerRefused):  # the prefiller's own error type and details, passed on
        body = {**e.detail, **body, "type": e.kind}
    if isinstance(e, PrefillerFailed):
        body[PREFILLER_FAILED] = True
    return {"error": body}


def status_of(e: Exception) -> int:
    if isinstance(e, (HandoffError, AgentHTTPError, PrefillerFailed, PrefillerRefused)):
        return e.status
    return next((code for cls, code in _STATUS if isinstance(e, cls)), 500)


async def tandem_error(request: Request, e: TandemError) -> JSONResponse:
    retry = getattr(e, "retry_after", None)
    headers = {"Retry-After": str(int(np.ceil(retry)))} if retry else None
    return JSONResponse(error_body(e), status_code=status_of(e), headers=headers)


async def peer_http_error(request: Request, e: AgentHTTPError) -> JSONResponse:
    return JSONResponse(error_body(e), status_code=e.status)


async def framework_error(request: Request, e: HTTPException) -> JSONResponse:
    # What FastAPI raises itself (a body that is not UTF-8, an unknown path or method): the
    # agent's error shape, like every other refusal, instead of FastAPI's {"detail": ...}
    kind = GATE_ERRORS.get(e.status_code, "HTTPError")
    return JSONResponse(
        {"error": {"type": kind, "message": str(e.detail)}}, status_code=e.status_code, headers=e.headers
    )


async def invalid_body(request: Request, e: RequestValidationError) -> JSONResponse:
    problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())
    return JSONResponse({"error": {"type": "RequestError", "message": f"invalid request: {problems}"}}, status_code=400)


async def unauthorized(request: Request, e: Unauthorized) -> JSONResponse:
    return _unauthorized(str(e))


def _unauthorized(message: str) -> JSONResponse:
    body = {"error": {"type": "Unauthorized", "message": message}}
    return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})


GATE_ERRORS = {400: "RequestError", 403: "Forbidden", 413: "RequestTooLarge"}


def refusal(status: int, path: str, message: str) -> JSONResponse:
    """What the gate (tandem_protocol/gate.py) answers before the app: a Host that is not this
    machine's (400), a foreign page's Origin (403), a missing or wrong cluster key (401), a body
    over the limit (413)."""
    if status == 401:
        return _unauthorized(str(Unauthorized()))
    return JSONResponse({"error": {"type": GATE_ERRORS[status], "message": message}}, status_code=status)


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(TandemError, tandem_error)
    app.add_exception_handler(AgentHTTPError, peer_http_error)
    app.add_exception_handler(HTTPException, framework_error)
    app.add_exception_handler(RequestValidationError, invalid_body)
    app.add_exception_handler(Unauthorized, unauthorized)
