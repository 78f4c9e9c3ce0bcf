"""What a host on the LAN can make the panel do by announcing over mDNS (review M6), in process:
the discovery watcher keeps a bounded number of names and follows one name's announcements one
round at a time, a flood of "moved" announcements starts a bounded number of identity checks, and
the database work of an announcement runs off the event loop. zeroconf itself is replaced by fakes
that hand the watcher announcements the way zeroconf's browser does (its handler, by name)."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading

import pytest
from sqlmodel import Session
from zeroconf import ServiceStateChange

from control_panel import services
from control_panel.db import open_db
from control_panel.models import Node
from control_panel.services import note_discovered
from tandem_protocol import discovery
from tandem_protocol.discovery import SERVICE_TYPE, Peer, Watcher

KEY = "tdm_" + "m" * 40
CHECKS_AT_ONCE = 4  # services.MAX_ANNOUNCED_CHECKS


class FakeZeroconf:
    def __init__(self, **kwargs):
        self.zeroconf = object()

    async def async_close(self):
        pass


class FakeBrowser:
    """zeroconf's browser: it calls its handlers with each change of a service name."""

    last: FakeBrowser | None = None

    def __init__(self, zc, types, handlers):
        self.handlers = handlers
        FakeBrowser.last = self

    def announce(self, name: str, change: ServiceStateChange = ServiceStateChange.Added) -> None:
        for handler in self.handlers:
            handler(zeroconf=None, service_type=SERVICE_TYPE, name=name, state_change=change)

    async def async_cancel(self):
        pass


class FakeInfo:
    """A name's records as the announcer sent them last (`announced`), answered once `gate` is open."""

    announced: dict[str, int] = {}
    gate: asyncio.Event | None = None
    entered: asyncio.Event | None = None
    asked = 0  # queries that went out

    def __init__(self, service_type: str, name: str):
        self.name, self.port = name, 7411

    async def async_request(self, zc, timeout_ms) -> bool:
        # the records as they are when the query goes out
        self.properties = {b"node_id": b"%032x" % FakeInfo.announced[self.name], b"tls": b"1"}
        FakeInfo.asked += 1
        if FakeInfo.gate is not None:
            FakeInfo.entered.set()
            await FakeInfo.gate.wait()
        return True

    def addresses_by_version(self, version):
        return [socket.inet_aton("10.1.2.3")]


@pytest.fixture
def fake_zeroconf(monkeypatch):
    monkeypatch.setattr(discovery, "AsyncZeroconf", FakeZeroconf)
    monkeypatch.setattr(discovery, "AsyncServiceBrowser", FakeBrowser)
    monkeypatch.setattr(discovery, "AsyncServiceInfo", FakeInfo)
    FakeInfo.announced, FakeInfo.gate, FakeInfo.entered, FakeInfo.asked = {}, None, None, 0


def test_a_flood_of_names_keeps_the_watcher_bounded(fake_zeroconf):
    """2,000 names announced (in waves the watcher follows as they come): it keeps the MAX_PEERS
    announced last, not all of them."""
    names = [f"n{i}.{SERVICE_TYPE}" for i in range(2000)]

    async def flood() -> Watcher:
        seen, wave_done = set(), asyncio.Event()
        watcher = Watcher(on_change=lambda peer, present: (seen.add(peer.service), wave_done.set()))
        await watcher.start()
        try:
            for wave in (names[i : i + 50] for i in range(0, len(names), 50)):
                for name in wave:
                    FakeInfo.announced[name] = len(FakeInfo.announced)
                    FakeBrowser.last.announce(name)
                while not seen.issuperset(wave):  # each wave followed before the next (an event per peer)
                    wave_done.clear()
                    await asyncio.wait_for(wave_done.wait(), 30)
            return watcher
        finally:
            await watcher.stop()

    watcher = asyncio.run(flood())
    assert len(watcher.peers) < len(names), len(watcher.peers)
    assert list(watcher.peers) == names[-discovery.MAX_PEERS :]


def test_a_burst_of_names_is_followed_a_bounded_number_at_a_time(fake_zeroconf):
    """1,000 names announced at once, while no query is answered: MAX_FOLLOWED queries go out (a
    task each), not 1,000."""

    async def burst() -> int:
        FakeInfo.gate, FakeInfo.entered = asyncio.Event(), asyncio.Event()
        watcher = Watcher(on_change=lambda peer, present: None)
        await watcher.start()
        try:
            for i in range(1000):
                FakeInfo.announced[f"n{i}.{SERVICE_TYPE}"] = i
                FakeBrowser.last.announce(f"n{i}.{SERVICE_TYPE}")
            await asyncio.sleep(0)  # the announcements reach the loop (call_soon_threadsafe) and start tasks
            await asyncio.sleep(0)  # which send their queries
            return FakeInfo.asked
        finally:
            await watcher.stop()

    asked = asyncio.run(burst())
    assert 0 < asked < 1000 and asked == discovery.MAX_FOLLOWED, asked


