"""Faults on a real pair, each driven through the panel's OpenAI API.

MLX prefills in one network namespace and torch decodes in another; the two are joined by a veth
pair shaped to 4 MB/s (so a transfer lasts long enough to break it on purpose), and the panel, in
the root namespace, reaches each agent over a link of its own. Pair `f` is P -> D directly; pair
`t` goes through a TCP proxy that can flip a bit or cut the stream. Agents run with a 10 s stall
timeout.

Every scenario ends with a clear error to the client or a completed fallback (the same text as
the decoder alone gives for that prompt); afterwards every agent is idle — 0 reserved bytes, 0
open handoffs, 0 requests holding engine memory — and the request log says what happened.
"""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from control_panel.models import RequestLog

from .agents import AgentProcess, PanelProcess, TamperProxy, generate_request, log_rows, settle, tokens_of, wait_for
from .conftest import run
from .netns import needs_netns

pytestmark = [needs_netns]

RATE_MBYTES = 4.0
AGENT_PORT, PANEL_PORT, PROXY_PORT = 7811, 7812, 7813
STALL = "10"
VOCAB = 49152


def ids_for(n: int, seed: int) -> list[int]:
    from tandem_cli.bench_ttft import prompt_ids

    return prompt_ids(n, seed, VOCAB)


class Cluster:
    """The two agents, the proxy and the panel; each can be killed and started again in place."""

    def __init__(self, smol_dir: Path, home: Path, link):
        self.smol_dir, self.home, self.link = smol_dir, home, link
        (self.p_place, self.d_place) = link.places
        self.p = self.start_agent("p")
        self.d = self.start_agent("d")
        # D reaches the proxy on the root namespace's end of its own veth; the proxy reaches P
        # through the root namespace (not the shaped link): damage, not speed, is its job.
        self.proxy = TamperProxy(AGENT_PORT, upstream_host=self.p_place.addr, host="10.241.2.1", port=PROXY_PORT)
        self.panel = self.start_panel(
            "--pair", f"f={self.p.url},{self.d.url}", "--pair", f"t={self.proxy.url},{self.d.url}"
        )

    def start_agent(self, role: str, env: dict | None = None) -> AgentProcess:
        engine, place = ("mlx", self.p_place) if role == "p" else ("torch", self.d_place)
        agent = AgentProcess(
            engine,
            self.smol_dir,
            self.home / role,
            "--stall-timeout",
            STALL,
            "--staging-bytes",
            "256MiB",
            host="0.0.0.0",
            netns=place.netns,
            port=AGENT_PORT,
            env=env,
        )
        agent.wait_ready(300)
        agent.url = f"http://{place.addr}:{AGENT_PORT}"  # it announced 0.0.0.0; peers use this
        return agent

    def restart_agent(self, role: str, env: dict | None = None) -> None:
        old = getattr(self, role)
        old.stop()
        setattr(self, role, self.start_agent(role, env))

    def start_panel(self, *args: str) -> PanelProcess:
        panel = PanelProcess(self.home, *args, port=PANEL_PORT)
        self.api_key = panel.api_key
        return panel

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.panel.url + "/v1", api_key=self.api_key, max_retries=0, **kw)

    def log(self) -> list[RequestLog]:
        return log_rows(self.home)

    def idle(self) -> None:
        settle(self.p, self.d, timeout=20)  # torch and MLX pool nothing: no active request is all there is

    def link_set(self, state: str) -> None:
        ns, dev = self.link.ends[0]
        subprocess.run(["ip", "-n", ns, "link", "set", dev, state], check=True)

    def close(self) -> None:
        for proc in (self.panel, self.p, self.d):
            proc.stop()
        self.proxy.close()


@pytest.fixture(scope="module")
def cluster(smol_dir, tmp_path_factory):
    from tandem_cli.bench_ttft import shaped_link

    with shaped_link(RATE_MBYTES) as link:
        c = Cluster(smol_dir, tmp_path_factory.mktemp("faults"), link)
        try:
            yield c
        finally:
            c.close()


