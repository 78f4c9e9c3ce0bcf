"""The supervision of engines that run as their own servers (engine_adapters/server_process.py),
with a tiny HTTP server standing in for vLLM or SGLang: the start-up path that does not need one."""

from __future__ import annotations

import socket
import sys

import pytest

from engine_adapters.server_process import ServerProcess
from tandem_protocol.errors import TandemError

# binds the port it is given (as vLLM and SGLang do theirs) and answers /health
SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


class TinyServer(ServerProcess):
    engine = "tiny"

    def command(self) -> list[str]:
        return [sys.executable, "-c", SERVER, str(self.port)]


def test_a_port_taken_before_the_server_binds_it_is_picked_again(tmp_path, capfd):
    """Engines started side by side pick free ports the same way, so one can take another's before
    it binds: that start fails on "address already in use", and a new port is tried."""
    server = TinyServer(tmp_path / "tiny.log", start_timeout=30.0)
    taken = server.port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))  # not listening: the health check is refused, not held
        server.start()
        try:
            assert server.port != taken and server.proc.poll() is None
            assert "address already in use" in (tmp_path / "tiny.log").read_text().lower()
            assert "was taken while it started; trying new ports" in capfd.readouterr().err
        finally:
            server.stop()


def test_a_server_that_cannot_bind_at_all_fails_with_its_log(tmp_path, monkeypatch):
    """Every attempt finds its port taken: the last failure is raised, with the log's tail."""
    server = TinyServer(tmp_path / "tiny.log", start_timeout=30.0)
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))  # bound, not listening: a health check is refused at once, not left hanging
    monkeypatch.setattr(server, "pick_ports", lambda: None)  # always the same, taken port
    server.port = squatter.getsockname()[1]
    server.url = f"http://127.0.0.1:{server.port}"
    try:
        with pytest.raises(TandemError, match="(?s)tiny exited with code 1 while starting.*ddress already in use"):
            server.start()
        assert (tmp_path / "tiny.log").read_text().lower().count("address already in use") == server.port_attempts
    finally:
        squatter.close()


def test_a_log_tail_leaves_out_the_agents_own_polls(tmp_path):
    """A failure's message quotes the server's log tail; the agent's figures polls (every request
    and every few seconds) would fill it, so they are left out and the lines around them kept."""
    server = TinyServer(tmp_path / "tiny.log", start_timeout=30.0)
    polls = [
        f'[t] INFO:     127.0.0.1:4{i} - "GET /{p} HTTP/1.1" 200 OK' for i, p in enumerate(["metrics", "health"] * 10)
    ]
    kept = ["Scheduler hit an exception: ValueError", '[t] INFO:     127.0.0.1:42 - "POST /generate HTTP/1.1" 200 OK']
    (tmp_path / "tiny.log").write_text("\n".join(["start", kept[0], *polls, kept[1], *polls]) + "\n")
    assert server.log_tail(2) == "\n".join(kept)
    assert server.log_tail(3) == "\n".join(["start", *kept])
