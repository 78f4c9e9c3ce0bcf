"""Network namespaces as separate hosts on one machine: for the tests and `tandem bench ttft`.

- `host_namespace()`: one "host", reached from the root namespace over a veth pair, with mDNS
  confined inside it. mDNS runs on a second veth pair whose two ends both live in the namespace
  (multicast sent on one end is heard on the other and looped back to local sockets), so no
  multicast packet ever reaches an interface outside the namespace.
- `shaped_pair()`: two hosts A and B, each reached from the root namespace over its own veth,
  joined to each other by a third veth shaped with `tc tbf` (and `netem` delay where the kernel
  has it). The root namespace routes to A's and B's link addresses through their own veths, so
  traffic from the root namespace (a panel, a test) never takes the shaped link.

Needs root and iproute2 (and tc for shaping); everything created is deleted afterwards, on
failure too.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass


def netns_available() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


def in_namespace(ns: str | None, cmd: list[str]) -> list[str]:
    """`cmd` run inside namespace `ns` (as is where `ns` is None: the root namespace)."""
    return ["ip", "netns", "exec", ns, *cmd] if ns else cmd


@contextmanager
def namespace(name: str) -> Iterator[str]:
    """A new namespace with its loopback up; deleted (with every device in it) on exit."""
    sh("ip", "netns", "add", name)
    try:
        sh("ip", "-n", name, "link", "set", "lo", "up")
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@contextmanager
def root_veth(ns: str, outside: str, inside: str, net: str) -> Iterator[str]:
    """A veth pair from the root namespace (`net`.1) into `ns` (`net`.2, returned)."""
    sh("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
    try:
        sh("ip", "link", "set", inside, "netns", ns)
        sh("ip", "addr", "add", f"{net}.1/24", "dev", outside)
        sh("ip", "link", "set", outside, "up")
        sh("ip", "-n", ns, "addr", "add", f"{net}.2/24", "dev", inside)
        sh("ip", "-n", ns, "link", "set", inside, "up")
        yield f"{net}.2"
    finally:  # gone with the namespace already, unless the namespace outlives it
        subprocess.run(["ip", "link", "del", outside], capture_output=True)


@dataclass
class Host:
    ns: str
    addr: str  # where the root namespace (the test, a browser) reaches services in the namespace
    mdns_addr: str  # the in-namespace interface mDNS uses


@contextmanager
def host_namespace() -> Iterator[Host]:
    tag = secrets.token_hex(2)
    n = int(tag, 16) % 250
    with namespace(f"tdm-h-{tag}") as ns, root_veth(ns, f"tvo{tag}", f"tvi{tag}", f"10.233.{n}") as addr:
        host = Host(ns, addr, f"10.234.{n}.1")
        m0, m1 = f"tvm{tag}", f"tvn{tag}"
        sh("ip", "-n", ns, "link", "add", m0, "type", "veth", "peer", "name", m1)
        sh("ip", "-n", ns, "addr", "add", f"{host.mdns_addr}/24", "dev", m0)
        for dev in (m0, m1):
            sh("ip", "-n", ns, "link", "set", dev, "up", "multicast", "on")
        sh("ip", "-n", ns, "route", "add", "224.0.0.0/4", "dev", m0)
        yield host


@dataclass
class ShapedPair:
    namespaces: tuple[str, str]
    addrs: tuple[str, str]  # each host's address on the shaped link (reachable from the root namespace too)
    root_addrs: tuple[str, str]  # the root namespace's address on each host's own veth
    devices: tuple[str, str]  # each host's end of the shaped link
    delay_ms: float  # added each way: 0 where none was asked for or the kernel has no netem


@contextmanager
def shaped_pair(rate_mbytes: float, delay_ms: float = 0.0, block: int = 0) -> Iterator[ShapedPair]:
    """`block` (0..79) picks the pair's three /24s of 10.241.0.0/16 (10.241.3b+1 .. 3b+3): pairs
    that may exist at the same time (a test's and a benchmark's) need blocks of their own, or
    each takes the other's routes."""
    if not 0 <= block < 80:
        raise ValueError(f"block must be in 0..79, not {block}")
    tag = secrets.token_hex(2)
    root_nets = (f"10.241.{3 * block + 1}", f"10.241.{3 * block + 2}")
    link_addrs = (f"10.241.{3 * block + 3}.1", f"10.241.{3 * block + 3}.2")
    devs = (f"tbla{tag}", f"tblb{tag}")
    rate = f"{int(rate_mbytes * 8)}mbit"
    with ExitStack() as stack:
        names = []
        for i, side in enumerate("ab"):
            ns = stack.enter_context(namespace(f"tdm-bench-{side}-{tag}"))
            stack.enter_context(root_veth(ns, f"tbr{i + 1}{tag}", f"tbn{i + 1}{tag}", root_nets[i]))
            names.append(ns)
        sh("ip", "link", "add", devs[0], "type", "veth", "peer", "name", devs[1])
        delayed = []
        for ns, dev, addr in zip(names, devs, link_addrs):
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            delayed.append(_shape(ns, dev, rate, delay_ms, rate_mbytes))
        for net, addr in zip(root_nets, link_addrs):
            sh("ip", "route", "replace", f"{addr}/32", "via", f"{net}.2")
            stack.callback(subprocess.run, ["ip", "route", "del", f"{addr}/32"], capture_output=True)
        roots = (f"{root_nets[0]}.1", f"{root_nets[1]}.1")
        yield ShapedPair(tuple(names), link_addrs, roots, devs, delay_ms if all(delayed) else 0.0)


def _shape(ns: str, dev: str, rate: str, delay_ms: float, rate_mbytes: float) -> bool:
    """A token bucket at the link rate on `dev` (burst and queue as a switch port would have them),
    under a netem delay where one is asked for and the kernel has netem. True if delayed. The
    bucket holds 4 ms of the rate (at least 256 KiB): the kernel refills it once a timer tick, and
    a smaller bucket than a tick's worth caps a 10 GbE link below its rate."""
    burst = max(256 * 1024, int(rate_mbytes * 1e6 * 0.004))
    add = ("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev)
    tbf = ("tbf", "rate", rate, "burst", str(burst), "latency", "50ms")
    if delay_ms > 0:
        netem = subprocess.run([*add, "root", "handle", "1:", "netem", "delay", f"{delay_ms}ms"], capture_output=True)
        if netem.returncode == 0:
            sh(*add, "parent", "1:1", "handle", "10:", *tbf)
            return True
    sh(*add, "root", *tbf)
    return False
