"""Real agent processes for tests: `tandem agent serve` in a subprocess, ready when it says so."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

TANDEM = str(Path(sys.executable).with_name("tandem"))
TEST_KEY = "tdm_test-cluster-key-0123456789abcdef"


class AgentProcess:
    """One agent in its own process and data dir. Use as a context manager."""

    def __init__(self, engine: str, model: Path, home: Path, *args: str, host: str = "127.0.0.1",
                 port: int = 0, netns: str | None = None, key: str = TEST_KEY):
        self.engine, self.host, self.port, self.key = engine, host, port, key
        home.mkdir(parents=True, exist_ok=True)
        cmd = [TANDEM, "agent", "serve", "--engine", engine, "--model", str(model), "--host", host,
               "--port", str(self.port), "--name", f"{engine}-{home.name}", *args]
        if "--mdns" not in args:
            cmd.append("--no-mdns")
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        env = {**os.environ, "TANDEM_HOME": str(home), "TANDEM_CLUSTER_KEY": key, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log: list[str] = []
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)
            self._lines.put(line)
        self._lines.put(None)

    def wait_ready(self, timeout: float = 180) -> "AgentProcess":
        """Block until the agent logs that it is ready (its own event; no polling)."""
        deadline = time.monotonic() + timeout
        while True:
            line = self._lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                raise RuntimeError(f"agent exited with {self.proc.wait()}:\n{''.join(self.log)}")
            if "ready on" in line and "tandem agent" in line:
                self.port = int(line.rsplit(":", 1)[1])  # the agent picked a free port (--port 0)
                return self

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.key}"}, timeout=60)

    def status(self) -> dict:
        with self.client() as c:
            r = c.get("/v1/status")
            r.raise_for_status()
            return r.json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "AgentProcess":
        return self.wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()


async def pd_request(p_url: str, d_url: str, token_ids: list[int], sampling: dict, mode: str | None = None,
                     key: str = TEST_KEY, room: str | None = None, d_token_ids: list[int] | None = None,
                     prefill_url: str | None = None) -> list[dict]:
    """Route one request P->D the way the panel does: create the handoff on P, then decode on D
    (which pulls P's pages itself). Returns D's NDJSON lines."""
    import uuid

    from node_agent.client import AgentClient

    p, d = AgentClient(p_url, key), AgentClient(d_url, key)
    try:
        info = await d.info()
        mode = mode or info["decoder_modes"][0]
        room = room or uuid.uuid4().hex
        await p.create_handoff(room=room, token_ids=token_ids, sampling=sampling, mode=mode,
                               contract=info["contract"]["fingerprint"])
        return [line async for line in d.lines("/v1/decode", {
            "room": room, "token_ids": d_token_ids or token_ids, "sampling": sampling, "mode": mode,
            "prefill_url": prefill_url or p_url})]
    finally:
        await p.aclose()
        await d.aclose()


def tokens_of(lines: list[dict]) -> list[int]:
    assert "error" not in lines[-1], lines[-1]
    return [line["token"] for line in lines if "token" in line]


class PanelProcess:
    """`tandem panel` in a subprocess; `api_key` holds the key it printed."""

    def __init__(self, home: Path, *args: str, key: str = TEST_KEY):
        env = {**os.environ, "TANDEM_HOME": str(home), "TANDEM_CLUSTER_KEY": key, "PYTHONUNBUFFERED": "1",
               "COLUMNS": "300"}
        self.proc = subprocess.Popen([TANDEM, "panel", "--port", "0", "--api-key", "tests", *args], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log: list[str] = []
        self.api_key = self.admin_password = self.url = None
        for line in self.proc.stdout:
            self.log.append(line)
            if line.startswith("API key"):
                self.api_key = line.split(": ", 1)[1].strip()
            if line.startswith("admin password"):
                self.admin_password = line.rsplit(": ", 1)[1].strip()
            if "tandem panel ready on" in line:
                self.url = line.rsplit(" ", 1)[1].strip()
                break
        if self.url is None:
            raise RuntimeError(f"panel exited with {self.proc.wait()}:\n{''.join(self.log)}")
        threading.Thread(target=lambda: [self.log.append(x) for x in self.proc.stdout], daemon=True).start()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)

    def __enter__(self) -> "PanelProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
