"""`tandem bench ttft`: time to first token through the panel's OpenAI API, each engine alone and
P→D, against the physical bound measured in the same run.

    bound = max(P's prefill alone, KV bytes ÷ the link's raw TCP throughput) + one decode step on D

(the decode step only where D recomputes the last prompt token, vLLM's way; in commit-first mode
the first token is the one P sampled, so D has nothing to compute before it). The issue that
asked for this benchmark wrote the bound with D's step in every mode; that looser figure is
printed beside it (TTFT ÷ (bound + D step)), the stricter one above is the headline.

The benchmark starts its own cluster (two agents on the embedded model and a panel), either on
loopback or with each agent in its own network namespace, joined by a veth pair shaped with
`tc tbf` to a given rate (`--link shaped`); the panel reaches both over unshaped veths, agents
reach each other only over the shaped one. Each agent is pinned to its own CPU. Per cell: a
warm-up, then `--samples` requests, one at a time, greedy, streaming, distinct random prompts
(no prefix reuse); TTFT is the time from sending the request to the first streamed chunk.
The bound's prefill term is P's engine alone on prompts of the same length, one before each P/D
sample (prefill time on a busy host drifts by tens of percent; measured apart, it would not
be the prefill the P/D samples ran beside).

`--panel URL` benchmarks a panel that is already running instead (on the panel's machine: its
pairs and paired nodes come from its database): nothing is started or pinned, and each pair's
link term is its decoder pulling synthetic pages from its prefiller (the agents' POST
/v1/bench/link) rather than a raw TCP copy.

Output (in --out): ttft-<time>.json (every sample and every bound term), .md (the table) and
.png (TTFT and bound against prompt length).

`--delay-ms` adds a delay each way with `netem` under the token bucket where the kernel has it;
where it has not (this CI machine's kernel), the link has a rate but no added delay, the output
says so, and the measured round-trip time is recorded either way.
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import typer

from control_panel.bench_results import LATEST_TTFT
from tandem_protocol.pages import HEADER_SIZE
from tandem_protocol.settings import data_dir

from .processes import ServiceProcess
from .progress import console

DEFAULT_LENGTHS = "51,184,744,2844"


# ---- where the agents live: loopback, or two namespaces joined by a shaped veth pair ---------------
@dataclass
class Place:
    netns: str | None
    host: str  # address the agent binds
    addr: str  # address peers (and the panel) use


@dataclass
class Link:
    kind: str
    places: tuple[Place, Place]
    rate_mbytes: float | None = None
    delay_ms: float = 0.0  # added each way (0 where asked for none, or where the kernel has no netem)
    namespaces: list[str] = field(default_factory=list)
    ends: list[tuple[str, str]] = field(default_factory=list)  # (namespace, device) of each end of the P<->D link


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


@contextmanager
def loopback_link() -> Iterator[Link]:
    yield Link("loopback", (Place(None, "127.0.0.1", "127.0.0.1"), Place(None, "127.0.0.1", "127.0.0.1")))


@contextmanager
def shaped_link(rate_mbytes: float, delay_ms: float = 0.0) -> Iterator[Link]:
    """Two namespaces A and B. Each reaches the root namespace over its own veth (10.241.{1,2}.0/24);
    A and B are joined by a third veth (10.241.3.1 <-> 10.241.3.2) shaped with tbf on both ends.
    Agents are known by their shaped-link addresses; the root namespace routes to each of those
    through that namespace's own veth, so panel traffic never takes the shaped link."""
    if os.geteuid() != 0:
        raise typer.BadParameter("--link shaped needs root (network namespaces and tc)")
    tag = secrets.token_hex(2)
    a, b = f"tdm-bench-a-{tag}", f"tdm-bench-b-{tag}"
    created: list[str] = []
    rate = f"{int(rate_mbytes * 8)}mbit"
    try:
        for ns, i in ((a, 1), (b, 2)):
            root_end, ns_end = f"tbr{i}{tag}", f"tbn{i}{tag}"
            _sh("ip", "netns", "add", ns)
            created.append(ns)
            _sh("ip", "link", "add", root_end, "type", "veth", "peer", "name", ns_end)
            _sh("ip", "link", "set", ns_end, "netns", ns)
            _sh("ip", "addr", "add", f"10.241.{i}.1/24", "dev", root_end)
            _sh("ip", "link", "set", root_end, "up")
            _sh("ip", "-n", ns, "addr", "add", f"10.241.{i}.2/24", "dev", ns_end)
            _sh("ip", "-n", ns, "link", "set", ns_end, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        la, lb = f"tbla{tag}", f"tblb{tag}"
        _sh("ip", "link", "add", la, "type", "veth", "peer", "name", lb)
        _sh("ip", "link", "set", la, "netns", a)
        _sh("ip", "link", "set", lb, "netns", b)
        delayed = []
        for ns, dev, addr in ((a, la, "10.241.3.1"), (b, lb, "10.241.3.2")):
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            delayed.append(_shape(ns, dev, rate, delay_ms))
        for i, addr in ((1, "10.241.3.1"), (2, "10.241.3.2")):
            _sh("ip", "route", "replace", f"{addr}/32", "via", f"10.241.{i}.2")
        yield Link(
            "shaped",
            (Place(a, "0.0.0.0", "10.241.3.1"), Place(b, "0.0.0.0", "10.241.3.2")),
            rate_mbytes,
            delay_ms if all(delayed) else 0.0,
            created,
            [(a, la), (b, lb)],
        )
    finally:
        for addr in ("10.241.3.1", "10.241.3.2"):
            subprocess.run(["ip", "route", "del", f"{addr}/32"], capture_output=True)
        for ns in created:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _shape(ns: str, dev: str, rate: str, delay_ms: float) -> bool:
    """A token bucket at the link rate on `dev` (burst and queue as a switch port would have them),
    under a netem delay where one is asked for and the kernel has netem. True if delayed."""
    add = ("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev)
    tbf = ("tbf", "rate", rate, "burst", "256kb", "latency", "50ms")
    if (
        delay_ms > 0
        and subprocess.run(
            [*add, "root", "handle", "1:", "netem", "delay", f"{delay_ms}ms"], capture_output=True
        ).returncode
        == 0
    ):
        _sh(*add, "parent", "1:1", "handle", "10:", *tbf)
        return True
    _sh(*add, "root", *tbf)
    return False


# ---- raw TCP between the two places, in the same run ------------------------------------------------
_SINK = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 0)); s.listen(1); print(s.getsockname()[1], flush=True)
c, _ = s.accept(); n = 0; buf = bytearray(1 << 20); t0 = None
while (k := c.recv_into(buf)):
    t0 = t0 or time.perf_counter(); n += k
