"""The agent's NDJSON token-stream response: what it holds is released however it ends."""

from __future__ import annotations

import asyncio

import pytest

from node_agent.token_stream import NDJSONResponse


def response(started: list, released: list) -> NDJSONResponse:
    async def lines():
        started.append(True)
        yield b'{"token": 1}\n'
        yield b'{"done": true}\n'

    return NDJSONResponse(lines(), release=lambda: released.append(True))


def call(resp: NDJSONResponse, send, spec_version: str = "2.4") -> None:
    scope = {"type": "http", "asgi": {"spec_version": spec_version}, "method": "POST", "path": "/v1/decode"}

    async def receive():
        await asyncio.Event().wait()  # no disconnect message: the send decides

    asyncio.run(resp(scope, receive, send))


@pytest.mark.parametrize("spec_version", ["2.0", "2.4"])
def test_a_client_gone_before_the_first_line_still_releases(spec_version):
    """Starlette never starts the lines when the response start fails: their own `finally`
    would not run, so the response releases."""
    started, released = [], []

    async def send(message):
        raise OSError("client gone")

    with pytest.raises(Exception):  # noqa: B017 - what Starlette raises differs by ASGI version
        call(response(started, released), send, spec_version)
    assert started == [] and released == [True]


def test_a_whole_stream_releases_once_after_the_last_line():
    started, released, sent = [], [], []

    async def send(message):
        assert not released, "released before the last line was sent"
        sent.append(message.get("body", b""))

    call(response(started, released), send)
    assert b"".join(sent) == b'{"token": 1}\n{"done": true}\n' and released == [True]
