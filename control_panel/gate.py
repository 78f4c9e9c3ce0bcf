"""The panel's gate (tandem_protocol/gate.py): the Host and Origin, the OpenAI API's key and a
body over MAX_BODY_BYTES are checked before any of the body is read; refusals in the API's error
shape (the web UI's in plain text: its forms carry a session and a CSRF token, checked by its
routes)."""

from __future__ import annotations

from sqlalchemy import Engine
from starlette.responses import PlainTextResponse, Response

from tandem_protocol.gate import Gate

from .api.errors import OpenAIError
from .security import api_key_valid

# A request body over this is refused with 413. An OpenAI request is text or token ids: 4 MiB holds
# a prompt far longer than any context a desk machine serves.
MAX_BODY_BYTES = 4 << 20


# The UI's scripts are files of its own (no inline script, no eval); styles may be inline (the
# gauges' widths, htmx's indicator rule); nothing is framed, fetched or posted elsewhere.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
HEADERS = {"Content-Security-Policy": CSP, "Referrer-Policy": "same-origin", "X-Frame-Options": "DENY"}


def panel_gate(app, db: Engine) -> Gate:
    return Gate(
        app,
        limit=MAX_BODY_BYTES,
        keyed=lambda path: path.startswith("/v1/"),
        key_valid=lambda token: api_key_valid(db, token),
        refusal=refusal,
        headers=HEADERS,
    )


def refusal(status: int, path: str, message: str) -> Response:
    if not path.startswith("/v1/"):
        return PlainTextResponse(message, status_code=status)
    if status == 401:
        return OpenAIError.bad_api_key().response()
    return OpenAIError(status, message, code="request_too_large" if status == 413 else None).response()


def too_large(path: str) -> Response:
    return refusal(413, path, f"the request body is larger than the limit of {MAX_BODY_BYTES} bytes")