print(n, time.perf_counter() - t0, flush=True)
"""
_SOURCE = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
chunk = bytes(1 << 20)
for _ in range(int(sys.argv[3])): c.sendall(chunk)
c.close()
"""
_RTT = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
times = []
for _ in range(50):
    t0 = time.perf_counter(); c.sendall(b"p"); c.recv(1); times.append(time.perf_counter() - t0)
print(sorted(times)[len(times) // 2])
"""
_PAGES = """
import asyncio, sys, time
import uvloop
from tandem_protocol.pages import FrameExpectation, PageGeometry
from tandem_protocol.client import AgentClient
url, key, count, contract, layers, heads, dim = sys.argv[1:8]
async def main():
    client = AgentClient(url, key)
    expect = FrameExpectation(bytes.fromhex(contract), bytes(16), bytes(16), PageGeometry(int(layers), int(heads), int(dim)))
    t0 = b0 = None
    try:
        async with client.page_stream("", expect, path=f"/v1/bench/pages?count={count}") as stream:
            async for _ in stream:
                if t0 is None:  # timed from the first page, as the raw sink times from its first byte
                    t0, b0 = time.perf_counter(), stream.bytes_read
        print(stream.bytes_read - b0, time.perf_counter() - t0, flush=True)
    finally:
        await client.aclose()
uvloop.run(main())
"""
_ECHO = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1); print(s.getsockname()[1], flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (b := c.recv(1)):
    c.sendall(b)
"""


def _in(place: Place, code: str, *args: str, cpus: str | None = None) -> list[str]:
    cmd = [sys.executable, "-c", code, *args]
    if cpus:
        cmd = ["taskset", "-c", cpus, *cmd]
    return ["ip", "netns", "exec", place.netns, *cmd] if place.netns else cmd


def raw_tcp(src: Place, dst: Place, megabytes: int, cpus: tuple[str | None, str | None]) -> dict:
    """Bytes per second of a plain TCP copy from `src` to `dst` (the link's raw throughput), and
    the median TCP round trip of one byte."""
    sink = subprocess.Popen(_in(dst, _SINK, dst.addr, cpus=cpus[1]), stdout=subprocess.PIPE, text=True)
    port = sink.stdout.readline().strip()
    subprocess.run(_in(src, _SOURCE, dst.addr, port, str(megabytes), cpus=cpus[0]), check=True)
    n, seconds = sink.stdout.readline().split()
    sink.wait()
    echo = subprocess.Popen(_in(dst, _ECHO, dst.addr), stdout=subprocess.PIPE, text=True)
    port = echo.stdout.readline().strip()
    rtt = float(
        subprocess.run(_in(src, _RTT, dst.addr, port), check=True, capture_output=True, text=True).stdout.strip()
    )
    echo.kill()
    return {"bytes_per_second": int(n) / float(seconds), "bytes": int(n), "rtt_seconds": rtt}


def page_stream(p: Agent, d_place: Place, key: str, megabytes: int, cpus: str | None) -> dict:
    """Bytes per second of the product's own page stream from P's agent to D's place: synthetic
    pages (GET /v1/bench/pages) through the decoder's receiver, every frame checked."""
    c = p.info["contract"]
    count = -(-megabytes * 1_000_000 // int(p.info["page_bytes"])) + 1
    out = subprocess.run(
        _in(
            d_place,
            _PAGES,
            p.url,
            key,
            str(count),
            c["fingerprint"],
            str(c["layers"]),
            str(c["kv_heads"]),
            str(c["head_dim"]),
            cpus=cpus,
        ),
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    n, seconds = int(out[0]), float(out[1])
    return {"bytes_per_second": n / seconds, "bytes": n}


# ---- the cluster --------------------------------------------------------------------------------
@dataclass
class Agent:
    name: str
    engine: str
    url: str
    cpus: str | None
    info: dict = field(default_factory=dict)
    pid: int = 0  # of the agent's process, for whoever measures it


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
    zstd: bool = False,
    cores_each: int = 1,
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
                [
                    "agent",
                    "serve",
                    "--engine",
                    engine,
                    "--model",
                    str(model),
                    "--host",
                    place.host,
                    "--port",
                    "0",
                    "--no-mdns",
                    "--name",
                    name,
                ],
                env={"TANDEM_HOME": str(home / name), "TANDEM_CLUSTER_KEY": key, **envs[i]},
                netns=place.netns,
                cpus=cpus,
            )
            stack.callback(proc.stop)
            procs.append((proc, place, name, engine, cpus))
        for proc, place, name, engine, cpus in procs:
            port = proc.wait_ready(600).rsplit(":", 1)[1]
            agents.append(Agent(name, engine, f"http://{place.addr}:{port}", cpus, pid=proc.proc.pid))
        pairs = [
            a
            for p, d in directions
            for a in ("--pair", f"{agents[p].name}->{agents[d].name}={agents[p].url},{agents[d].url}")
        ]
        pairs += [
            a
            for p, d in (directions if zstd else [])  # the same pairs with compressed pages
            for a in ("--pair", f"{agents[p].name}->{agents[d].name}+zstd={agents[p].url},{agents[d].url},zstd")
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


# ---- measuring -------------------------------------------------------------------------------
def prompt_ids(n: int, seed: int, vocab: int) -> list[int]:
    """n random token ids; the seed makes every prompt's start distinct (no prefix reuse)."""
    return [int(x) for x in np.random.default_rng(seed).integers(100, vocab - 100, size=n)]


def ttft(http: httpx.Client, model: str, ids: list[int], max_tokens: int) -> float:
    """Seconds from sending a streaming completion to its first chunk with a choice."""
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    first = None
    with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{model}: {r.status_code} {r.read()[:300]!r}")
        for line in r.iter_lines():
            if first is None and line.startswith("data: {") and '"choices"' in line:
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError(f"{model}: the stream carried no token")
    return first


def handoff_prefill_total(agent: Agent, key: str) -> tuple[float, float]:
    """(count, sum) of the agent's handoff prefill times so far (its Prometheus histogram)."""
    text = httpx.get(agent.url + "/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=30).text
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("tandem_handoff_prefill_seconds_count", "tandem_handoff_prefill_seconds_sum"):
            found[name] = float(value)
    return found["tandem_handoff_prefill_seconds_count"], found["tandem_handoff_prefill_seconds_sum"]


def prefill_seconds(agent: Agent, key: str, ids: list[int]) -> float:
    """The agent's engine alone on the prompt, to its first token (its own clock: no HTTP in it)."""
    with httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=600) as c:
        with c.stream("POST", agent.url + "/v1/generate", json={"token_ids": ids, "sampling": {"max_tokens": 1}}) as r:
            lines = [json.loads(x) for x in r.iter_lines() if x]
    return float(lines[-1]["ttft_seconds"])


def decode_step_seconds(agent: Agent, key: str, vocab: int) -> float:
    """One decode step of the agent's engine: the median gap between streamed tokens."""
    gaps = []
    with httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=600) as c:
        for seed in range(3):
            body = {
                "token_ids": prompt_ids(32, 10_000 + seed, vocab),
                "sampling": {"max_tokens": 12, "ignore_eos": True},
            }
            stamps = []
            with c.stream("POST", agent.url + "/v1/generate", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith('{"token"'):
                        stamps.append(time.perf_counter())
            gaps += [b - a for a, b in zip(stamps[1:], stamps[2:])]  # skip the prefill
    return statistics.median(gaps)


def trace_pd(p: Agent, d: Agent, key: str, ids: list[int], max_tokens: int, encoding: str = "raw") -> dict:
    """One P/D request sent the way the panel's router sends it (one POST /v1/decode to D, which
    creates the handoff on P), with the agents' own timestamps (same host, one clock): where each
    millisecond of it goes."""
    headers = {"Authorization": f"Bearer {key}"}
    sampling = {"max_tokens": max_tokens, "temperature": 0}
    body = {"token_ids": ids, "sampling": sampling, "prefill_url": p.url, "page_encoding": encoding}
    with httpx.Client(headers=headers, timeout=600) as c:
        t0 = time.time()
        first, done, last = None, None, ""
        with c.stream("POST", d.url + "/v1/decode", json=body) as r:
            for line in r.iter_lines():
                last = line or last
                if line.startswith('{"token"') and first is None:
                    first = time.time()
                elif line.startswith('{"done"'):
                    done = json.loads(line)
    if done is None or first is None or done.get("prefill_finished_at") is None:
        return {"error": last[:500] or f"HTTP {r.status_code}"}  # reported in the output, the run goes on
    prefill_start = done["prefill_finished_at"] - done["prefill_seconds"]
    parts = {
        "D: checks + handoff on P, to prefill start": prefill_start - t0,
        "P: prefill": done["prefill_seconds"],
        "wire: last page after prefill end": done["last_page_at"] - done["prefill_finished_at"],
        "D: first token after last page": first - done["last_page_at"],
    }
    return {
        "total_seconds": first - t0,
        "parts": parts,
        "pages": done["pages"],
        "wire_bytes": done["wire_bytes"],
        "first_page_before_prefill_end_seconds": done["prefill_finished_at"] - done["first_page_at"],
    }


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "samples": values}


# ---- the command ------------------------------------------------------------------------------
def bench_ttft(
    lengths: str = typer.Option(DEFAULT_LENGTHS, help="Prompt lengths in tokens, comma-separated."),
    samples: int = typer.Option(5, min=1, help="Measured requests per cell (after the warm-up)."),
    warmup: int = typer.Option(1, min=0, help="Unmeasured requests per cell first."),
    max_tokens: int = typer.Option(32, min=1, help="Output tokens per request."),
    prefill: str = typer.Option("torch", help="Engine of agent A."),
    decode: str = typer.Option("mlx", help="Engine of agent B."),
    direction: str = typer.Option("both", help="P->D directions: a2b (A prefills), b2a, or both."),
    link: str = typer.Option("loopback", help="loopback, or shaped (namespaces + tc tbf; needs root)."),
    rate: float = typer.Option(85.0, help="Shaped link rate in MB/s."),
    delay_ms: float = typer.Option(
        0.3, help="Shaped link delay each way in ms (netem; skipped, and said so, where the kernel has none)."
    ),
    pin: bool = typer.Option(True, help="Pin each agent to its own CPU."),
    cores_per_agent: int = typer.Option(
        1, min=1, help="CPUs each pinned agent gets (1 on a 2-core machine; more on a GPU host)."
    ),
    out: Path = typer.Option(Path("bench/results"), help="Where the JSON, markdown and PNG go."),
    model_dir: Path = typer.Option(None, "--model", help="Model directory (default: the embedded model)."),
    b_cpu_only: bool = typer.Option(False, help="Hide GPUs from agent B (e.g. CUDA prefill -> CPU decode)."),
    panel_dir: Path = typer.Option(
        None,
        help="Data dir of the panel that shows the result (default: $TANDEM_HOME/panel, the panel on this machine).",
    ),
    zstd: bool = typer.Option(False, help="Also run every P->D direction with compressed pages (byte planes + zstd)."),
    panel: str = typer.Option(
        None,
        help="Benchmark this running panel's models instead of starting a cluster. "
        "Run it on the panel's machine: pairs and nodes are read from --panel-dir.",
    ),
    api_key: str = typer.Option(None, envvar="TANDEM_API_KEY", help="With --panel: an API key of that panel."),
    models: str = typer.Option(None, help="With --panel: the models to measure, comma-separated (default: all)."),
) -> None:
    """Measure time to first token, engines alone and P->D, against the physical bound."""
    from tandem_protocol.model_dir import inspect_model

    from .model_cmd import ensure_embedded_model

    sizes = [int(x) for x in lengths.split(",") if x.strip()]
    if panel:
        if not api_key:
            raise typer.BadParameter("--panel needs --api-key (or TANDEM_API_KEY): the panel's OpenAI API wants one")
        result = {
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "host": platform.node(),
            "panel": panel,
            "cpu_count": os.cpu_count(),
            "lengths": sizes,
            "samples": samples,
            "warmup": warmup,
            "max_tokens": max_tokens,
            "link": "panel",
            "pinned": False,
            "cells": [],
        }
        bench_running_panel(result, panel.rstrip("/"), api_key, panel_dir or data_dir() / "panel", models)
        return report(result, out, panel_dir)
    dirs = {"a2b": [(0, 1)], "b2a": [(1, 0)], "both": [(0, 1), (1, 0)]}.get(direction)
    if dirs is None:
        raise typer.BadParameter("--direction must be a2b, b2a or both")
    if link not in ("loopback", "shaped"):
        raise typer.BadParameter("--link must be loopback or shaped")
    model = model_dir.resolve() if model_dir else ensure_embedded_model()
    key = "tdm_bench-" + secrets.token_hex(16)
    home = data_dir() / "bench" / secrets.token_hex(3)
    link_cm = shaped_link(rate, delay_ms) if link == "shaped" else loopback_link()
    result: dict = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "host": platform.node(),
        "model": str(model),
        "cpu_count": os.cpu_count(),
        "lengths": sizes,
        "samples": samples,
        "warmup": warmup,
        "max_tokens": max_tokens,
        "link": link,
        "pinned": pin,
        "cells": [],
    }
    envs = ({}, {"CUDA_VISIBLE_DEVICES": ""} if b_cpu_only else {})
    with link_cm as net, cluster(model, (prefill, decode), net, home, key, pin, dirs, envs, zstd, cores_per_agent) as c:
        panel, api_key, agents = c.url, c.api_key, c.agents
        result["agents"] = [
            {"name": a.name, "engine": a.engine, "url": a.url, "cpus": a.cpus, "accelerator": a.info.get("accelerator")}
            for a in agents
        ]
        vocab = inspect_model(model).vocab_size
        with console.status("measuring the link (raw TCP, both ways) and one decode step per engine…"):
            mb = 64 if link == "shaped" else 512
            result["link_measured"] = {
                f"{agents[p].name}->{agents[d].name}": raw_tcp(
                    net.places[p], net.places[d], mb, (agents[p].cpus, agents[d].cpus)
                )
                for p, d in dirs
            }
            for p, d in dirs:  # the page stream on the same link, same size, same pinning
                measured = result["link_measured"][f"{agents[p].name}->{agents[d].name}"]
                measured["page_stream"] = page_stream(agents[p], net.places[d], key, mb, agents[d].cpus)
                measured["page_stream_over_raw_tcp"] = (
                    measured["page_stream"]["bytes_per_second"] / measured["bytes_per_second"]
                )
            if rate and link == "shaped":
                result["link_measured"]["configured_rate_bytes_per_second"] = rate * 1e6
                result["link_measured"]["asked_delay_ms"] = delay_ms
                result["link_measured"]["emulated_delay_ms"] = net.delay_ms
            steps = {a.name: decode_step_seconds(a, key, vocab) for a in agents}
        columns = [(f"node/{a.name}", None, a, "raw") for a in agents] + [
            (f"{agents[p].name}->{agents[d].name}{suffix}", agents[p], agents[d], encoding)
            for encoding, suffix in ([("raw", ""), ("zstd", "+zstd")] if zstd else [("raw", "")])
            for p, d in dirs
        ]
        measure(result, panel, api_key, key, columns, steps, vocab)
    report(result, out, panel_dir)


def report(result: dict, out: Path, panel_dir: Path | None) -> None:
    paths = write_outputs(result, out, panel_dir)
    console.print(markdown_table(result))
    console.print("written: " + ", ".join(str(p) for p in paths))


def bench_running_panel(result: dict, panel: str, api_key: str, panel_dir: Path, models: str | None) -> None:
    """`--panel`: the panel's own pairs and paired nodes (read from its database), its own agents,
    nothing started or pinned here. The link term of each pair is measured by its decoder pulling
    synthetic pages from its prefiller (POST /v1/bench/link): the product's page stream, not a
    raw TCP copy, which would need a program on both machines (on a LAN-speed link the two agree:
    issue 7's G3)."""
    from sqlmodel import Session, create_engine, select

    from control_panel.models import Node, Pair
    from node_agent.identity import cluster_key

    db = panel_dir / "panel.db"
    if not db.exists():
        raise typer.BadParameter(f"no panel database at {db}: run this on the panel's machine or give --panel-dir")
    with Session(create_engine(f"sqlite:///{db}")) as s:
        nodes = {n.id: n for n in s.exec(select(Node))}
        pairs = list(s.exec(select(Pair).order_by(Pair.name)))
    key = cluster_key()
    agents: dict[int, Agent] = {}
    for node in nodes.values():
        if node.paired or any(node.id in (p.prefill_node_id, p.decode_node_id) for p in pairs):
            agent = Agent(node.name, node.engine, node.url.rstrip("/"), None)
            r = httpx.get(agent.url + "/v1/info", headers={"Authorization": f"Bearer {key}"}, timeout=30)
            if r.status_code != 200 or r.json().get("state") != "ready":
                raise typer.BadParameter(
                    f"agent {node.name} at {agent.url} is not ready: {r.status_code} {r.text[:200]}"
                )
            agent.info = r.json()
            agent.engine = agent.info.get("engine") or node.engine
            agents[node.id] = agent
    columns = [(f"node/{n.name}", None, agents[n.id], "raw") for n in nodes.values() if n.paired]
    columns += [(p.name, agents[p.prefill_node_id], agents[p.decode_node_id], p.page_encoding) for p in pairs]
    wanted = [m.strip() for m in models.split(",") if m.strip()] if models else None
    if wanted:
        unknown = sorted(set(wanted) - {c[0] for c in columns})
        if unknown:
            raise typer.BadParameter(
                f"the panel has no model {', '.join(unknown)} (it has {', '.join(c[0] for c in columns)})"
            )
        columns = [c for c in columns if c[0] in wanted]
    used = {id(a): a for c in columns for a in c[1:3] if a is not None}.values()
    result["agents"] = [
        {"name": a.name, "engine": a.engine, "url": a.url, "cpus": None, "accelerator": a.info.get("accelerator")}
        for a in used
    ]
    with console.status("measuring each pair's link (its decoder pulls pages from its prefiller) and decode steps…"):
        result["link_measured"] = {}
        for _, p, d, _ in columns:
            if p is not None and f"{p.name}->{d.name}" not in result["link_measured"]:
                r = httpx.post(
                    d.url + "/v1/bench/link",
                    json={"peer": p.url, "megabytes": 64},
                    headers={"Authorization": f"Bearer {key}"},
                    timeout=600,
                )
                if r.status_code != 200:
                    raise RuntimeError(
                        f"{d.name} could not measure its link from {p.name}: {r.status_code} {r.text[:300]}"
                    )
                result["link_measured"][f"{p.name}->{d.name}"] = {**r.json(), "method": "page stream"}
        vocab = min(int(a.info["vocab_size"]) for a in used)
        steps = {a.name: decode_step_seconds(a, key, vocab) for a in used if any(c[2] is a for c in columns)}
    measure(result, panel, api_key, key, columns, steps, vocab)


def measure(result: dict, panel: str, api_key: str, key: str, columns: list[tuple], steps: dict, vocab: int) -> None:
    """The TTFT samples of every cell (prompt length x column) through the panel, one request at
    a time, and for P->D columns the bound's terms and a traced request; appended to result["cells"].
    A column is (model name on the panel, P agent or None for a node alone, D agent, page encoding)."""
    from rich.progress import Progress

    sizes, samples, warmup, max_tokens = result["lengths"], result["samples"], result["warmup"], result["max_tokens"]
    result["decode_step_seconds"] = steps
    http = httpx.Client(base_url=panel, headers={"Authorization": f"Bearer {api_key}"}, timeout=600)
    try:
        with Progress(console=console) as bar:
            task = bar.add_task("TTFT", total=len(sizes) * len(columns) * (samples + warmup))
            for n in sizes:
                for model_name, p_agent, d_agent, encoding in columns:
                    times, overheads, alone = [], [], []
                    for k in range(warmup + samples):
                        ids = prompt_ids(n, hash((n, model_name, k)) & 0xFFFFFFFF, vocab)
                        if p_agent is not None and k >= warmup:
                            # the bound's prefill term, measured between the P/D samples (a prompt
                            # of its own), so that both see the same machine weather
                            alone.append(prefill_seconds(p_agent, key, prompt_ids(n, 20_000 + 97 * n + k, vocab)))
                        before = handoff_prefill_total(p_agent, key) if p_agent is not None else None
                        t = ttft(http, model_name, ids, max_tokens)
                        if k >= warmup:
                            times.append(t)
                            if before is not None:
                                count, total = handoff_prefill_total(p_agent, key)
                                if count == before[0] + 1:  # it went P->D (no fallback)
                                    overheads.append(t - (total - before[1]))
                        bar.advance(task)
                    cell = {"tokens": n, "column": model_name, "ttft": summary(times)}
                    if p_agent is not None:
                        # TTFT less P's prefill of that same request (its own clock): what the
                        # product adds, free of the prefill's run-to-run spread on a busy machine
                        cell["ttft_minus_own_prefill"] = summary(overheads) if overheads else None
                        cell["trace"] = trace_pd(
                            p_agent, d_agent, key, prompt_ids(n, 30_000 + n, vocab), max_tokens, encoding
                        )
                        if "wire_bytes" in cell["trace"]:  # what the pages took on the wire, framed
                            raw = cell["trace"]["pages"] * (int(p_agent.info["page_bytes"]) + HEADER_SIZE)
                            cell["trace"]["wire_ratio"] = raw / cell["trace"]["wire_bytes"]
                        if "parts" in cell["trace"]:  # what the panel adds on top of the agents' own path
                            cell["trace"]["parts"]["panel and client"] = (
                                cell["ttft"]["median"] - cell["trace"]["total_seconds"]
                            )
                        cell["bound"] = bound_terms(
                            p_agent, d_agent, n, result["link_measured"], steps[d_agent.name], alone
                        )
                        cell["ttft_over_bound"] = cell["ttft"]["median"] / cell["bound"]["seconds"]
                        cell["ttft_minus_bound_ms"] = (cell["ttft"]["median"] - cell["bound"]["seconds"]) * 1000
                        cell["ttft_over_bound_with_d_step"] = (
                            cell["ttft"]["median"] / cell["bound"]["with_d_step_seconds"]
                        )
                    result["cells"].append(cell)
    finally:
        http.close()


def bound_terms(p: Agent, d: Agent, n: int, link: dict, step: float, prefill_alone: list[float]) -> dict:
    """max(P's prefill alone, KV bytes / raw TCP) + D's decode step where it recomputes, each term
    measured in this run (`prefill_alone`: P's engine alone on prompts of n tokens, taken between
    the P/D samples; the median counts)."""
    mode = d.info["decoder_modes"][0]
    kv_tokens = n - 1 if mode == "recompute-last" else n
    pages = -(-kv_tokens // 64)
    kv_bytes = pages * int(p.info["page_bytes"])
    rate = link[f"{p.name}->{d.name}"]["bytes_per_second"]
    prefill = statistics.median(prefill_alone)
    transfer = kv_bytes / rate
    # recompute-last: D runs the last prompt token (one decode step) before its first token;
    # commit-first: the first token is P's, D has it as soon as the last page has arrived
    d_step = step if mode == "recompute-last" else 0.0
    return {
        "prefill_seconds": prefill,
        "prefill_alone_samples": prefill_alone,
        "kv_bytes": kv_bytes,
        "pages": pages,
        "mode": mode,
        "transfer_seconds": transfer,
        "decode_step_seconds": d_step,
        "seconds": max(prefill, transfer) + d_step,
        # the formula as written: D's decode step added in either mode (looser in commit-first)
        "d_step_measured_seconds": step,
        "with_d_step_seconds": max(prefill, transfer) + step,
    }


# ---- output ---------------------------------------------------------------------------------
def markdown_table(result: dict) -> str:
    rows = [
        "| tokens | column | TTFT median ms (min–max) | bound ms | TTFT ÷ bound | TTFT − bound ms | "
        "P prefill ms | KV MB | transfer ms | D step ms | TTFT ÷ (bound + D step) | "
        "TTFT − P's prefill of the same request, median ms (min–max) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in result["cells"]:
        t = c["ttft"]
        cell = f"| {c['tokens']} | {c['column']} | {t['median'] * 1000:.0f} ({t['min'] * 1000:.0f}–{t['max'] * 1000:.0f}) |"
        b = c.get("bound")
        if b:
            o = c.get("ttft_minus_own_prefill")
            cell += (
                f" {b['seconds'] * 1000:.0f} | {c['ttft_over_bound']:.2f} | {c['ttft_minus_bound_ms']:+.0f} |"
                f" {b['prefill_seconds'] * 1000:.0f} | {b['kv_bytes'] / 1e6:.1f} | {b['transfer_seconds'] * 1000:.0f} |"
                f" {b['decode_step_seconds'] * 1000:.0f} |"
                + (f" {c['ttft_over_bound_with_d_step']:.2f} |" if "ttft_over_bound_with_d_step" in c else " |")
                + (f" {o['median'] * 1000:+.1f} ({o['min'] * 1000:+.1f}–{o['max'] * 1000:+.1f}) |" if o else " |")
            )
        else:
            cell += " | | | | | | | | |"
        rows.append(cell)
    link = ", ".join(
        f"{k}: {v['bytes_per_second'] / 1e6:.0f} MB/s {v.get('method', 'raw TCP')}, "
        f"RTT {v['rtt_seconds'] * 1e3:.2f} ms"
        + (
            f", page stream {v['page_stream']['bytes_per_second'] / 1e6:.0f} MB/s = "
            f"{v['page_stream_over_raw_tcp']:.2f}x raw TCP"
            if "page_stream" in v
            else ""
        )
        for k, v in result["link_measured"].items()
        if isinstance(v, dict)
    )
    traces = [c for c in result["cells"] if c.get("trace", {}).get("parts")]
    failed = [c for c in result["cells"] if c.get("trace", {}).get("error")]
    if traces:
        names = list(traces[0]["trace"]["parts"])
        rows += [
            "",
            "Where the time of one P/D request goes (ms; one traced request per cell, agents' clocks)",
            "",
            "| tokens | column | " + " | ".join(names) + " | raw FP16 bytes ÷ wire bytes |",
            "|---:|---|" + "---:|" * (len(names) + 1),
        ]
        for c in traces:
            rows.append(
                f"| {c['tokens']} | {c['column']} | "
                + " | ".join(f"{c['trace']['parts'][k] * 1000:.1f}" for k in names)
                + f" | {c['trace'].get('wire_ratio', 0):.2f} |"
            )
    for c in failed:
        rows.append(f"\nThe traced request at {c['tokens']} tokens, {c['column']}, failed: {c['trace']['error']}")
    lm = result["link_measured"]
    if "asked_delay_ms" in lm:
        link += (
            f"; delay each way {lm['emulated_delay_ms']} ms (netem)"
            if lm["emulated_delay_ms"]
            else f"; delay {lm['asked_delay_ms']} ms asked, not emulated (no netem on this kernel)"
        )
    head = (
        f"TTFT through the panel ({result['link']} link; {link}; agents pinned: {result['pinned']}; "
        f"{result['samples']} samples after {result['warmup']} warm-up, {result['max_tokens']} tokens)\n\n"
    )
    return head + "\n".join(rows) + "\n"


def write_outputs(result: dict, out: Path, panel_dir: Path | None = None) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"ttft-{result['link']}-{time.strftime('%Y%m%d-%H%M%S')}"
    paths = [stem.with_suffix(".json"), stem.with_suffix(".md"), stem.with_suffix(".png")]
    paths[0].write_text(json.dumps(result, indent=2))
    paths[1].write_text(markdown_table(result))
    plot(result, paths[2])
    # the panel on this machine shows the latest run on its Requests page
    panel_dir = panel_dir or data_dir() / "panel"
    (panel_dir / LATEST_TTFT).parent.mkdir(parents=True, exist_ok=True)
    (panel_dir / LATEST_TTFT).write_text(json.dumps(result))
    return paths


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    columns = sorted({c["column"] for c in result["cells"]})
    for col in columns:
        cells = [c for c in result["cells"] if c["column"] == col]
        xs = [c["tokens"] for c in cells]
        ax.plot(xs, [c["ttft"]["median"] * 1000 for c in cells], marker="o", label=f"{col} TTFT")
        if cells[0].get("bound"):
            ax.plot(xs, [c["bound"]["seconds"] * 1000 for c in cells], linestyle="--", label=f"{col} bound")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (ms)")
    who = ", ".join(f"{a['name']} on {(a.get('accelerator') or {}).get('kind', '?')}" for a in result.get("agents", []))
    ax.set_title(f"Tandem TTFT, {result['link']} link ({who})", fontsize="medium")
    ax.legend(fontsize="small")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
