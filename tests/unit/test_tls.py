"""The agent's own certificate and pinning it (tandem_protocol/tls.py), in-process: the pin holds on
every transport a Tandem client uses, and the identity proof is bound to the certificate."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import threading

import httpx
import pytest
from pydantic import ValidationError

from tandem_protocol.api import BenchLinkBody, DecodeBody
from tandem_protocol.auth import identity_answer, new_nonce, proof_matches
from tandem_protocol.tls import (
    PinMismatch,
    certificate_fingerprint,
    client_context,
    ensure_certificate,
    peer_fingerprint,
    server_context,
    spaced,
)


def test_a_certificate_is_made_once_with_a_private_key(tmp_path):
    cert, key = ensure_certificate(tmp_path / "tls", "node")
    assert oct(key.stat().st_mode & 0o777) == "0o600" and oct((tmp_path / "tls").stat().st_mode & 0o777) == "0o700"
    fp = certificate_fingerprint(cert)
    assert ensure_certificate(tmp_path / "tls", "node") == (cert, key) and certificate_fingerprint(cert) == fp
    # the fingerprint people compare is OpenSSL's
    out = subprocess.run(["openssl", "x509", "-in", cert, "-noout", "-fingerprint", "-sha256"], capture_output=True)
    assert out.stdout.decode().strip().split("=", 1)[1] == spaced(fp)


@pytest.fixture
def server(tmp_path):
    """An HTTPS server (a thread) answering 200 to anything, and its certificate's fingerprint."""
    cert, key = ensure_certificate(tmp_path, "server")
    loop = asyncio.new_event_loop()

    async def handle(r, w):
        try:
            await r.readuntil(b"\r\n\r\n")
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
            await w.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # a client that refused the certificate hangs up
        w.close()

    srv = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_context(cert, key)))
    threading.Thread(target=loop.run_forever, daemon=True).start()
    yield f"https://127.0.0.1:{srv.sockets[0].getsockname()[1]}", certificate_fingerprint(cert)
    loop.call_soon_threadsafe(srv.close)
    loop.call_soon_threadsafe(loop.stop)


def test_the_pin_holds_on_every_transport(server):
    url, fp = server
    wrong = "0" * 64
    # blocking (httpx.Client: SSLSocket) and asyncio (httpx.AsyncClient: SSLObject)
    assert httpx.get(url, verify=client_context(fp)).text == "ok"
    with pytest.raises(httpx.ConnectError, match="not the one pinned"):
        httpx.get(url, verify=client_context(wrong))

    async def both():
        async with httpx.AsyncClient(verify=client_context(fp)) as c:
            assert (await c.get(url)).text == "ok"
        async with httpx.AsyncClient(verify=client_context(wrong)) as c:
            with pytest.raises(httpx.ConnectError, match="not the one pinned"):
                await c.get(url)
        port = int(url.rsplit(":", 1)[1])
        with pytest.raises(PinMismatch):  # the page receiver's raw asyncio connection
            await asyncio.get_running_loop().create_connection(
                asyncio.Protocol, "127.0.0.1", port, ssl=client_context(wrong), server_hostname="127.0.0.1"
            )

    asyncio.run(both())
    # a first contact pins nothing and records what it saw
    ctx = client_context(None)
    assert httpx.get(url, verify=ctx).text == "ok" and ctx.seen == fp
    host, port = url.removeprefix("https://").split(":")
    assert peer_fingerprint(host, int(port)) == fp
    with pytest.raises(OSError):  # nothing listens there
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            peer_fingerprint("127.0.0.1", s.getsockname()[1], timeout=1)


def test_the_identity_proof_names_the_certificate():
    key, nonce, node, address = "tdm_" + "k" * 40, new_nonce(), "a" * 32, "10.0.0.2:7411"
    answer = identity_answer(key, nonce, node, address, "f" * 64)
    assert proof_matches(answer, key, nonce, node, address, "f" * 64)
    # the same answer, seen through another certificate (a relay's), proves nothing
    assert not proof_matches(answer, key, nonce, node, address, "e" * 64)
    assert not proof_matches(
        answer.model_copy(update={"tls_fingerprint": "e" * 64}), key, nonce, node, address, "e" * 64
    )


def test_a_pin_goes_with_an_https_url_only():
    DecodeBody(token_ids=[1], prefill_url="https://p:7411", prefill_fingerprint="a" * 64)
    BenchLinkBody(peer="https://p:7411", peer_fingerprint="a" * 64)
    for bad in (
        lambda: DecodeBody(token_ids=[1], prefill_url="http://p:7411", prefill_fingerprint="a" * 64),
        lambda: DecodeBody(token_ids=[1], prefill_fingerprint="a" * 64),
        lambda: BenchLinkBody(peer="http://p:7411", peer_fingerprint="a" * 64),
        lambda: DecodeBody(token_ids=[1], prefill_url="https://p:7411", prefill_fingerprint="A" * 64),
    ):
        with pytest.raises(ValidationError):
            bad()
