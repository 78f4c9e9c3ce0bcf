"""Issue 43, M3: `tandem agent status` and `tandem agent bench-link` send the cluster key only to the
agent's own TLS certificate, pinned by fingerprint (`--fingerprint`, or one of the certificates
of the agents of this machine's data dir), checked in the handshake before any byte of the
request; plain `http://` only when told `--insecure-http`.

It starts its own agent: one serving HTTPS with its own certificate, as a user's agent does (the
shared cluster's agents serve plain HTTP to the tests), in a data dir the CLI reads the pin from;
on the default port 7411 when that is free, so the default URL is tried too. The attacks point the
CLI at sockets the test runs (tests/unit/test_bench_panel_pins.py): a plain TCP listener that
keeps every byte it is sent, what a sniffer on the LAN reads, and an HTTPS impostor.
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from tandem_protocol.tls import spaced

from ..agents import TANDEM, TEST_KEY, AgentProcess
from ..unit.test_bench_panel_pins import HttpsServer, RawListener

DEFAULT_PORT = 7411


def _free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(
            socket.SOL_SOCKET, socket.SO_REUSEADDR, 1
        )  # as the agent binds: a closed one's TIME_WAIT is no owner
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.fixture(scope="module")
def agent(smol_dir, tmp_path_factory):
    port = DEFAULT_PORT if _free(DEFAULT_PORT) else 0
    with AgentProcess("torch", smol_dir, tmp_path_factory.mktemp("pinned"), port=port, tls=True) as a:
        yield a


def tandem(home: Path, *args: str) -> subprocess.CompletedProcess:
    """`tandem agent …` with the cluster key and `home` as its data dir (its known certificates)."""
    env = {**os.environ, "TANDEM_HOME": str(home), "TANDEM_CLUSTER_KEY": TEST_KEY, "COLUMNS": "200"}
    return subprocess.run([TANDEM, "agent", *args], capture_output=True, text=True, env=env, timeout=120)


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def refused(result: subprocess.CompletedProcess, why: str) -> None:
    out = " ".join((result.stdout + result.stderr).split())  # the error box wraps its lines
    assert result.returncode != 0 and why in out and "was not sent" in out, out


COMMANDS = [("status",), ("bench-link", "--pages", "5")]


def test_status_and_bench_link_pin_the_agents_certificate(agent, tmp_path):
    """Over HTTPS with the agent's certificate pinned: from the agent's own data dir (this machine's
    agents' certificates), or given with --fingerprint as the agent printed it, from anywhere."""
    elsewhere = tmp_path / "elsewhere"  # a data dir that knows no certificate
    url = f"https://127.0.0.1:{agent.port}"
    assert agent.name in ok(tandem(agent.home, "status", url))
    assert agent.name in ok(tandem(elsewhere, "status", url, "--fingerprint", spaced(agent.fingerprint)))
    assert "5 pages" in ok(tandem(agent.home, "bench-link", url, "--pages", "5"))
    assert "5 pages" in ok(tandem(elsewhere, "bench-link", url, "--pages", "5", "--fingerprint", agent.fingerprint))


def test_status_with_no_url_reaches_this_machines_agent(agent):
    """What a newcomer types first: the default URL is this machine's agent, over HTTPS, pinned."""
    if agent.port != DEFAULT_PORT:
        pytest.skip(f"port {DEFAULT_PORT} was taken when the agent started")
    assert agent.name in ok(tandem(agent.home, "status"))


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_plain_http_sends_no_key_without_insecure_http(agent, tmp_path, command):
    """The attack: the README's old `tandem agent status http://host:7411`, with a sniffer on the
    link (the listener keeps what crosses it). Refused before anything is sent; with
    --insecure-http (an agent started with it) the key goes, as asked."""
    with RawListener() as sniffed:
        result = tandem(agent.home, command[0], sniffed.url, *command[1:])
        assert TEST_KEY.encode() not in sniffed.received  # the key never crossed in clear
        refused(result, "plain HTTP")
        assert sniffed.connections == []
        tandem(agent.home, command[0], sniffed.url, *command[1:], "--insecure-http")
        assert f"Bearer {TEST_KEY}".encode() in sniffed.received


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_https_without_the_agents_pin_sends_no_key(agent, tmp_path, command):
    """https:// to a listener with no pin known; to an impostor presenting a certificate of its own
    with the agent's pin (given, or known from the data dir); to the real agent with a wrong pin:
    each refused before the request, so neither listener gets the key."""
    elsewhere = tmp_path / "elsewhere"
    name, extra = command[0], command[1:]
    with RawListener() as sniffed, HttpsServer(tmp_path / "impostor") as impostor:
        tls_url = sniffed.url.replace("http://", "https://")
        result = tandem(elsewhere, name, tls_url, *extra)
        assert TEST_KEY.encode() not in sniffed.received and sniffed.connections == []
        refused(result, "no TLS certificate is known here")
        for home, pin in ((elsewhere, ("--fingerprint", agent.fingerprint)), (agent.home, ())):
            result = tandem(home, name, impostor.url, *extra, *pin)
            assert impostor.requests == []  # not one request, so not the key
            refused(result, f"presents the TLS certificate {spaced(impostor.fingerprint)}")
        wrong = "ab" * 32
        refused(
            tandem(elsewhere, name, f"https://127.0.0.1:{agent.port}", *extra, "--fingerprint", wrong), "not the one"
        )
