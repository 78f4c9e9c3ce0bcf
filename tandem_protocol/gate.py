"""The first thing a request meets on an agent and on the panel (pure ASGI, in front of the app):
its Host and Origin, its credential and its body's size are checked before a byte of its body is
read.

Host: a name this machine answers to (an IP address, localhost, its host name, `<name>.local`, or
one listed in $TANDEM_ALLOWED_HOSTS). A web page on another site that re-points its own name at a
desk machine's address (DNS rebinding) reaches the panel under that foreign name, and is refused.
Origin: a browser's request that changes something (any method but GET, HEAD, OPTIONS) must come
from a page of this same host; requests from programs carry no Origin and are not affected.

FastAPI reads and parses a request's body before any dependency runs, so a credential checked
only as a dependency comes too late: an unauthenticated chunked body of gigabytes is read into
memory first (a 256 MiB one took an agent from 1.08 to 2.62 GB). Here a request without the
credential its path needs is refused at once, a declared length over the limit is refused at
once, and a chunked body is cut off (413) as soon as it grows past the limit. The server reads no
further than its own small buffer (uvicorn stops reading a socket at 64 KiB until the app asks).
Routes still declare their credential as a dependency: this is the wall in front of them.
"""

from __future__ import annotations

import functools
import ipaddress
import socket
from collections.abc import Callable
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import Response

from .auth import bearer_token
from .settings import settings

Refusal = Callable[[int, str, str], Response]  # (status, path, message) -> the app's own error
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
NOSNIFF = {"X-Content-Type-Options": "nosniff"}  # a body is only ever what its Content-Type says


@functools.cache
def own_names() -> frozenset[str]:
    """The names this machine answers to, beside IP addresses (lower case)."""
    host = socket.gethostname().lower()
    names = {"localhost", host, host.split(".")[0] + ".local", socket.getfqdn().lower()}
    return frozenset(names | {n.strip().lower() for n in settings().allowed_hosts.split(",") if n.strip()})


def host_name(value: str) -> str:
    """A Host header's (or an Origin's netloc's) name, without its port and brackets."""
    value = value.strip().lower()
    if value.startswith("["):  # [::1]:8000
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def host_allowed(value: str) -> bool:
    name = host_name(value)
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return name in own_names()


class BodyTooLarge(HTTPException):
    """Raised from `receive` when a chunked body grows past the limit: FastAPI passes it on to the
    app's handlers, which answer 413 in the app's error shape."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than the limit of {limit} bytes")


class Gate:
    def __init__(
        self,
        app,
        *,
        limit: int,
        keyed: Callable[[str], bool],
        key_valid: Callable[[str | None], bool],
        refusal: Refusal,
        headers: dict[str, str] | None = None,
    ):
        """`keyed(path)`: whether a path needs the bearer credential `key_valid` accepts; `limit`:
        the largest body in bytes; `refusal`: the app's error response for a status and path;
        `headers`: added to every response (the panel's CSP, nosniff)."""
        self.app, self.limit, self.keyed, self.key_valid, self.refusal = app, limit, keyed, key_valid, refusal
        self.headers = [(k.lower().encode(), v.encode()) for k, v in {**NOSNIFF, **(headers or {})}.items()]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *self.headers]}
            await send(message)

        await self.check(scope, receive, send_with_headers)

    async def check(self, scope, receive, send):
        path, headers = scope["path"], Headers(scope=scope)
        host = headers.get("host", "")
        if not host_allowed(host):
            message = f"Host {host_name(host)!r} is not a name of this machine (add it to TANDEM_ALLOWED_HOSTS)"
            return await self.refusal(400, path, message)(scope, receive, send)
        origin = headers.get("origin")
        if (
            origin is not None
            and scope["method"] not in SAFE_METHODS
            and urlsplit(origin).netloc.lower() != host.lower()
        ):
            message = f"a request from the page of another site ({origin}) is refused"
            return await self.refusal(403, path, message)(scope, receive, send)
        if self.keyed(path) and not self.key_valid(bearer_token(headers.get("authorization"))):
            return await self.refusal(401, path, "missing or wrong credential")(scope, receive, send)
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.limit:
            message = f"the request body is larger than the limit of {self.limit} bytes"
            return await self.refusal(413, path, message)(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, limited, send)