def test_one_names_announcements_are_followed_one_round_at_a_time(fake_zeroconf):
    """50 announcements of one name while the first is being resolved: the panel is told twice,
    the first and then the latest, not 50 times."""
    name = f"busy.{SERVICE_TYPE}"
    told: list[str] = []

    async def announce() -> None:
        FakeInfo.gate, FakeInfo.entered, latest = asyncio.Event(), asyncio.Event(), asyncio.Event()
        final = f"{49:032x}"

        def on_change(peer, present):
            told.append(peer.properties["node_id"])
            if told[-1] == final:
                latest.set()

        watcher = Watcher(on_change=on_change)
        await watcher.start()
        try:
            FakeInfo.announced[name] = 0
            FakeBrowser.last.announce(name)
            await asyncio.wait_for(FakeInfo.entered.wait(), 30)  # the first round is resolving
            for version in range(1, 50):
                FakeInfo.announced[name] = version
                FakeBrowser.last.announce(name, ServiceStateChange.Updated)
            await asyncio.sleep(0)  # the announcements reach the loop (call_soon_threadsafe)
            FakeInfo.gate.set()
            await asyncio.wait_for(latest.wait(), 30)
        finally:
            await watcher.stop()

    asyncio.run(announce())
    assert len(told) == 2 and told[-1] == f"{49:032x}", told


def test_moved_announcements_start_a_bounded_number_of_identity_checks(tmp_path, caplog):
    """12 announcements, each of another node claiming the address of a known one, at an address
    whose server takes the identity check and never answers: MAX_ANNOUNCED_CHECKS checks connect,
    the rest are not followed (and say so), rather than one connection and task per announcement."""
    engine = open_db(tmp_path / "panel.db")
    n = 12

    async def flood() -> tuple[int, int, bool]:
        open_now, peak, connections = 0, 0, 0
        all_held, too_many, release = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def hold(reader, writer):
            nonlocal open_now, peak, connections
            open_now, connections = open_now + 1, connections + 1
            peak = max(peak, open_now)
            if open_now == CHECKS_AT_ONCE:
                all_held.set()
            if open_now > CHECKS_AT_ONCE:
                too_many.set()
            await release.wait()
            open_now -= 1
            writer.close()

        server = await asyncio.start_server(hold, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        with Session(engine) as s:
            s.add(Node(name="known", url=f"http://127.0.0.1:{port}", node_id="a" * 32, source="mdns"))
            s.commit()
        peers = [Peer(f"n{i}.{SERVICE_TYPE}", ["127.0.0.1"], port, {"node_id": f"{i + 1:032x}"}) for i in range(n)]
        checks = [asyncio.ensure_future(note_discovered(engine, p, True, KEY)) for p in peers]
        not_followed = asyncio.Event()
        for check in checks:
            check.add_done_callback(
                lambda _: not_followed.set() if sum(c.done() for c in checks) == n - CHECKS_AT_ONCE else None
            )
        try:
            # either the announcements past the bound are dropped, or more checks connect
            first = [asyncio.ensure_future(e.wait()) for e in (not_followed, too_many)]
            await asyncio.wait(first, timeout=30, return_when=asyncio.FIRST_COMPLETED)
            for f in first:
                f.cancel()
            if not too_many.is_set():
                await asyncio.wait_for(all_held.wait(), 30)
            return peak, connections, too_many.is_set()
        finally:
            release.set()
            await asyncio.gather(*checks, return_exceptions=True)
            server.close()
            await server.wait_closed()

    with caplog.at_level(logging.WARNING, logger="tandem.panel"):
        peak, connections, overflowed = asyncio.run(flood())
    assert not overflowed and peak == connections == CHECKS_AT_ONCE, (peak, connections)
    dropped = [r for r in caplog.records if "identity checks already under way" in r.getMessage()]
    assert len(dropped) == n - CHECKS_AT_ONCE and services.MAX_ANNOUNCED_CHECKS == CHECKS_AT_ONCE


def test_an_announcement_writes_the_database_off_the_event_loop(tmp_path, monkeypatch):
    """The rows an announcement reads and writes (SQLite, milliseconds each) are not the event
    loop's work: it serves the API meanwhile."""
    engine = open_db(tmp_path / "panel.db")
    threads: set[int] = set()
    place = services._place

    def recording_place(*args, **kwargs):
        threads.add(threading.get_ident())
        return place(*args, **kwargs)

    monkeypatch.setattr(services, "_place", recording_place)
    peer = Peer(f"fresh.{SERVICE_TYPE}", ["10.1.2.3"], 7411, {"node_id": "f" * 32, "name": "fresh"})

    async def announce() -> int:
        await note_discovered(engine, peer, True, KEY)
        return threading.get_ident()

    loop_thread = asyncio.run(announce())
    assert threads and loop_thread not in threads
    with Session(engine) as s:
        assert s.get(Node, 1).node_id == "f" * 32  # and it was recorded


@pytest.mark.parametrize(
    "host,loopback",
    [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("[::1]", True), ("localhost", True)]
    + [("0.0.0.0", False), ("::", False), ("", False), ("192.168.1.20", False), ("panel.lan", False)],
)
def test_a_panel_on_loopback_listens_to_no_lan_by_default(host, loopback):
    """`tandem panel` turns mDNS on by default only where it listens beyond this machine, and
    refuses plain HTTP there (tests/system/test_lan_hardening.py starts it)."""
    from control_panel.cli import is_loopback

    assert is_loopback(host) is loopback
