"""Damaged page streams between two real agents: each ends with its own clear error, and
afterwards neither agent holds a reservation, a handoff or a request."""

from __future__ import annotations

import asyncio
import threading

import pytest

from node_agent.client import AgentHTTPError

from .agents import AgentProcess, decode_foreign_pages, pd_request, settle
from .conftest import prompt, run


class TamperProxy:
    """A TCP proxy that damages what the upstream sends back: flip one bit at byte `flip_at`,
    or cut the connection after `cut_at` bytes. Runs its own event loop in a thread."""

    def __init__(self, upstream_port: int, flip_at: int | None = None, cut_at: int | None = None):
        self.upstream_port, self.flip_at, self.cut_at = upstream_port, flip_at, cut_at
        self.port = 0
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        self._ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()

    async def _handle(self, client_r, client_w) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)

        async def upstream() -> None:
            while data := await client_r.read(65536):
                up_w.write(data)
                await up_w.drain()

        async def downstream() -> None:
            sent = 0
            while data := await up_r.read(65536):
                data = bytearray(data)
                if self.flip_at is not None and sent <= self.flip_at < sent + len(data):
                    data[self.flip_at - sent] ^= 0x04
                if self.cut_at is not None and sent + len(data) >= self.cut_at:
                    client_w.write(bytes(data[: self.cut_at - sent]))
                    return
                client_w.write(bytes(data))
                sent += len(data)
                await client_w.drain()

        tasks = [asyncio.ensure_future(upstream()), asyncio.ensure_future(downstream())]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            t.cancel()
        for w in (client_w, up_w):
            w.close()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def pair(smol_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("faults")
    with AgentProcess("torch", smol_dir, home / "p") as p, AgentProcess("torch", smol_dir, home / "d") as d, \
            AgentProcess("torch", smol_dir, home / "other", "--context-length", "4096") as other:
        yield p, d, other


def error_of(lines: list[dict]) -> dict:
    assert "error" in lines[-1], lines[-1]
    assert not any("token" in line for line in lines), "a damaged stream must decode nothing"
    return lines[-1]["error"]


@pytest.mark.parametrize("damage, kind, message", [
    (dict(flip_at=300_000), "FrameError", "checksum mismatch on page 0"),
    (dict(flip_at=1_800_000), "FrameError", "checksum mismatch on page 1"),
    (dict(cut_at=700_000), "FrameError", "broke off"),
    (dict(cut_at=1_474_800), "FrameError", "broke off"),
])
def test_damaged_stream(pair, long_ids, damage, kind, message):
    p, d, _ = pair
    proxy = TamperProxy(p.port, **damage)
    try:
        lines = run(pd_request(p.url, d.url, prompt(long_ids, 150), {"max_tokens": 4}, prefill_url=proxy.url))
    finally:
        proxy.close()
    error = error_of(lines)
    assert error["type"] == kind and message in error["message"], error
    settle(p, d)


def test_wrong_token_list(pair, long_ids):
    p, d, _ = pair
    ids = prompt(long_ids, 150)
    lines = run(pd_request(p.url, d.url, ids, {"max_tokens": 4}, d_token_ids=ids[:-1] + [ids[-1] + 1]))
    error = error_of(lines)
    assert error["type"] == "ContractMismatch" and error["fields"] == ["token_ids"]
    settle(p, d)


def test_wrong_contract_refused_by_prefiller(pair, long_ids):
    p, _, other = pair
    with pytest.raises(AgentHTTPError) as e:
        run(pd_request(p.url, other.url, prompt(long_ids, 70), {"max_tokens": 4}))
    assert e.value.status == 409 and "contract" in str(e.value)
    assert p.status()["totals"]["prefills_started"] >= 0
    settle(p, other)


def test_wrong_contract_caught_by_decoder(pair, long_ids):
    """Even if a router skips the prefiller's check, the decoder refuses foreign pages."""
    p, _, other = pair
    error = error_of(run(decode_foreign_pages(p.url, other.url, prompt(long_ids, 70))))
    assert error["type"] == "ContractMismatch" and error["fields"] == ["contract fingerprint"]
    settle(p, other)


def test_protocol_version_mismatch_is_explained(pair):
    p, _, _ = pair
    with p.client() as c:
        r = c.get("/v1/info", headers={"X-Tandem-Protocol": "99"})
    assert r.status_code == 400 and "protocol 99" in r.json()["error"]["message"]
