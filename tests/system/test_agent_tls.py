"""Agents serving HTTPS with a self-signed certificate: P/D over TLS, trust through TANDEM_CA_FILE."""

from __future__ import annotations

import asyncio
import subprocess

import pytest

from tandem_protocol.client import AgentClient, TransportError
from tandem_protocol.settings import settings
from tests.agents import AgentProcess, generate_request, pd_request, settle, side_by_side, tokens_of

SAMPLING = {"max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-keyout",
            d / "key.pem",
            "-out",
            d / "cert.pem",
            "-subj",
            "/CN=tandem-test",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return d / "cert.pem", d / "key.pem"


def test_pd_over_tls(smol_dir, long_ids, cert, tmp_path, monkeypatch):
    cert_file, key_file = cert
    trust = {"TANDEM_CA_FILE": str(cert_file)}
    tls = ("--tls-cert", str(cert_file), "--tls-key", str(key_file))
    with side_by_side(
        lambda: AgentProcess("torch", smol_dir, tmp_path / "p", *tls, env=trust),
        lambda: AgentProcess("mlx", smol_dir, tmp_path / "d", *tls, env=trust),
    ) as (p, d):
        assert p.url.startswith("https://") and d.url.startswith("https://")
        ids = list(long_ids[:130])
        monkeypatch.setenv("TANDEM_CA_FILE", str(cert_file))  # this process routes, as a panel would
        settings.cache_clear()  # a process reads its settings once: read them again
        over_tls = tokens_of(asyncio.run(pd_request(p.url, d.url, ids, SAMPLING)))
        alone = tokens_of(asyncio.run(generate_request(d.url, ids, SAMPLING)))
        assert over_tls == alone and len(over_tls) == SAMPLING["max_tokens"]
        settle(p, d)

        # without the CA, a client refuses the self-signed certificate and says so
        monkeypatch.delenv("TANDEM_CA_FILE")
        settings.cache_clear()

        async def untrusted():
            client = AgentClient(p.url, p.key)
            try:
                await client.info()
            finally:
                await client.aclose()

        with pytest.raises(TransportError, match="certificate verify failed"):
            asyncio.run(untrusted())
