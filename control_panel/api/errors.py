"""An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

from ..router import RouteError

# A node's address in an agent's words (a URL, or host:port): the client is never told one.
_ADDRESS = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s,;)]+|(?:\[[0-9a-f:]+\]|\b[\w-]+(?:\.[\w-]+)*):\d{1,5}\b", re.I)


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ):
        super().__init__(message)
        self.status, self.kind, self.param, self.code, self.retry_after = status, kind, param, code, retry_after

    @classmethod
    def bad_api_key(cls) -> OpenAIError:
        return cls(
            401,
            "missing or wrong API key (create one in the panel's Settings)",
            kind="invalid_request_error",
            code="invalid_api_key",
        )

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(int(self.retry_after))} if self.retry_after else None
        return JSONResponse(
            {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}},
            status_code=self.status,
            headers=headers,
        )


def route_failure(e: RouteError, request_id: str | None) -> OpenAIError:
    """A routing error as the client is told it. A refusal (4xx: the request cannot be served as
    asked, or the nodes are busy) in the agent's words, less any node's address; a failure (5xx: a
    node unreachable or failing) as only that, with the id under which the request log keeps the
    detail (the agents' addresses and errors are the panel's to see, not its clients')."""
    if e.status < 500:
        message = _ADDRESS.sub("a node", str(e))
    else:
        where = f" (request {request_id})" if request_id else ""
        message = f"the model's nodes could not serve this request; the panel's request log has the details{where}"
    return OpenAIError(e.status, message, kind=e.kind, retry_after=e.retry_after)
