"""Two agents on two hosts find each other by mDNS, and a panel follows an agent that moves.

The hosts are network namespaces this test creates and deletes, joined by a veth pair; all
traffic, multicast included, stays inside them. The agents serve the tiny random-weight Llama
(`tiny_dir`, tests/conftest.py): what is asserted is what they announce and where, not what they say.
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tandem_protocol.discovery import ANNOUNCED_KEYS, Announcer

from ..agents import TANDEM, TEST_KEY, AgentProcess, PanelProcess, side_by_side, wait_for
from ..netns import needs_netns, sh


@pytest.fixture(scope="module")
def two_hosts():
    tag = secrets.token_hex(2)
    subnet = f"10.231.{int(tag, 16) % 250}"
    hosts = {"a": (f"tdm-a-{tag}", f"tva{tag}", f"{subnet}.1"), "b": (f"tdm-b-{tag}", f"tvb{tag}", f"{subnet}.2")}
    try:
        for ns, _, _ in hosts.values():
            sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", hosts["a"][1], "type", "veth", "peer", "name", hosts["b"][1])
        for ns, dev, addr in hosts.values():
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up", "multicast", "on")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "route", "add", "224.0.0.0/4", "dev", dev)
        yield hosts
    finally:
        for ns, _, _ in hosts.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def browse_in(ns: str, addr: str, seconds: float = 4.0) -> list[dict]:
    code = (
        "import asyncio, json; from tandem_protocol.discovery import browse; "
        f"print(json.dumps([p.__dict__ for p in asyncio.run(browse({seconds}, ['{addr}']))]))"
    )
    out = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        cwd=os.getcwd(),
        timeout=60,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_netns
def test_agents_find_each_other(two_hosts, tiny_dir, tmp_path):
    (ns_a, _, addr_a), (ns_b, _, addr_b) = two_hosts["a"], two_hosts["b"]
    mdns = ("--mdns", "--mdns-interface")
    with side_by_side(
        lambda: AgentProcess("torch", tiny_dir, tmp_path / "a", *mdns, addr_a, host=addr_a, netns=ns_a),
        lambda: AgentProcess("mlx", tiny_dir, tmp_path / "b", *mdns, addr_b, host=addr_b, netns=ns_b),
    ) as (a, b):

        def peers_cli() -> str:
            """`tandem agent peers` on host a: the peers it finds, with a measured round-trip time."""
            return subprocess.run(
                ["ip", "netns", "exec", ns_a, TANDEM, "agent", "peers", "--seconds", "3", "--interface", addr_a],
                capture_output=True,
                text=True,
                timeout=60,
                env={**os.environ, "COLUMNS": "200", "TANDEM_CLUSTER_KEY": TEST_KEY},
            ).stdout

        # the three listen at once: each waits seconds for answers, not for the others
        with ThreadPoolExecutor(3) as pool:
            browsing = pool.submit(browse_in, ns_a, addr_a), pool.submit(browse_in, ns_b, addr_b)
            listing = pool.submit(peers_cli)
            seen_from_a, seen_from_b = ({p["properties"]["name"]: p for p in f.result()} for f in browsing)
            out = listing.result()
        peer_b, peer_a = seen_from_a["mlx-b"], seen_from_b["torch-a"]
        assert peer_b["addresses"] == [addr_b] and peer_b["port"] == b.port
        assert peer_a["addresses"] == [addr_a] and peer_a["port"] == a.port
        assert peer_b["properties"]["engine"] == "mlx" and peer_a["properties"]["accel"] == "cpu"
        assert peer_a["properties"]["contract"] == peer_b["properties"]["contract"]
        for peer in (peer_a, peer_b):
            assert set(peer["properties"]) <= set(ANNOUNCED_KEYS)
            assert TEST_KEY not in json.dumps(peer)  # no secret on the LAN
        # the CLI shows the peer with a measured round-trip time over the veth link
        assert "mlx-b" in out and " ms" in out, out
        b.stop()  # withdrawn on shutdown
        assert "mlx-b" not in {p["properties"]["name"] for p in browse_in(ns_a, addr_a, 3.0)}


def test_announcer_refuses_unexpected_properties():
    with pytest.raises(ValueError, match="cluster_key"):
        Announcer({"node_id": "x" * 32, "name": "n", "cluster_key": "secret"}, 1, ["127.0.0.1"])


@needs_netns
def test_the_panel_follows_a_node_that_comes_back_elsewhere(two_hosts, tiny_dir, tmp_path):
    """An agent restarted on a new port announces itself there; the panel checks its identity at
    that address and moves the node: one row, the same model name, and it answers."""
    (ns_a, _, addr_a), (ns_b, _, addr_b) = two_hosts["a"], two_hosts["b"]
    agent_args = ("torch", tiny_dir, tmp_path / "b", "--mdns", "--mdns-interface", addr_b)
    with AgentProcess(*agent_args, host=addr_b, netns=ns_b) as first:
        first_url = first.url
        node_id = (tmp_path / "b" / "node-ids" / "torch-b").read_text().strip()  # its own, lasting id
        panel = PanelProcess(
            tmp_path / "panel", "--host", addr_a, "--mdns", "--mdns-interface", addr_a, "--node", first_url, netns=ns_a
        )
    try:
        with AgentProcess(*agent_args, host=addr_b, netns=ns_b) as again:
            assert again.url != first_url

            def rows():
                with sqlite3.connect(f"file:{tmp_path / 'panel' / 'panel' / 'panel.db'}?mode=ro", uri=True) as db:
                    return db.execute("SELECT node_id, url, paired FROM node").fetchall()

            wait_for(lambda: rows() != [(node_id, first_url, 1)], timeout=30)
            assert rows() == [(node_id, again.url, 1)]
            # the API from inside the panel's namespace: the models listed, and a completion of each
            code = (
                "import httpx, json, sys; c = httpx.Client(base_url=sys.argv[1], timeout=60, "
                "headers={'Authorization': 'Bearer ' + sys.argv[2]}); "
                "ids = [m['id'] for m in c.get('/v1/models').json()['data']]; "
                "print(json.dumps({i: c.post('/v1/completions', json={'model': i, 'prompt': 'Hi', 'max_tokens': 2})"
                ".json()['usage']['completion_tokens'] for i in ids}))"
            )
            out = subprocess.run(
                ["ip", "netns", "exec", ns_a, sys.executable, "-c", code, panel.url, panel.api_key],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert out.returncode == 0, out.stderr
            assert json.loads(out.stdout) == {"node/torch-b": 2}
            assert f"moved from {first_url} to {again.url}" in "".join(panel.log)
    finally:
        panel.stop()


@needs_netns
def test_a_panel_with_no_multicast_route_serves_without_discovery_and_says_why(tmp_path):
    """Two machines on a direct cable, no gateway: the panel's host has no default route, so no
    route for mDNS's multicast group, and joining it fails (ENODEV). The panel starts anyway, serves
    its UI and API, and its Settings page says discovery is off, why, and what to do. (Before, it
    printed its one-time admin password and "ready", then "Application startup failed" and exited.)"""
    tag = secrets.token_hex(2)
    ns, dev, addr = f"tdm-nr-{tag}", f"tnr{tag}", f"10.232.{int(tag, 16) % 250}.1"
    try:
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "add", dev, "type", "veth", "peer", "name", f"{dev}p")
        sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        for link in (dev, f"{dev}p", "lo"):
            sh("ip", "-n", ns, "link", "set", link, "up")
        with PanelProcess(tmp_path, "--host", "0.0.0.0", "--tls", "--mdns", netns=ns) as panel:
            # from inside the namespace: sign in, read the Settings page's discovery card and the API
            code = (
                "import httpx, re, sys; c = httpx.Client(base_url=sys.argv[1], verify=False, timeout=30); "
                'csrf = re.search(r\'name="csrf" value="([^"]+)"\', c.get(\'/login\').text).group(1); '
                "assert c.post('/login', data={'password': sys.argv[2], 'csrf': csrf}).status_code == 303; "
                "page = c.get('/settings').text; "
                "print(re.search(r'<p id=\"discovery-state\">(.*?)</p>', page, re.S).group(1).strip()); "
                "print(c.get('/v1/models', headers={'Authorization': 'Bearer ' + sys.argv[3]}).status_code)"
            )
            out = subprocess.run(
                ["ip", "netns", "exec", ns, sys.executable, "-c", code, panel.url, panel.admin_password, panel.api_key],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert out.returncode == 0, out.stderr
            card, models = out.stdout.strip().splitlines()
            assert card.startswith("mDNS discovery is off: it could not start on this network (No such device"), card
            assert "--mdns-interface ADDRESS" in card and models == "200", out.stdout
            assert panel.proc.poll() is None
            assert any("mDNS discovery is off" in line for line in panel.log), panel.log[-20:]
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
