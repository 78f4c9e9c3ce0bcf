"""An engine that runs as its own server process (vLLM, SGLang): start it from its own virtual
environment, wait until it is healthy, restart it if it dies, stop it with the agent.

Subclasses say how to start it (`command`, `environment`) and where its health check is.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from .errors import TandemError

REPO = Path(__file__).resolve().parent.parent


def engine_python(engine: str, env_var: str, venv: str, make_target: str) -> Path:
    """The interpreter an engine runs under: `env_var` if set, else the repository's `venv`."""
    explicit = os.environ.get(env_var)
    path = Path(explicit) if explicit else REPO / venv / "bin" / "python"
    if not path.exists():
        raise TandemError(f"{engine} is not installed: no interpreter at {path} (run `make {make_target}`, "
                          f"or point {env_var} at a Python with {engine} installed)")
    return path


def _die_with_parent() -> None:
    """In the child, before exec: on Linux, take SIGTERM when the agent dies, however it dies
    (a killed agent must not leave an engine holding memory). Elsewhere, clean shutdown covers it."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class EngineServer:
    """One engine server process, restarted if it dies (a crash fails the requests in flight)."""

    engine = "engine"
    health_path = "/health"
    start_timeout = 600.0

    def __init__(self, log_path: Path):
        self.log_path = log_path
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._stopping = False
        self._supervisor: threading.Thread | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

    def start(self) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), env=self.environment(), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, cwd=str(REPO),
                                     preexec_fn=_die_with_parent)
        log.close()
        self._wait_healthy()
        if self._supervisor is None:
            self._supervisor = threading.Thread(target=self._supervise, name=f"tandem-{self.engine}-supervisor",
                                                daemon=True)
            self._supervisor.start()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise TandemError(f"{self.engine} exited with code {self.proc.returncode} while starting: "
                                  f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + self.health_path, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)  # a process start-up has no event to wait on; half-second checks, bounded
        self.stop()
        raise TandemError(f"{self.engine} did not become healthy within {self.start_timeout:.0f} s: "
                          f"{self.log_tail()}")

    def _supervise(self) -> None:
        """Wait for the server to exit; unless we stopped it, start it again. Restarts happen on
        this one long-lived thread: a child's parent-death signal fires when the thread that
        started it ends, so a short-lived restart thread would kill what it started."""
        while True:
            proc = self.proc
            code = proc.wait()
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its children (schedulers, workers), should they outlive it
            except ProcessLookupError:
                pass
            if self._stopping:
                return
            self.restarts += 1
            sys.stderr.write(f"tandem: {self.engine} exited with code {code}; restarting (restart {self.restarts})\n")
            try:
                self.start()
            except TandemError as e:
                sys.stderr.write(f"tandem: {self.engine} restart failed: {e}\n")
                return

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        self._stopping = True
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
