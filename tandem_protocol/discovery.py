"""LAN discovery with mDNS/DNS-SD (the well-kept `zeroconf` library).

An agent announces `<name>-<id8>._tandem._tcp.local.` with TXT properties that let a panel or a
peer decide whether to talk to it — never a secret:

    node_id, name, engine, model, contract (fingerprint), proto (protocol version),
    accel (cuda|metal|cpu), accel_name, tls ("1" when the agent serves HTTPS), tls_fp (its
    certificate's SHA-256)

The announcement is updated when these change and withdrawn on shutdown. `browse` lists the
agents that answer within a time window; `Watcher` keeps a live list.
"""

from __future__ import annotations

import asyncio
import inspect
import socket
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import ifaddr
from zeroconf import IPVersion, ServiceStateChange
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from .pages import PROTOCOL_VERSION

SERVICE_TYPE = "_tandem._tcp.local."
# mDNS is unauthenticated: anyone on the LAN may announce any number of names, as often as they like.
# A watcher keeps the MAX_PEERS names announced last, follows at most MAX_FOLLOWED names at once
# (the announcements of others go unheard) and each one's announcements one at a time, at most
# one round per DEBOUNCE_SECONDS: those that come meanwhile make one more round, with the latest.
MAX_PEERS = 256
MAX_FOLLOWED = 64
DEBOUNCE_SECONDS = 1.0
ANNOUNCED_KEYS = ("node_id", "name", "engine", "model", "contract", "proto", "accel", "accel_name", "tls", "tls_fp")


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


def announced_properties(config, adapter) -> dict[str, str]:
    """What an agent announces, from its config (which also holds the cluster key: only the public
    fields are read) and the engine it serves. The TLS fingerprint is public: a user compares it
    with what `tandem agent key` prints on that machine; the panel pins the one the agent proves."""
    accel = adapter.accelerator()
    return {
        "node_id": config.node_id,
        "name": config.name,
        "engine": adapter.name,
        "model": config.model_name or adapter.model_dir.name,
        "contract": adapter.contract.fingerprint,
        "proto": str(PROTOCOL_VERSION),
        "accel": accel["kind"],
        "accel_name": accel.get("name", ""),
        "tls": "1" if config.tls_fingerprint else "0",
        "tls_fp": config.tls_fingerprint,
    }


def _only_announced(properties: dict[str, str]) -> None:
    unknown = set(properties) - set(ANNOUNCED_KEYS)
    if unknown:
        raise ValueError(f"refusing to announce unexpected properties {sorted(unknown)}")


class Announcer:
    def __init__(
        self, properties: dict[str, str], port: int, addresses: list[str], interfaces: list[str] | None = None
    ):
        _only_announced(properties)
        self.properties = dict(properties)
        self.port = port
        self.addresses = addresses
        self.interfaces = interfaces
        self._zc: AsyncZeroconf | None = None
        self._info: AsyncServiceInfo | None = None

    def _service_info(self) -> AsyncServiceInfo:
        return AsyncServiceInfo(
            SERVICE_TYPE,
            service_name(self.properties["name"], self.properties["node_id"]),
            port=self.port,
            properties=self.properties,
            parsed_addresses=self.addresses,
            server=f"tandem-{self.properties['node_id'][:8]}.local.",
        )

    async def start(self) -> None:
        self._zc = AsyncZeroconf(interfaces=self.interfaces or ["0.0.0.0"], ip_version=IPVersion.V4Only)
        self._info = self._service_info()
        await self._zc.async_register_service(self._info, allow_name_change=True)

    async def update(self, **changes: str) -> None:
        _only_announced(changes)  # a switch of engine or model may change what is known, never add to it
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
        scheme = "https" if self.properties.get("tls") == "1" else "http"
        return f"{scheme}://{self.addresses[0]}:{self.port}" if self.addresses else ""


class Watcher:
    """A live view of the agents announcing on the LAN (a panel keeps one running).

    `peers` maps service names to resolved Peers (the MAX_PEERS announced last); `on_change(peer,
    present)` is called in the event loop when an agent appears, changes or withdraws, and awaited
    if it is a coroutine function (a panel checks a moved node's identity before it believes the
    announcement); for one name, never twice at once, nor more often than once per DEBOUNCE_SECONDS.
    """

    def __init__(
        self,
        interfaces: list[str] | None = None,
        on_change: Callable[[Peer, bool], Awaitable[None] | None] | None = None,
    ):
        self.interfaces = interfaces or ["0.0.0.0"]
        self.on_change = on_change
        self.peers: OrderedDict[str, Peer] = OrderedDict()  # least recently announced first
        self._followed: dict[str, bool] = {}  # name -> announced again while being followed
        self._zc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._zc = AsyncZeroconf(interfaces=self.interfaces, ip_version=IPVersion.V4Only)
        self._browser = AsyncServiceBrowser(self._zc.zeroconf, [SERVICE_TYPE], handlers=[self._on_state])

    def _on_state(self, zeroconf, service_type, name, state_change) -> None:
        self._loop.call_soon_threadsafe(self._handle, name, state_change)

    def _handle(self, name: str, state_change: ServiceStateChange) -> None:
        if state_change is ServiceStateChange.Removed:
            peer = self.peers.pop(name, None)
            if peer is not None:
                self._spawn(self._notify(peer, False))
            return
        if name in self._followed:
            self._followed[name] = True  # one more round once this one is done
        elif len(self._followed) < MAX_FOLLOWED:
            self._followed[name] = False
            self._spawn(self._follow(name))

    async def _follow(self, name: str) -> None:
        """Resolve and hand on `name`'s announcement; again (after DEBOUNCE_SECONDS) while more came."""
        try:
            while True:
                self._followed[name] = False
                await self._resolve(name)
                if not self._followed[name]:
                    return
                await asyncio.sleep(DEBOUNCE_SECONDS)  # a rate, not a wait for an event
        finally:
            del self._followed[name]

    def _spawn(self, work) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _notify(self, peer: Peer, present: bool) -> None:
        if self.on_change:
            result = self.on_change(peer, present)
            if inspect.isawaitable(result):
                await result

    async def _resolve(self, name: str) -> None:
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        if self._zc is None or not await info.async_request(self._zc.zeroconf, 3000):
            return
        props = {k.decode(errors="replace"): (v or b"").decode(errors="replace") for k, v in info.properties.items()}
        addrs = [socket.inet_ntoa(a) for a in info.addresses_by_version(IPVersion.V4Only)]
        peer = Peer(name, addrs, info.port or 0, props)
        self.peers[name] = peer
        self.peers.move_to_end(name)
        while len(self.peers) > MAX_PEERS:
            self.peers.popitem(last=False)
        await self._notify(peer, True)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._browser is not None:
            await self._browser.async_cancel()
        if self._zc is not None:
            await self._zc.async_close()
        self._zc = self._browser = None


async def browse(seconds: float = 3.0, interfaces: list[str] | None = None) -> list[Peer]:
    """Listen for agents for `seconds` and return those that answered."""
    watcher = Watcher(interfaces)
    await watcher.start()
    try:
        await asyncio.sleep(seconds)  # a browse is a listening window, not a wait for an event
        return sorted(watcher.peers.values(), key=lambda p: p.service)
    finally:
        await watcher.stop()
