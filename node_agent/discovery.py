"""LAN discovery with mDNS/DNS-SD (the well-kept `zeroconf` library).

An agent announces `<name>-<id8>._tandem._tcp.local.` with TXT properties that let a panel or a
peer decide whether to talk to it — never a secret:

    node_id, name, engine, model, contract (fingerprint), proto (protocol version),
    accel (cuda|metal|cpu), accel_name

The announcement is updated when these change and withdrawn on shutdown. `browse` lists the
agents that answer within a time window.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass

import ifaddr
from zeroconf import IPVersion, ServiceStateChange
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

SERVICE_TYPE = "_tandem._tcp.local."
ANNOUNCED_KEYS = ("node_id", "name", "engine", "model", "contract", "proto", "accel", "accel_name")


def lan_addresses(include_loopback: bool = False) -> list[str]:
    """IPv4 addresses of this host's interfaces (what a bound-to-all agent is reachable on)."""
    found = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str) and (include_loopback or not ip.ip.startswith("127.")):
                found.append(ip.ip)
    return found


def service_name(name: str, node_id: str) -> str:
    safe = "".join(c if c.isalnum() or c == "-" else "-" for c in name)[:40] or "tandem"
    return f"{safe}-{node_id[:8]}.{SERVICE_TYPE}"


class Announcer:
    def __init__(self, properties: dict[str, str], port: int, addresses: list[str],
                 interfaces: list[str] | None = None):
        unknown = set(properties) - set(ANNOUNCED_KEYS)
        if unknown:
            raise ValueError(f"refusing to announce unexpected properties {sorted(unknown)}")
        self.properties = dict(properties)
        self.port = port
        self.addresses = addresses
        self.interfaces = interfaces
        self._zc: AsyncZeroconf | None = None
        self._info: AsyncServiceInfo | None = None

    def _service_info(self) -> AsyncServiceInfo:
        return AsyncServiceInfo(
            SERVICE_TYPE, service_name(self.properties["name"], self.properties["node_id"]),
            port=self.port, properties=self.properties, parsed_addresses=self.addresses,
            server=f"tandem-{self.properties['node_id'][:8]}.local.")

    async def start(self) -> None:
        self._zc = AsyncZeroconf(interfaces=self.interfaces or ["0.0.0.0"], ip_version=IPVersion.V4Only)
        self._info = self._service_info()
        await self._zc.async_register_service(self._info, allow_name_change=True)

    async def update(self, **changes: str) -> None:
        self.properties.update(changes)
        if self._zc is not None:
            self._info = self._service_info()
            await self._zc.async_update_service(self._info)

    async def stop(self) -> None:
        if self._zc is not None:
            if self._info is not None:
                await self._zc.async_unregister_service(self._info)
            await self._zc.async_close()
            self._zc = None


@dataclass
class Peer:
    service: str
    addresses: list[str]
    port: int
    properties: dict[str, str]

    @property
    def url(self) -> str:
        return f"http://{self.addresses[0]}:{self.port}" if self.addresses else ""


async def browse(seconds: float = 3.0, interfaces: list[str] | None = None) -> list[Peer]:
    """Listen for agents for `seconds` and return those that answered."""
    zc = AsyncZeroconf(interfaces=interfaces or ["0.0.0.0"], ip_version=IPVersion.V4Only)
    names: set[str] = set()

    def on_change(zeroconf, service_type, name, state_change):
        if state_change in (ServiceStateChange.Added, ServiceStateChange.Updated):
            names.add(name)

    browser = AsyncServiceBrowser(zc.zeroconf, [SERVICE_TYPE], handlers=[on_change])
    try:
        await asyncio.sleep(seconds)  # a browse is a listening window, not a wait for an event
        peers = []
        for name in sorted(names):
            info = AsyncServiceInfo(SERVICE_TYPE, name)
            if await info.async_request(zc.zeroconf, 3000):
                props = {k.decode(): (v or b"").decode() for k, v in info.properties.items()}
                addrs = [socket.inet_ntoa(a) for a in info.addresses_by_version(IPVersion.V4Only)]
                peers.append(Peer(name, addrs, info.port or 0, props))
        return peers
    finally:
        await browser.async_cancel()
        await zc.async_close()
