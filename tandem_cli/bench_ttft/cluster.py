"""The benchmark's own cluster: two agents (one per place of the link) and a panel with a pair
per direction."""

from __future__ import annotations

import os
import ssl
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tandem_protocol.tls import client_context

from ..processes import ServiceProcess, agent_serve_args
from .link import Link, Place


@dataclass
class Agent:
    name: str
    engine: str
    url: str
    cpus: str | None
    info: dict = field(default_factory=dict)
    pid: int = 0  # of the agent's process, for whoever measures it
    place: Place | None = None  # where it runs, when the benchmark started it
    tls_fingerprint: str = ""  # the certificate it must present over HTTPS (a panel's pin; "" over plain HTTP)

    def verify(self) -> ssl.SSLContext | bool:
        """How a request to it trusts it: pinned to its certificate, checked before the key is sent."""
        return client_context(self.tls_fingerprint) if self.tls_fingerprint else True


@dataclass
class Cluster:
    url: str  # the panel's
    api_key: str
    agents: list[Agent]
    panel_pid: int
    panel_home: Path  # where the panel keeps panel.db


@contextmanager
def cluster(
    model: Path,
    engines: tuple[str, str],
    link: Link,
    home: Path,
    key: str,
    pin: bool,
    directions: list[tuple[int, int]],
    envs: tuple[dict, dict] = ({}, {}),
    encodings: tuple[str, ...] = ("raw",),
    cores_each: int = 1,
    agent_args: tuple[str, ...] = (),
) -> Iterator[Cluster]:
    """Two agents (one per place) and a panel with a pair per direction, named "P->D" after the
    agents (a-ENGINE, b-ENGINE)."""
    cores = os.cpu_count() or 1
    with ExitStack() as stack:
        procs, agents = [], []
        for i, (engine, place) in enumerate(zip(engines, link.places)):
            name = f"{'ab'[i]}-{engine}"
            first = (i * cores_each) % cores
            cpus = (str(first) if cores_each == 1 else f"{first}-{min(first + cores_each, cores) - 1}") if pin else None
            proc = ServiceProcess(
                # caches off: every sample computes and moves its whole prompt (cold TTFT)
                agent_serve_args(
                    engine, model, "--name", name, "--prefix-cache-bytes", "0", *agent_args, host=place.host
                ),
                env={"TANDEM_HOME": str(home / name), "TANDEM_CLUSTER_KEY": key, **envs[i]},
                netns=place.netns,
                cpus=cpus,
            )
            stack.callback(proc.stop)
            procs.append((proc, place, name, engine, cpus))
        for proc, place, name, engine, cpus in procs:
            port = proc.wait_ready(600).rsplit(":", 1)[1]
            agents.append(Agent(name, engine, f"http://{place.addr}:{port}", cpus, pid=proc.proc.pid, place=place))
        pairs = [
            a
            for p, d in directions
            for a in ("--pair", f"{agents[p].name}->{agents[d].name}={agents[p].url},{agents[d].url},threshold=1")
        ]
        pairs += [
            a
            for encoding in encodings
            if encoding != "raw"
            for p, d in directions  # the same pairs with their pages compressed, or FP8
            for a in (
                "--pair",
                f"{agents[p].name}->{agents[d].name}+{encoding}={agents[p].url},{agents[d].url},{encoding},threshold=1",
            )
        ]
        panel = ServiceProcess(
            ["panel", "--port", "0", "--no-mdns", "--api-key", "bench", *pairs],
            env={"TANDEM_HOME": str(home / "panel"), "TANDEM_CLUSTER_KEY": key, "COLUMNS": "300"},
        )
        stack.callback(panel.stop)
        url = panel.wait_ready()
        api_key = panel.lines_matching("API key")[-1].rsplit(": ", 1)[1].strip()
        for a in agents:
            a.info = httpx.get(a.url + "/v1/info", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()
        yield Cluster(url, api_key, agents, panel.proc.pid, home / "panel" / "panel")