def alone(c: Cluster, ids: list[int], max_tokens: int) -> str:
    """What the decoder alone answers (the fallback must give exactly this)."""
    lines = run(generate_request(c.d.url, ids, {"max_tokens": max_tokens}))
    tokens_of(lines)  # no error
    return "".join(line["text"] for line in lines if "token" in line)


class Request:
    """One streaming completion through the panel, in a thread; `.text` or `.error` when done."""

    def __init__(self, c: Cluster, model: str, ids: list[int], max_tokens: int):
        self.text, self.error, self.chunks = "", None, 0
        self._thread = threading.Thread(target=self._run, args=(c.client(timeout=120), model, ids, max_tokens))
        self._thread.start()

    def _run(self, client, model, ids, max_tokens) -> None:
        try:
            for chunk in client.completions.create(
                model=model, prompt=ids, max_tokens=max_tokens, temperature=0, stream=True
            ):
                self.text += chunk.choices[0].text if chunk.choices else ""
                self.chunks += 1
        except Exception as e:  # what the client sees is what the test checks
            self.error = e

    def result(self, timeout: float = 120) -> Request:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the request hung"
        return self


def pages_sent(agent: AgentProcess) -> int:
    rooms = agent.status()["handoffs"]
    return rooms[0]["pages_sent"] if rooms else 0


def last_row(c: Cluster) -> RequestLog:
    """The newest request's row once it is final (a streaming client may see [DONE] a moment
    before the panel has written how the request ended)."""

    def final():
        rows = c.log()
        return rows[-1] if rows and rows[-1].outcome != "running" else None

    return wait_for(final, 10)


def test_prefiller_killed_mid_stream_falls_back_to_the_decoder(cluster):
    c, ids = cluster, ids_for(600, 1)
    expected = alone(c, ids, 8)
    request = Request(c, "f", ids, 8)
    wait_for(lambda: pages_sent(c.p) >= 1)
    c.p.proc.kill()
    assert request.result().error is None and request.text == expected
    row = last_row(c)
    assert row.route == "decode_alone" and row.outcome == "ok" and "transfer failed" in row.reason, row
    c.restart_agent("p")
    c.idle()


def test_decoder_killed_mid_import_is_a_clear_error(cluster):
    c, ids = cluster, ids_for(600, 2)
    before = c.d.status()["totals"]["pages_received"]
    request = Request(c, "f", ids, 8)
    wait_for(lambda: c.d.status()["totals"]["pages_received"] > before)
    c.d.proc.kill()
    error = request.result().error
    assert isinstance(error, openai.APIStatusError) and error.status_code == 503, error
    assert "not reachable" in str(error), error
    row = last_row(c)
    assert row.outcome == "error" and "not reachable" in row.error, row
    settle(c.p)
    c.restart_agent("d")
    c.idle()


def test_link_cut_mid_transfer_stalls_out_and_falls_back(cluster):
    c, ids = cluster, ids_for(600, 3)
    expected = alone(c, ids, 8)
    request = Request(c, "f", ids, 8)
    wait_for(lambda: pages_sent(c.p) >= 1)
    c.link_set("down")
    try:
        assert request.result().error is None and request.text == expected
        row = last_row(c)
        assert row.route == "decode_alone" and "stalled" in row.reason, row
        settle(c.p, timeout=20)  # P gave up writing to a reader that took nothing for 10 s
    finally:
        c.link_set("up")
    c.idle()


@pytest.mark.parametrize(
    "damage, reason",
    [
        (dict(flip_at=300_000), "checksum mismatch on page 0"),
        (dict(cut_at=700_000), "broke off"),
    ],
    ids=["flipped-bit", "truncated"],
)
def test_damaged_stream_falls_back_and_decodes_nothing_damaged(cluster, damage, reason):
    c, ids = cluster, ids_for(300, 4)
    expected = alone(c, ids, 8)
    for name, value in damage.items():
        setattr(c.proxy, name, value)
    try:
        request = Request(c, "t", ids, 8).result()
    finally:
        c.proxy.flip_at = c.proxy.cut_at = None
    assert request.error is None and request.text == expected
    row = last_row(c)
    assert row.route == "decode_alone" and reason in row.reason, row
    c.idle()


