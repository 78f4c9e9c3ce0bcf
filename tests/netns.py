"""A test "host": a network namespace the test creates, reached from the root namespace over a
veth pair, with mDNS confined inside it.

mDNS runs on a second veth pair whose two ends both live in the namespace (multicast sent on one
end is heard on the other and looped back to local sockets), so no multicast packet ever reaches
an interface outside the namespace. Needs root and iproute2; everything is deleted afterwards.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from .prerequisites import requires


def netns_available() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None


needs_netns = requires(netns_available(), "network namespaces need root and iproute2")


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


@dataclass
class Host:
    ns: str
    addr: str  # where the root namespace (the test, a browser) reaches services in the namespace
    mdns_addr: str  # the in-namespace interface mDNS uses


@contextmanager
def host_namespace() -> Iterator[Host]:
    tag = secrets.token_hex(2)
    n = int(tag, 16) % 250
    ns, outside, inside, m0, m1 = f"tdm-h-{tag}", f"tvo{tag}", f"tvi{tag}", f"tvm{tag}", f"tvn{tag}"
    host = Host(ns, f"10.233.{n}.2", f"10.234.{n}.1")
    try:
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
        sh("ip", "link", "set", inside, "netns", ns)
        sh("ip", "addr", "add", f"10.233.{n}.1/24", "dev", outside)
        sh("ip", "link", "set", outside, "up")
        sh("ip", "-n", ns, "addr", "add", f"{host.addr}/24", "dev", inside)
        sh("ip", "-n", ns, "link", "set", inside, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns, "link", "add", m0, "type", "veth", "peer", "name", m1)
        sh("ip", "-n", ns, "addr", "add", f"{host.mdns_addr}/24", "dev", m0)
        for dev in (m0, m1):
            sh("ip", "-n", ns, "link", "set", dev, "up", "multicast", "on")
        sh("ip", "-n", ns, "route", "add", "224.0.0.0/4", "dev", m0)
        yield host
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", outside], capture_output=True)
