"""TLS on by default, agents' certificates pinned: what an eavesdropper or a man in the middle on
the LAN gets. Agents serve HTTPS with their own certificate (as `tandem agent serve` does unless
told `--insecure-http`); the panel pins each at pairing, and tells a decoder its prefiller's.
The agents serve the tiny random-weight Llama (`tiny_dir`, tests/conftest.py): what crosses the wire
and who may read it do not depend on the weights."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from control_panel.db import open_db
from control_panel.services import PanelError, add_node
from engine_adapters.server_process import free_port
from tandem_protocol.client import AgentClient, AgentHTTPError
from tandem_protocol.tls import certificate_fingerprint, client_context, ensure_certificate, server_context, spaced
from tests.agents import (
    TEST_KEY,
    AgentProcess,
    PanelProcess,
    TamperProxy,
    log_rows,
    pd_request,
    reserved_port,
    tokens_of,
    wait_for,
)
from tests.netns import host_namespace, needs_netns
from tests.system.test_security import csrf_of, log_in

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Name three rivers that cross the city of Wrocław."


@pytest.fixture(scope="module", params=["tls", "plain"])
def recorded_cluster(request, tiny_dir, tmp_path_factory):
    """A torch prefiller and an MLX decoder, each behind a recording TCP proxy, paired by a panel
    at the proxies' addresses (the agents advertise them, so they prove their identity there):
    every byte between panel and agents, and between the two agents, crosses a proxy. One
    pairing, one P/D request and one status poll of the UI. "plain": the same over HTTP, which
    shows that the recording sees what an eavesdropper would."""
    tls = request.param == "tls"
    home = tmp_path_factory.mktemp(request.param)
    held = {name: reserved_port() for name in ("p", "d")}  # the proxies' ports, held until they listen
    ports = {"relay": free_port(), **{name: sock.getsockname()[1] for name, sock in held.items()}}
    p = AgentProcess(
        "torch", tiny_dir, home / "p", "--advertise-address", f"127.0.0.1:{ports['p']}",
        "--advertise-address", f"127.0.0.1:{ports['relay']}", tls=tls,
    )  # fmt: skip
    d = AgentProcess("mlx", tiny_dir, home / "d", "--advertise-address", f"127.0.0.1:{ports['d']}", tls=tls)
    with p, d:
        scheme = "https" if tls else "http"
        proxies = {n: TamperProxy(a.port, sock=held[n], scheme=scheme) for n, a in (("p", p), ("d", d))}
        panel = PanelProcess(home / "panel", "--pair", f"m={proxies['p'].url},{proxies['d'].url},threshold=1")
        try:
            client = openai.OpenAI(base_url=panel.url + "/v1", api_key=panel.api_key, max_retries=0, timeout=120)
            answer = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": PROMPT}], max_tokens=8, temperature=0
            )
            with httpx.Client(base_url=panel.url, follow_redirects=False) as ui:
                assert log_in(ui, panel.admin_password).status_code == 303
                table = ui.get("/nodes/table").text  # the status poll: the panel asks each agent
            with p.client() as agent:
                ids = agent.post("/v1/tokenize", json={"messages": _messages()}).json()["token_ids"]
            yield {
                "tls": tls,
                "p": p,
                "d": d,
                "relay_port": ports["relay"],
                "answer": answer.choices[0].message.content,
                "row": log_rows(home / "panel")[-1],
                "table": table,
                "ids": ids,
                "p_bytes": bytes(proxies["p"].recorded),
                "d_bytes": bytes(proxies["d"].recorded),
            }
        finally:
            panel.stop()
            for proxy in proxies.values():
                proxy.close()


def _messages() -> list[dict]:
    return [{"role": "user", "content": PROMPT}]


def _id_runs(ids: list[int]) -> list[bytes]:
    """How a run of the prompt's token ids looks in a JSON body, whatever the separators."""
    run = ids[len(ids) // 2 : len(ids) // 2 + 6]
    return [sep.join(map(str, run)).encode() for sep in (",", ", ")]


def test_an_eavesdropper_reads_no_key_and_no_prompt(recorded_cluster):
    c = recorded_cluster
    assert c["answer"], "the request was served"
    assert c["row"].route == "pd" and c["row"].bytes_moved > 0
    # the pages went through the prefiller's proxy, so it saw the decoder's reads
    assert len(c["p_bytes"]) > c["row"].bytes_moved
    assert "ok" in c["table"] or "ready" in c["table"]
    seen = c["p_bytes"] + c["d_bytes"]
    secrets = {
        "cluster key": TEST_KEY.encode(),
        # whole words: random ciphertext holds a given 4-byte string once per 4 GiB, so "Wroc" in
        # this 1.5 MB recording matched by chance once in ~2,800 runs (and did, in CI)
        "prompt text": "Wrocław".encode(),
        "prompt words": b"rivers that cross",
        **{f"token ids {r!r}": r for r in _id_runs(c["ids"])},
    }
    found = {name for name, s in secrets.items() if s in seen}
    if c["tls"]:
        assert not found, f"readable on the wire over TLS: {found}"
        assert seen[:1] == b"\x16", "a TLS handshake record starts each connection"
    else:  # plain HTTP: what the recording catches is what the LAN would
        assert {"cluster key", "prompt text", "prompt words"} <= found, found
        assert any(n.startswith("token ids") for n in found), found


@pytest.mark.parametrize("recorded_cluster", ["tls"], indirect=True)
def test_a_decoder_refuses_a_prefiller_with_another_certificate(recorded_cluster):
    """The panel tells D which certificate P must present; D connects to no other, and says why."""
    c = recorded_cluster
    p, d = c["p"], c["d"]
    sampling = {"max_tokens": 2}
    ok = asyncio.run(
        pd_request(p.url, d.url, c["ids"], sampling, d_pin=d.fingerprint, prefill_fingerprint=p.fingerprint)
    )
    assert len(tokens_of(ok)) == 2
    with pytest.raises(AgentHTTPError) as refused:
        asyncio.run(pd_request(p.url, d.url, c["ids"], sampling, d_pin=d.fingerprint, prefill_fingerprint="0" * 64))
    assert refused.value.status == 502 and "not the one pinned" in str(refused.value), refused.value
    # and a client pinning another certificate for D sends it nothing
    with pytest.raises(Exception, match="not the one pinned"):
        asyncio.run(pd_request(p.url, d.url, c["ids"], sampling, d_pin="1" * 64))


class Relay:
    """A man in the middle: a TLS server with a certificate of its own that relays every byte to
    the real agent (over TLS) and back, reading everything in the clear."""

    def __init__(self, port: int, upstream_port: int, folder):
        self.seen = bytearray()
        cert, key = ensure_certificate(folder, "relay")
        self.ctx, self.upstream_port = server_context(cert, key), upstream_port
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run():
            asyncio.set_event_loop(self.loop)
            self.server = self.loop.run_until_complete(
                asyncio.start_server(self._handle, "127.0.0.1", port, ssl=self.ctx)
            )
            ready.set()
            self.loop.run_forever()

        threading.Thread(target=run, daemon=True).start()
        ready.wait(10)
        self.url = f"https://127.0.0.1:{port}"

    async def _handle(self, r, w):
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port, ssl=client_context(None))

        async def pipe(src, dst):
            while data := await src.read(65536):
                self.seen += data
                dst.write(data)
                await dst.drain()
            dst.close()

        await asyncio.gather(pipe(r, up_w), pipe(up_r, w), return_exceptions=True)

    def close(self):
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.mark.parametrize("recorded_cluster", ["tls"], indirect=True)
def test_a_man_in_the_middle_gets_no_key_and_the_pairing_fails(recorded_cluster, tmp_path):
    """The relay passes the identity challenge to the real agent, which even vouches for the
    relay's address (it advertises it): only the certificate in the proof gives the relay away.
    The pairing fails saying so, and nothing it saw is a credential."""
    c = recorded_cluster
    relay = Relay(c["relay_port"], c["p"].port, tmp_path / "relay")
    try:
        with pytest.raises(PanelError, match="something between the panel and the agent"):
            asyncio.run(add_node(open_db(tmp_path / "panel.db"), relay.url, TEST_KEY))
    finally:
        relay.close()
    requests = [line for line in bytes(relay.seen).split(b"\r\n") if line.startswith((b"GET ", b"POST "))]
    assert requests == [b"POST /v1/identity HTTP/1.1"], requests  # the challenge, and nothing after it
    assert TEST_KEY.encode() not in relay.seen and b"Authorization" not in relay.seen
    # its answer's proof is bound to the agent's own certificate: useless through any other
    answer = json.loads(bytes(relay.seen).rsplit(b"\r\n\r\n", 1)[1])
    assert answer["tls_fingerprint"] == c["p"].fingerprint