def test_a_slow_link_holds_memory_flat(cluster):
    """16 pages (23.6 MB) over the 4 MB/s link: the prefiller holds what it reserved and no more,
    the decoder buffers a few pages, not the stream."""
    c, ids = cluster, ids_for(1000, 5)
    procs = {role: psutil.Process(getattr(c, role).proc.pid) for role in ("p", "d")}
    base = {role: p.memory_info().rss for role, p in procs.items()}
    peak = dict(base)
    request = Request(c, "f", ids, 4)
    while request._thread.is_alive():
        for role, p in procs.items():
            peak[role] = max(peak[role], p.memory_info().rss)
        time.sleep(0.02)
    assert request.result().error is None
    row = last_row(c)
    assert row.route == "pd" and row.bytes_moved > 16 * 1_474_560, row
    kv = 1000 * 23_040
    grew = {role: (peak[role] - base[role]) / kv for role in procs}
    # P stages every page it reserved (1x KV) on top of MLX's own working memory for the prompt;
    # D holds the prompt's KV in its cache plus a few pages in flight. Without back-pressure the
    # wire would buffer the whole stream again on either side.
    print(
        f"\nRSS growth over a 16-page stream at {RATE_MBYTES:g} MB/s: "
        + ", ".join(
            f"{r.upper()} {(peak[r] - base[r]) / 2**20:.0f} MiB ({g:.2f}x the prompt's KV)" for r, g in grew.items()
        )
    )
    assert grew["p"] < 4 and grew["d"] < 3, {r: f"{g:.2f}x KV" for r, g in grew.items()}
    c.idle()


def test_engine_crash_during_prefill_falls_back_and_the_engine_recovers(cluster):
    c, ids = cluster, ids_for(600, 6)
    expected = alone(c, ids, 8)
    c.restart_agent("p", env={"TANDEM_FAILPOINTS": "prefill_chunk@2"})
    request = Request(c, "f", ids, 8).result()
    assert request.error is None and request.text == expected
    row = last_row(c)
    assert row.route == "decode_alone" and "engine failure injected" in row.reason, row
    c.idle()
    again = Request(c, "f", ids, 8).result()  # the same prefiller serves the next request itself
    assert again.error is None and again.text == expected and last_row(c).route == "pd"
    c.idle()


def test_panel_restarted_while_requests_run(cluster):
    c, ids = cluster, ids_for(200, 7)
    # killed: the client's stream breaks; the agents let go; the next start logs it as interrupted
    request = Request(c, "f", ids, 400)
    wait_for(lambda: request.chunks >= 3)
    running = wait_for(lambda: [r for r in c.log() if r.outcome == "running"], 10)
    c.panel.proc.kill()
    assert isinstance(request.result().error, (openai.APIConnectionError, httpx.TransportError)), request.error
    settle(c.p, c.d, timeout=20)
    c.panel = c.start_panel()
    rows = {r.id: r for r in c.log()}
    assert rows[running[0].id].outcome == "interrupted" and "panel stopped" in rows[running[0].id].error
    # stopped (Ctrl-C / SIGTERM): a stream still running is cancelled within the grace period
    request = Request(c, "f", ids, 400)
    wait_for(lambda: request.chunks >= 3)
    t0 = time.monotonic()
    c.panel.stop()
    assert time.monotonic() - t0 < 15
    assert request.result().error is not None or request.chunks < 400
    c.idle()
    c.panel = c.start_panel()
    assert c.log()[-1].outcome == "cancelled", c.log()[-1]
    done = Request(c, "f", ids, 8).result()  # and the restarted panel serves
    assert done.error is None and done.text == alone(c, ids, 8)
    c.idle()
