"""The panel's limit on request bodies: over MAX_BODY_BYTES is a 413, decided before the body is read."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import PlainTextResponse, Response

from .api.errors import OpenAIError

# A request body over this is refused with 413. An OpenAI request is text or token ids: 4 MiB holds
# a prompt far longer than any context a desk machine serves.
MAX_BODY_BYTES = 4 << 20


class BodyTooLarge(HTTPException):
    def __init__(self) -> None:
        super().__init__(413, "Content Too Large")


class BodyLimit:
    """Refuses a body over `limit` bytes: from its Content-Length, before any of it is read, or as
    soon as a chunked body grows past it (an HTTPException from `receive`, which FastAPI passes on
    to the handlers). Starlette's own limit answers an announced length in plain text, whatever
    the app's handlers say, so the panel has this one."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.limit:
            return await too_large(scope["path"])(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge()
            return message

        await self.app(scope, limited, send)


def too_large(path: str) -> Response:
    if not path.startswith("/v1/"):
        return PlainTextResponse("Content Too Large", status_code=413)
    return OpenAIError(
        413, f"the request body is larger than the limit of {MAX_BODY_BYTES} bytes", code="request_too_large"
    ).response()
