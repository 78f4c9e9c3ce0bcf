"""What a host on the LAN, with no credential, can do to a panel (review M1, M5), against a real
panel process and real sockets: an "agent" whose identity answer never ends (too long, or a
trickle) costs the panel neither memory nor more than the check's deadline, and a panel that other
machines can reach does not serve plain HTTP unless told to.

Each test starts its own panel: the claims are about the panel's own process (its memory, its
command line), which no shared cluster's panel shows alone."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import httpx
import pytest

from control_panel import services
from tandem_cli.processes import ServiceProcess

from ..agents import TEST_KEY, AgentProcess, LocalHTTPServer

MIB = 1 << 20
# services.IDENTITY_DEADLINE and MAX_IDENTITY_ANSWER (written out, so this file runs on a panel
# from before them: that they hold is what it checks)
IDENTITY_DEADLINE, MAX_IDENTITY_ANSWER = 10.0, 64 * 1024
FLOOD_BYTES = 256 * MIB  # what the impostor offers at full speed before it trickles on


def start_panel(home: Path, *args: str) -> ServiceProcess:
    """`tandem panel` as a user starts it: only `args` (no --no-mdns, unlike tests/agents.py's
    PanelProcess: what it does by default is under test)."""
    return ServiceProcess(
        ["panel", "--port", "0", "--api-key", "tests", *args],
        env={"TANDEM_HOME": str(home), "TANDEM_CLUSTER_KEY": TEST_KEY, "COLUMNS": "300"},
    )


def vm_rss(pid: int) -> int:
    """The process's resident memory now, in bytes."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) * 1024


class EndlessIdentity(LocalHTTPServer):
    """An "agent" on 127.0.0.1 (anyone can announce an address by mDNS, or be typed in the Add node
    form): up on /healthz, and an identity answer that never ends — `flood_bytes` at full speed,
    then a byte every `trickle_every` seconds for as long as the panel reads. Records what it got out."""

    def __init__(self, flood_bytes: int, trickle_every: float):
        self.flood_bytes, self.trickle_every = flood_bytes, trickle_every
        self.sent, self.hung_up = 0, False
        self.flood_over, self.stopping = threading.Event(), threading.Event()
        super().__init__(EndlessHandler)

    def __exit__(self, *exc):
        self.stopping.set()
        super().__exit__(*exc)


class EndlessHandler(BaseHTTPRequestHandler):
    server: EndlessIdentity

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def do_POST(self):
        server = self.server
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(1 << 50))  # "it is coming"
        self.end_headers()
        chunk = b" " * MIB
        try:
            self.wfile.write(b'{"node_id": ')
            while server.sent < server.flood_bytes:
                self.wfile.write(chunk)
                server.sent += len(chunk)
            server.flood_over.set()
            while not server.stopping.wait(server.trickle_every):
                self.wfile.write(b" ")
                server.sent += 1
        except (BrokenPipeError, ConnectionResetError):
            server.hung_up = True
        finally:
            server.flood_over.set()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def panel(tmp_path_factory):
    service = start_panel(tmp_path_factory.mktemp("lan-hardening"))
    try:
        url = service.wait_ready(120)
        ready = next(line for line in service.log if "Tandem panel on" in line)
        password = service.lines_matching("admin password")[-1].rsplit(": ", 1)[1].strip()
        with httpx.Client(base_url=url, timeout=3 * IDENTITY_DEADLINE + 30) as c:
            r = c.post("/login", data={"password": password, "csrf": csrf_of(c.get("/login").text)})
            assert r.status_code == 303
            yield {"service": service, "client": c, "ready": ready}
    finally:
        service.stop()


