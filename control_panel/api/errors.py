"""An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

from ..router import RouteError

# A node's address in an agent's words (a URL, or host:port): the client is never told one. The
# text is an agent's (up to 64 KiB), scanned on the event loop, so the scan is linear: a match
# starts only where no character of its kind comes before (the lookbehinds) and takes its run
# whole (possessive), so each character is looked at a bounded number of times. (Starting at
# every `\b` instead rescans a run like `a-a-a-…` from each of its words: 8,000 characters took
# 1.7 s, 64 KiB would take minutes; issue 43.)
_ADDRESS = re.compile(
    r"(?<![a-z0-9+])[a-z][a-z0-9+]*+://[^\s,;)]++"  # a URL
    r"|(?:\[[0-9a-f:]++\]|(?<![\w-])(?<![\w-]\.)[\w-]++(?:\.[\w-]++)*+):\d{1,5}\b",  # [IPv6]:port, name:port
    re.I,
)
# What a client is told of a refusal's words at most: enough for any message of ours (a few
# lines), not an echo of whatever an agent or a template wrote (the request log keeps more).
MAX_MESSAGE = 500


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


def without_addresses(text: str) -> str:
    return _ADDRESS.sub("a node", text)


def shortened(text: str) -> str:
    """`text` cut to MAX_MESSAGE characters, at a space: a word cut in two could be a piece of an
    address that no longer reads as one."""
    if len(text) <= MAX_MESSAGE:
        return text
    head = text[:MAX_MESSAGE]
    if not text[MAX_MESSAGE].isspace():
        words = head.rsplit(maxsplit=1)
        head = words[0] if len(words) == 2 else ""
    return head.rstrip() + " …"


def route_failure(e: RouteError, request_id: str | None) -> OpenAIError:
    """A routing error as the client is told it. A refusal (4xx: the request cannot be served as
    asked, or the nodes are busy) in the agent's words, less any node's address; a failure (5xx: a
    node unreachable or failing) as only that, with the id under which the request log keeps the
    detail (the agents' addresses and errors are the panel's to see, not its clients')."""
    if e.status < 500:
        message = without_addresses(shortened(str(e)))
    else:
        where = f" (request {request_id})" if request_id else ""
        message = f"the model's nodes could not serve this request; the panel's request log has the details{where}"
    return OpenAIError(e.status, message, kind=e.kind, retry_after=e.retry_after)