def test_the_panel_serves_https_with_its_own_certificate(tmp_path):
    """`tandem panel --tls`: its API over HTTPS, trusted by the fingerprint it printed."""
    panel = PanelProcess(tmp_path, "--tls")
    try:
        assert panel.url.startswith("https://")
        fingerprint = certificate_fingerprint(tmp_path / "panel" / "tls" / "panel.pem")
        assert any(spaced(fingerprint) in line for line in panel.log)
        headers = {"Authorization": f"Bearer {panel.api_key}"}
        with httpx.Client(verify=client_context(fingerprint), headers=headers) as c:
            assert c.get(panel.url + "/v1/models").status_code == 200
        with pytest.raises(httpx.ConnectError, match="not the one pinned"):
            httpx.get(panel.url + "/v1/models", verify=client_context("0" * 64), headers=headers)
    finally:
        panel.stop()


@pytest.mark.parametrize("recorded_cluster", ["tls"], indirect=True)
def test_a_page_stream_opens_only_to_its_handoffs_read_token(recorded_cluster):
    """The cluster key does not read pages, nor does another handoff's token: each handoff's
    pages go to the decoder that created it (which alone was answered its read token)."""
    p, ids = recorded_cluster["p"], recorded_cluster["ids"]

    async def run():
        client = AgentClient(p.url, TEST_KEY, pin=p.fingerprint)
        try:
            contract = (await client.info())["contract"]["fingerprint"]
            made = []
            for _ in range(2):
                body = {"handoff_id": uuid.uuid4().hex, "token_ids": ids, "contract": contract}
                made.append(await client.create_handoff(sampling={"max_tokens": 1}, **body))
            a, b = made
            for token in (None, TEST_KEY, b["read_token"]):  # None: the client's own, the cluster key
                with pytest.raises(AgentHTTPError) as refused:
                    async with client.page_stream(a["handoff_id"], None, token=token) as stream:
                        [x async for x in stream]
                assert refused.value.status == 401 and "read token" in str(refused.value)
            for h in (a, b):
                async with client.page_stream(h["handoff_id"], None, token=h["read_token"]) as stream:
                    items = [x async for x in stream]
                assert len(items) == h["pages"] + 1  # its pages and the final frame
        finally:
            await client.aclose()

    asyncio.run(run())