def csrf_of(html: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', html).group(1)


def add_node(c: httpx.Client, url: str) -> httpx.Response:
    """The admin's Add node form, which asks the agent at `url` to prove its identity."""
    return c.post("/nodes", data={"url": url, "csrf": csrf_of(c.get("/nodes").text)})


def test_a_loopback_panel_listens_to_no_lan(panel):
    """Bound to 127.0.0.1 (the default) it reaches no other machine's agent, so it does not listen
    for announcements unless told to (M6): its Settings page says discovery is off."""
    assert "Tandem panel on http://127.0.0.1:" in panel["ready"] and "mDNS on" not in panel["ready"]
    state = re.search(r'<p id="discovery-state">([^<]*)', panel["client"].get("/settings").text).group(1)
    assert state.startswith("mDNS discovery is off"), state


def test_an_endless_identity_answer_costs_the_panel_no_memory(panel):
    """M1: the identity answer offers 256 MiB at full speed, then trickles on. The panel reads at
    most MAX_IDENTITY_ANSWER of it and hangs up: its resident memory grows by a small fraction of
    what was offered (reading it all, it grew by the whole), the form says why, and the panel
    answers on."""
    c, pid = panel["client"], panel["service"].proc.pid
    c.get("/nodes")
    before = vm_rss(pid)
    with EndlessIdentity(FLOOD_BYTES, trickle_every=0.5) as impostor, ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        answer = pool.submit(add_node, c, impostor.url)
        assert impostor.flood_over.wait(3 * IDENTITY_DEADLINE + 30)  # hung up on, or all of it sent
        grown = vm_rss(pid) - before
        print(
            f"\nidentity answer: {impostor.sent / MIB:.1f} MiB got out of {FLOOD_BYTES / MIB:.0f} MiB offered "
            f"(hung up on: {impostor.hung_up}); the panel's RSS grew {grown / MIB:.1f} MiB"
        )
        assert grown < FLOOD_BYTES / 8, f"the panel's RSS grew by {grown / MIB:.0f} MiB"
        assert impostor.hung_up and impostor.sent < FLOOD_BYTES
        r = answer.result(timeout=3 * IDENTITY_DEADLINE)
        elapsed = time.monotonic() - started
    assert r.status_code == 400 and f"more than {MAX_IDENTITY_ANSWER} bytes" in r.text, r.text[-2000:]
    assert elapsed < IDENTITY_DEADLINE, elapsed  # the cap, not the deadline, ended it
    assert c.get("/healthz").status_code == 200 and c.get("/nodes").status_code == 200


def test_a_trickled_identity_answer_ends_at_the_deadline(panel):
    """M1: an identity answer that trickles a byte every 0.2 s (each read is quick, so a per-read
    timeout never fires) ends at the check's total deadline; the form says so."""
    c = panel["client"]
    with EndlessIdentity(0, trickle_every=0.2) as impostor:
        started = time.monotonic()
        try:
            r = add_node(c, impostor.url)
        except httpx.TimeoutException:
            pytest.fail(f"no answer to the Add node form after {time.monotonic() - started:.0f} s")
        elapsed = time.monotonic() - started
    print(f"\ntrickled identity answer: refused after {elapsed:.1f} s ({impostor.sent} bytes sent)")
    assert r.status_code == 400 and f"no whole answer to the identity check within {IDENTITY_DEADLINE:.0f} s" in r.text
    # from the deadline on (plus the liveness probe before it, and a loaded machine's margin)
    assert IDENTITY_DEADLINE <= elapsed < 3 * IDENTITY_DEADLINE, elapsed
    assert c.get("/healthz").status_code == 200
    assert (services.IDENTITY_DEADLINE, services.MAX_IDENTITY_ANSWER) == (IDENTITY_DEADLINE, MAX_IDENTITY_ANSWER)


def test_a_panel_on_the_network_serves_plain_http_only_when_told(tmp_path):
    """M5: `--host 0.0.0.0` (reachable from other machines) without TLS refuses to start, saying
    how to go on; with --insecure-http it serves plain HTTP, warning; with --tls, HTTPS."""
    refused = start_panel(tmp_path / "refused", "--host", "0.0.0.0", "--no-mdns")
    with pytest.raises(RuntimeError, match="--host 0.0.0.0 is reachable from other machines") as e:
        refused.wait_ready(120)
    assert refused.proc.wait() == 2 and "--insecure-http" in str(e.value) and "--tls" in str(e.value)
    both = start_panel(tmp_path / "both", "--host", "0.0.0.0", "--tls", "--insecure-http", "--no-mdns")
    with pytest.raises(RuntimeError, match="--insecure-http serves no certificate"):
        both.wait_ready(120)

    plain = start_panel(tmp_path / "plain", "--host", "0.0.0.0", "--insecure-http", "--no-mdns")
    try:
        port = plain.wait_ready(120).rsplit(":", 1)[1]
        assert plain.lines_matching("plain HTTP: the admin password, API keys, prompts and answers cross the network")
        assert httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
    finally:
        plain.stop()
    tls = start_panel(tmp_path / "tls", "--host", "0.0.0.0", "--tls", "--no-mdns")
    try:
        url = tls.wait_ready(120)
        assert url.startswith("https://") and not tls.lines_matching("plain HTTP")
        port = url.rsplit(":", 1)[1]
        assert httpx.get(f"https://127.0.0.1:{port}/healthz", verify=False).status_code == 200
    finally:
        tls.stop()


def test_an_agent_typed_as_http_is_added_at_its_https_address(panel, tiny_dir, tmp_path):
    """UX walk finding 3: agents serve HTTPS unless told otherwise, but the Help page and the form's
    placeholder said http://, and the form then answered "unreachable (RemoteProtocolError: Server
    disconnected …)". An http:// address nothing answers on is tried as https://: the node is
    added there (after proving its identity, as any)."""
    with AgentProcess("torch", tiny_dir, tmp_path / "agent", tls=True) as agent:
        assert agent.url.startswith("https://")
        typed = "http://" + agent.url.removeprefix("https://")
        r = add_node(panel["client"], typed)
        assert r.status_code == 303, r.text[-2000:]
        table = panel["client"].get("/nodes/table").text
        assert agent.url in table and typed not in table, table[-2000:]
