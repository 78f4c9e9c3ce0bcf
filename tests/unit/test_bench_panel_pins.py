"""Issue 43, M3: `tandem bench ttft --panel` sends this machine's cluster key to the panel's nodes
only over the TLS certificate the panel pinned for each (checked in the handshake, before any
byte of a request), or over plain HTTP when told `--insecure-http`.

In process: the benchmark's own functions against sockets the test runs, a plain TCP listener that
keeps every byte it is sent (what a sniffer on the LAN reads) and an HTTPS server with a
certificate of its own that records each request. tests/system/test_cli_pins.py uses both for
`tandem agent status` and `bench-link`.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import httpx
import pytest
import typer
from sqlmodel import Session, SQLModel, create_engine

from control_panel.models import Node, Pool, PoolMember
from tandem_cli.bench_ttft.cluster import Agent
from tandem_cli.bench_ttft.probe_agents import decode_step_seconds, prefiller_counters, trace_pd
from tandem_cli.bench_ttft.running_panel import bench_running_panel, pulled_link, ready_agent
from tandem_protocol.tls import certificate_fingerprint, ensure_certificate, server_context

from ..agents import LocalHTTPServer

KEY = "tdm_m3-bench-panel-key-0123456789abcdef"


class RawListener:
    """A plain TCP server on 127.0.0.1 that keeps every byte each connection sends: a request's
    head (headers, Authorization included), answered 200 with no body, or a TLS ClientHello,
    answered nothing; then it hangs up."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections: list[bytes] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def received(self) -> bytes:
        return b"".join(self.connections)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed: the test is over
                return
            with conn:
                conn.settimeout(10)
                data = b""
                try:
                    while chunk := conn.recv(65536):
                        data += chunk
                        if b"\r\n\r\n" in data:  # a request's head: "OK", so a client goes on to its next
                            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                            break
                        if data[:1] == b"\x16":  # a TLS ClientHello
                            break
                except OSError:
                    pass
                self.connections.append(data)

    def __enter__(self) -> RawListener:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept (closing alone does not)
        self.sock.close()
        self._thread.join(10)


class HttpsServer(LocalHTTPServer):
    """An HTTPS server on 127.0.0.1 with a certificate of its own (`fingerprint`), answering each
    path's JSON from `answers` (else {}), recording (method, path, Authorization, body)."""

    def __init__(self, folder: Path, answers: dict[str, object] | None = None):
        cert, key = ensure_certificate(folder, "server")
        self.fingerprint = certificate_fingerprint(cert)
        self.answers = answers or {}
        self.requests: list[tuple[str, str, str, bytes]] = []
        super().__init__(_Handler)
        self.socket = server_context(cert, key).wrap_socket(self.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.server_port}"

    def handle_error(self, request, client_address) -> None:
        pass  # a client that hangs up after the handshake (its pin did not match) is no error here


