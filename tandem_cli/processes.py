"""Tandem services as child processes: started, awaited until they say "ready on URL", stopped.

Used by `tandem up` (the one-machine product behind `make run`) and by the tests. A service is
ready when it logs its own "ready on <url>" line — read from its output, so nothing polls.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

TANDEM = str(Path(sys.executable).with_name("tandem"))


def agent_serve_args(
    engine: str, model: Path | str, *extra: str, host: str = "127.0.0.1", port: int = 0, tls: bool = False
) -> list[str]:
    """`tandem agent serve` for one engine on one model: what `tandem up`, the benchmarks and the
    tests start (mDNS off unless `extra` asks for it). `tls`: HTTPS with the agent's own
    certificate, as a user's agent serves; without it (benchmarks, tests that talk to an agent
    directly) plain HTTP on loopback, unless `extra` gives a certificate."""
    mdns = [] if "--mdns" in extra else ["--no-mdns"]
    plain = [] if tls or "--tls-cert" in extra else ["--insecure-http"]
    return [
        "agent",
        "serve",
        "--engine",
        engine,
        "--model",
        str(model),
        "--host",
        host,
        "--port",
        str(port),
        *extra,
        *mdns,
        *plain,
    ]


class ServiceProcess:
    def __init__(
        self, args: list[str], env: dict[str, str] | None = None, netns: str | None = None, cpus: str | None = None
    ):
        cmd = [TANDEM, *args]
        if cpus:  # pinned to these CPUs (taskset list, e.g. "0" or "2-3"), children included
            cmd = ["taskset", "-c", cpus, *cmd]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        self.proc = subprocess.Popen(
            cmd,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.log: list[str] = []
        self.url: str | None = None
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)
            self._lines.put(line)
        self._lines.put(None)

    def wait_ready(self, timeout: float = 300) -> str:
        """Block until the service logs "ready on <url>"; return the URL."""
        self.url = self.url or self.wait_for(" ready on ", timeout).rsplit(" ready on ", 1)[1].strip()
        return self.url

    def wait_for(self, text: str, timeout: float = 300) -> str:
        """Block until the service prints a line containing `text` (after those already awaited);
        return that line."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no {text!r} after {timeout:.0f} s:\n{''.join(self.log)}") from None
            if line is None:
                raise RuntimeError(f"exited with {self.proc.wait()}:\n{''.join(self.log)}")
            if text in line:
                return line

    def lines_matching(self, prefix: str) -> list[str]:
        return [line for line in self.log if line.startswith(prefix)]

    def stop(self, timeout: float = 30) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