@needs_netns
def test_a_fake_agent_announced_by_mdns_gets_nothing_from_pairing(tiny_dir, tmp_path):
    """In a test host (a namespace, mDNS inside it), a fake agent announces itself as a new node
    and relays everything to a real agent: the user pairs it with the right key. The pairing fails
    and says why; everything the fake read holds no credential. The real agent pairs, its page
    showing the fingerprint its own machine prints."""
    with host_namespace() as host:
        mdns = ("--mdns", "--mdns-interface", host.mdns_addr)
        real = AgentProcess("torch", tiny_dir, tmp_path / "real", *mdns, host=host.addr, netns=host.ns, tls=True)
        with real:
            record = tmp_path / "fake.bin"
            fake = subprocess.Popen(
                ["ip", "netns", "exec", host.ns, sys.executable, "-m", "tests.fake_agent", host.addr, "7411",
                 str(real.port), host.mdns_addr, str(record)],
                stdout=subprocess.PIPE, text=True, cwd=ROOT,
            )  # fmt: skip
            try:
                assert fake.stdout.readline().strip() == "ready"
                with PanelProcess(tmp_path / "panel", "--host", host.addr, *mdns, netns=host.ns) as panel:
                    with httpx.Client(base_url=panel.url, follow_redirects=False, timeout=30) as ui:
                        assert log_in(ui, panel.admin_password).status_code == 303
                        found = wait_for(lambda: _pair_links(ui) if len(_pair_links(ui)) == 2 else None, 30, 0.5)
                        page = ui.get(found["desk-pc"]).text
                        assert spaced(real.fingerprint) not in page  # the fake's own certificate is shown
                        r = ui.post(found["desk-pc"], data={"key": TEST_KEY, "csrf": csrf_of(page)})
                        assert r.status_code == 400 and "Could not pair desk-pc" in r.text, r.text[-2000:]
                        assert "not the address reached" in r.text  # the real agent signed its own
                        page = ui.get(found[real.name]).text
                        assert spaced(real.fingerprint) in page  # as `tandem agent key` prints it there
                        r = ui.post(found[real.name], data={"key": TEST_KEY, "csrf": csrf_of(page)})
                        assert r.status_code == 303, r.text[-2000:]
            finally:
                fake.terminate()
                fake.wait(10)
    seen = record.read_bytes()
    requests = re.findall(rb"(GET|POST|PUT|DELETE) (\S+) HTTP/1\.1\r\n", seen)  # both ways, one file
    assert requests == [(b"GET", b"/healthz"), (b"POST", b"/v1/identity")], requests
    assert TEST_KEY.encode() not in seen and b"Authorization" not in seen


def _pair_links(ui: httpx.Client) -> dict[str, str]:
    """The nodes found on the network, by name, with their pair page."""
    html = ui.get("/nodes/discovered").text
    return {name: link for link, name in re.findall(r'href="(/nodes/\d+/pair)" data-pair-node="([^"]+)"', html)}