class _Handler(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.requests.append((self.command, self.path, self.headers.get("Authorization") or "", body))
        answer = self.server.answers.get(self.path.split("?")[0], {})
        data = answer.encode() if isinstance(answer, str) else json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:
        pass


def panel_home(tmp_path: Path, *urls_and_pins: tuple[str, str]) -> Path:
    """A panel's data dir whose database holds one pool with these nodes (the first prefills, the
    last decodes), paired with these URLs and pinned certificates."""
    home = tmp_path / "panel"
    home.mkdir()
    engine = create_engine(f"sqlite:///{home / 'panel.db'}")
    SQLModel.metadata.create_all(engine)
    with Session(engine) as s:
        nodes = [
            Node(name=f"n{i}", url=url, tls_fingerprint=pin, paired=True) for i, (url, pin) in enumerate(urls_and_pins)
        ]
        pool = Pool(name="duo", context_length=2048)
        s.add_all([*nodes, pool])
        s.flush()
        for role, node in (("prefill", nodes[0]), ("decode", nodes[-1])):
            s.add(PoolMember(pool_id=pool.id, node_id=node.id, role=role, engine="torch", model_path="/m"))
        s.commit()
    engine.dispose()
    return home


def run_bench(home: Path, insecure_http: bool = False) -> Exception | None:
    """The benchmark against the panel of `home` (its API at a port where nothing listens): what it
    raised, for the test to check after it has looked at what the nodes received."""
    told = {"insecure_http": True} if insecure_http else {}  # (so the attack runs on code without the option)
    try:
        bench_running_panel({}, "http://127.0.0.1:9", "api-key", home, None, lambda: None, **told)
    except Exception as e:
        return e
    return None


@pytest.fixture(autouse=True)
def cluster_key(monkeypatch):
    monkeypatch.setattr("node_agent.identity.cluster_key", lambda home=None: KEY)


def test_plain_http_nodes_get_no_key_unless_told(tmp_path):
    """The attack: a panel's node at http://…, and a sniffer on that link (the listener keeps what
    crosses it). Without --insecure-http the benchmark refuses before connecting anywhere."""
    with RawListener() as p, RawListener() as d:
        home = panel_home(tmp_path, (p.url, ""), (d.url, ""))
        refused = run_bench(home)
        assert KEY.encode() not in p.received + d.received  # the key never crossed in clear
        assert isinstance(refused, typer.BadParameter) and "plain HTTP" in str(refused), refused
        assert p.connections == d.connections == []  # nothing was even sent
        run_bench(home, insecure_http=True)  # told so: the key goes, readable (the listener then hangs up)
        assert f"Bearer {KEY}".encode() in p.received + d.received


def test_an_https_node_without_a_pin_is_refused(tmp_path):
    with HttpsServer(tmp_path / "tls") as node:
        refused = run_bench(panel_home(tmp_path, (node.url, "")))
        assert node.requests == []
        assert isinstance(refused, typer.BadParameter) and "no TLS certificate pinned" in str(refused), refused


def test_every_probe_sends_the_key_only_to_the_pinned_certificate(tmp_path):
    """Each request the benchmark sends an agent goes through its pin: a server presenting another
    certificate (an impostor at the node's address) gets no request at all; the pinned one gets
    the key, and the decoder is told the prefiller's pin to pull its pages with."""
    answers = {"/v1/info": {"state": "ready", "engine": "torch", "vocab_size": 1000}, "/metrics": ""}
    with HttpsServer(tmp_path / "a", answers) as server, HttpsServer(tmp_path / "b") as impostor:
        right = Agent("p", "torch", server.url, None, tls_fingerprint=server.fingerprint)
        wrong = Agent("d", "torch", server.url, None, tls_fingerprint=impostor.fingerprint)
        probes = {
            "info": lambda a: ready_agent(a, KEY),
            "metrics": lambda a: prefiller_counters(a, KEY),
            "decode step": lambda a: decode_step_seconds(a, KEY, 1000),
            "trace": lambda a: trace_pd(right, a, KEY, [1, 2, 3], 2),
            "link": lambda a: pulled_link(right, a, KEY),
        }
        for name, probe in probes.items():
            with pytest.raises(httpx.ConnectError, match="not the one pinned"):
                probe(wrong)
            assert server.requests == [], name
        ready_agent(right, KEY)
        assert right.info["engine"] == "torch" and server.requests[-1][2] == f"Bearer {KEY}"
        assert pulled_link(right, right, KEY) == {"method": "page stream"}  # what D was asked is checked
        assert json.loads(server.requests[-1][3]) == {
            "peer": server.url,
            "megabytes": 64,
            "peer_fingerprint": server.fingerprint,
        }
        assert "error" in trace_pd(right, right, KEY, [1, 2, 3], 2)  # no token came: what D was asked is checked
        assert json.loads(server.requests[-1][3])["prefill_fingerprint"] == server.fingerprint
