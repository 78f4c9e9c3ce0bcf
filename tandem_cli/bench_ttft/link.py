"""Where the benchmark's agents live (loopback, or two namespaces joined by a shaped veth pair)
and the link between them measured raw: TCP throughput, round trip, the product's page stream,
and the time a raw TCP stream takes for a given number of bytes (the bound's link term)."""

from __future__ import annotations

import secrets
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import typer

from ..netns import in_namespace, netns_available, shaped_pair


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
    asked_delay_ms: float = 0.0
    namespaces: list[str] = field(default_factory=list)
    ends: list[tuple[str, str]] = field(default_factory=list)  # (namespace, device) of each end of the P<->D link


@contextmanager
def loopback_link() -> Iterator[Link]:
    yield Link("loopback", (Place(None, "127.0.0.1", "127.0.0.1"), Place(None, "127.0.0.1", "127.0.0.1")))


@contextmanager
def shaped_link(rate_mbytes: float, delay_ms: float = 0.0, block: int = 0) -> Iterator[Link]:
    """Agents in two namespaces joined by a veth pair shaped to `rate_mbytes` (tandem_cli/netns.py);
    the panel reaches both over unshaped veths. `block`: the pair's addresses (see shaped_pair)."""
    if not netns_available():
        raise typer.BadParameter("--link shaped needs root and iproute2 (network namespaces and tc)")
    with shaped_pair(rate_mbytes, delay_ms, block) as pair:
        places = tuple(Place(ns, "0.0.0.0", addr) for ns, addr in zip(pair.namespaces, pair.addrs))
        ends = list(zip(pair.namespaces, pair.devices))
        yield Link("shaped", places, rate_mbytes, pair.delay_ms, delay_ms, list(pair.namespaces), ends)


def random_block() -> int:
    """A shaped pair's address block other than 0 (the tests' default), picked at random."""
    return 1 + secrets.randbelow(79)


def _probe(place: Place, *args: str, cpus: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "tandem_cli.bench_probes", *args]
    return in_namespace(place.netns, ["taskset", "-c", cpus, *cmd] if cpus else cmd)


def raw_stream(src: Place, dst: Place, nbytes: int, cpus: tuple[str | None, str | None], count: int = 1) -> list[float]:
    """Seconds each of `count` plain TCP streams of `nbytes` from `src` to `dst` takes, from the
    first byte the receiver sees to the last."""
    sink = subprocess.Popen(_probe(dst, "sink", dst.addr, str(count), cpus=cpus[1]), stdout=subprocess.PIPE, text=True)
    try:
        port = sink.stdout.readline().strip()
        if not port:
            raise RuntimeError(f"the TCP sink in {dst.netns or 'the root namespace'} did not start")
        source = _probe(src, "source", dst.addr, port, str(nbytes), str(count), cpus=cpus[0])
        subprocess.run(source, check=True, capture_output=True)
        seconds = []
        for _ in range(count):
            n, s = sink.stdout.readline().split()
            if int(n) != nbytes:
                raise RuntimeError(f"the TCP sink received {n} of {nbytes} bytes")
            seconds.append(float(s))
        return seconds
    finally:
        sink.kill()
        sink.wait()


def raw_tcp(src: Place, dst: Place, megabytes: int, cpus: tuple[str | None, str | None], count: int = 1) -> dict:
    """Bytes per second of a plain TCP copy from `src` to `dst` (the link's raw throughput; the
    fastest of `count` copies), and the median TCP round trip of one byte."""
    nbytes = megabytes << 20
    seconds = min(raw_stream(src, dst, nbytes, cpus, count))
    echo = subprocess.Popen(_probe(dst, "echo", dst.addr), stdout=subprocess.PIPE, text=True)
    try:
        port = echo.stdout.readline().strip()
        rtt = subprocess.run(_probe(src, "rtt", dst.addr, port), check=True, capture_output=True, text=True)
    finally:
        echo.kill()
        echo.wait()
    return {"bytes_per_second": nbytes / seconds, "bytes": nbytes, "rtt_seconds": float(rtt.stdout.strip())}


def page_stream(p_url: str, p_info: dict, d_place: Place, key: str, megabytes: int, cpus: str | None) -> dict:
    """Bytes per second of the product's own page stream from P's agent to D's place: synthetic
    pages (GET /v1/bench/pages) through the decoder's receiver, every frame checked."""
    c = p_info["contract"]
    count = -(-megabytes * 1_000_000 // int(p_info["page_bytes"])) + 1
    args = [p_url, key, str(count), c["fingerprint"], str(c["layers"]), str(c["kv_heads"]), str(c["head_dim"])]
    out = subprocess.run(_probe(d_place, "pages", *args, cpus=cpus), check=True, capture_output=True, text=True)
    n, seconds = out.stdout.split()
    return {"bytes_per_second": int(n) / float(seconds), "bytes": int(n)}
