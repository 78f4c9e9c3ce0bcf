"""An engine that runs as its own server process (vLLM, SGLang): start it from its own virtual
environment, wait until it is healthy, restart it if it dies, stop it with the agent.

Subclasses say how to start it (`command`, `environment`) and where its health check is.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from tandem_protocol.errors import TandemError
from tandem_protocol.page_memory import malloc_env

REPO = Path(__file__).resolve().parent.parent
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)  # not passed on
# The agent's own polls (its figures every few seconds, health checks) in the server's access log:
# a log tail is read for what went wrong, and these would push it out.
POLL_LINE = re.compile(r'"GET /(metrics|health)\S* HTTP/[\d.]+" \d{3}')
# A key in a server's log: SGLang (0.5.23) logs its arguments as it starts,
# `server_args={…, 'api_key': '…', …}`, and a log tail goes into errors, which reach the panel and
# its log. As an option (`--api-key X`, `--admin-api-key=X`) or a field (a repr, a dict's entry).
API_KEY_ARG = re.compile(r"""(-api-key(?:=|\s+)|api_key['"]?\s*[:=]\s*['"]?)[^\s'",)}]++""", re.IGNORECASE)
REDACTED = "<redacted>"
LOG_TAIL_BYTES = 64 * 1024  # of a server's log, read for its tail
LOG_TAIL_LINE = 1000  # characters of a line of it, at most


def engine_python(engine: str, explicit: Path | None, env_var: str, venv: str, make_target: str) -> Path:
    """The interpreter an engine runs under: `explicit` (the setting `env_var`) if given, else
    the repository's `venv`."""
    path = explicit or REPO / venv / "bin" / "python"
    if not path.exists():
        raise TandemError(
            f"{engine} is not installed: no interpreter at {path} (run `make {make_target}`, "
            f"or point {env_var} at a Python with {engine} installed)"
        )
    return path


def _die_with_parent() -> None:
    """In the child, before exec: on Linux, take SIGTERM when the agent dies, however it dies
    (a killed agent must not leave an engine holding memory). Elsewhere, clean shutdown covers it."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a server's whole process group (it leads one: start_new_session) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


class ServerProcess:
    """One engine server process, restarted if it dies (a crash fails the requests in flight)."""

    engine = "engine"
    health_path = "/health"  # open without the key, on both engines
    api_key_env = "ENGINE_SERVER_KEY"  # where the server finds its key
    # A port found free can be taken by another process before the server binds it (engines
    # starting side by side pick theirs the same way): a start that fails on a port in use picks
    # new ports and tries again, this many times in all.
    port_attempts = 3

    def __init__(self, log_path: Path, start_timeout: float):
        self.log_path, self.start_timeout = log_path, start_timeout
        # The server listens on loopback, where any local user or web page can reach it: it takes
        # requests with this key only, which its agent alone holds (given in its environment,
        # which other users cannot read, never on its command line, which they can)
        self.api_key = secrets.token_urlsafe(32)
        self.pick_ports()
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._stopping = False
        self._restarting = False  # restart() asked for it: not a crash
        self._started = threading.Event()  # set each time the server is healthy
        self._supervisor: threading.Thread | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        """The agent's environment less its secrets (the cluster key, any other key, token or
        password; `start` adds the server's own key, as `api_key_env`); the engine never downloads weights
        or tokenizers either, and keeps freed page buffers for the next request
        (tandem_protocol/page_memory.py)."""
        return {
            **malloc_env(),
            **{k: v for k, v in os.environ.items() if not SECRET_NAME.search(k)},
            "PYTHONPATH": str(REPO),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }

    def pick_ports(self) -> None:
        """The ports the server will bind (a subclass adds those its engine needs besides HTTP)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        for attempt in range(1, self.port_attempts + 1):
            log = open(self.log_path, "ab")
            logged_before = log.tell()
            self.proc = subprocess.Popen(
                self.command(),
                env={**self.environment(), self.api_key_env: self.api_key},
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=str(REPO),
                preexec_fn=_die_with_parent,
            )
            log.close()
            try:
                self._wait_healthy()
                break
            except TandemError:
                exited = self.proc.poll() is not None  # (not a start that timed out)
                if attempt == self.port_attempts or not exited or not self._port_was_taken(logged_before):
                    raise
                _kill_group(self.proc)
                sys.stderr.write(f"tandem: a port of {self.engine} was taken while it started; trying new ports\n")
                self.pick_ports()
        self._started.set()
        if self._supervisor is None:
            self._supervisor = threading.Thread(
                target=self._supervise, name=f"tandem-{self.engine}-supervisor", daemon=True
            )
            self._supervisor.start()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise TandemError(
                    f"{self.engine} exited with code {self.proc.returncode} while starting: {self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + self.health_path, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)  # a process start-up has no event to wait on; half-second checks, bounded
        self.stop()
        raise TandemError(f"{self.engine} did not become healthy within {self.start_timeout:.0f} s: {self.log_tail()}")

    def _supervise(self) -> None:
        """Wait for the server to exit; unless we stopped it, start it again. Restarts happen on
        this one long-lived thread: a child's parent-death signal fires when the thread that
        started it ends, so a short-lived restart thread would kill what it started."""
        while True:
            proc = self.proc
            code = proc.wait()
            _kill_group(proc)  # its children (schedulers, workers), should they outlive it
            if self._stopping:
                return
            if self._restarting:
                self._restarting = False
            else:
                self.restarts += 1
                sys.stderr.write(
                    f"tandem: {self.engine} exited with code {code}; restarting (restart {self.restarts})\n"
                )
            try:
                self.start()
            except TandemError as e:
                sys.stderr.write(f"tandem: {self.engine} restart failed: {e}\n")
                return

    def restart(self) -> None:
        """Stop the server and start it again with its command as it is now (a changed start-up
        option); returns once it is healthy. The supervisor starts it, on its own thread."""
        self._started.clear()
        self._restarting = True
        os.killpg(self.proc.pid, signal.SIGTERM)
        if not self._started.wait(self.start_timeout + 60):
            raise TandemError(f"{self.engine} did not come back after a restart: {self.log_tail()}")

    def _port_was_taken(self, offset: int) -> bool:
        """Whether this start's part of the log (from byte `offset`) says a bind found its port in use."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return b"address already in use" in f.read().lower()
        except OSError:
            return False

    def log_tail(self, lines: int = 15) -> str:
        """The log's last `lines` lines but the agent's own polls, each cut to LOG_TAIL_LINE
        characters, with any key redacted: it goes into error messages."""
        try:
            with open(self.log_path, "rb") as f:
                start = f.seek(max(0, f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        text = API_KEY_ARG.sub(rf"\1{REDACTED}", text.replace(self.api_key, REDACTED))
        logged = text.splitlines()[1 if start else 0 :]  # (a line read from its middle could hold a piece of a key)
        kept = [line for line in logged if not POLL_LINE.search(line)][-lines:]
        return "\n".join(line if len(line) <= LOG_TAIL_LINE else line[:LOG_TAIL_LINE] + " …" for line in kept)

    def stop(self) -> None:
        self._stopping = True
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
