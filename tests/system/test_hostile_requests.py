"""Issue 43, H1 and L17: an API key cannot freeze a node with a chat template of its own, and a
long tokenization does not hold the agent's event loop. H2: a 64 KiB refusal from a hostile
agent does not hold the panel's.

The attack is the review's: `chat_template_kwargs` carrying `chat_template`, a nested loop that
Jinja's sandbox renders for hours. Before the fix it reached `apply_chat_template` on the decode
agent, rendered on its event loop: the agent stopped answering anything, and every later request
for that model hung on the panel's tokenize call, which had no read timeout. Now the panel answers
400 naming the key before any agent call, the agent does the same for a body sent to it directly,
and the agent renders and tokenizes on a thread of its own.

This file starts its own torch agent and panel (on the embedded model): what it checks is the
event loop of real processes over real sockets — the answer's time, the next request's, and the
agent's /healthz while a long prompt is tokenized — and the attack, on the old code, leaves its
agent frozen, which no shared cluster may suffer.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler

import httpx
import pytest

from engine_adapters.server_process import free_port

from ..agents import AgentProcess, LocalHTTPServer, PanelProcess

KEY = "tdm_hostile-requests-cluster-key-7c21"
MODEL = "node/torch-agent"  # the agent's name: its engine and its home's name
# The review's attack: two nested loops of 99,999 (about 0.2 h of rendering; a third level never ends)
HOURS = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"
ATTACK = {"chat_template": HOURS}
# What a refused request may take: it is a check of the body. Measured 3 ms through the panel and
# 6-15 ms at the agent on a loaded 2-core machine (load average 4); old code never answered.
REFUSED_WITHIN = 1.0
WAIT = 15.0  # seconds a client of this test waits for any answer (an attack that hangs ends here)
AFTER_FACTOR = 5  # the next request after an attack: at most this many times its usual time


@pytest.fixture(scope="module")
def cluster(smol_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("hostile")
    relay_port = free_port()  # where test_a_hostile_agents_huge_refusal... reaches the agent
    advertised = ("--advertise-address", f"127.0.0.1:{relay_port}")
    with AgentProcess("torch", smol_dir, home / "agent", *advertised, key=KEY) as agent:
        with PanelProcess(home / "panel", "--node", agent.url, key=KEY) as panel:
            api = httpx.Client(base_url=panel.url, headers={"Authorization": f"Bearer {panel.api_key}"}, timeout=WAIT)
            first = api.post("/v1/chat/completions", json=normal_chat())  # the first request's one-off costs
            assert first.status_code == 200, first.text
            try:
                yield {"agent": agent, "panel": panel, "api": api, "home": home, "relay_port": relay_port}
            finally:
                api.close()


def normal_chat() -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}


def normal_response() -> dict:
    return {"model": MODEL, "input": "Hi", "max_output_tokens": 4, "temperature": 0, "store": False}


def timed(call) -> tuple[httpx.Response, float]:
    start = time.perf_counter()
    r = call()
    return r, time.perf_counter() - start


@pytest.mark.parametrize(
    "path, normal",
    [("/v1/chat/completions", normal_chat), ("/v1/responses", normal_response)],
)
def test_a_template_of_the_clients_own_is_refused_at_once_and_the_model_answers_after(cluster, path, normal):
    api = cluster["api"]
    usual = []
    for _ in range(3):
        r, seconds = timed(lambda: api.post(path, json=normal()))
        assert r.status_code == 200, r.text
        usual.append(seconds)

    r, seconds = timed(lambda: api.post(path, json={**normal(), "chat_template_kwargs": ATTACK}))
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "chat_template_kwargs", r.text
    assert "`chat_template_kwargs.chat_template` is not a template switch" in error["message"], error
    assert seconds < REFUSED_WITHIN, f"the refusal took {seconds:.2f} s"

    r, after = timed(lambda: api.post(path, json=normal()))
    assert r.status_code == 200, r.text
    assert after < AFTER_FACTOR * statistics.median(usual), (after, usual)


@pytest.mark.parametrize(
    "kwargs, key",
    [(ATTACK, "chat_template"), ({"enable_thinking": ATTACK}, "enable_thinking")],
)
def test_the_attack_sent_straight_to_the_agent_is_a_400_naming_the_key(cluster, kwargs, key):
    """A key holder (the panel, a peer) is refused the same way: the agent checks its own body."""
    agent = cluster["agent"]
    body = {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": kwargs}
    with httpx.Client(base_url=agent.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=WAIT) as c:
        r, seconds = timed(lambda: c.post("/v1/tokenize", json=body))
        assert r.status_code == 400, r.text
        assert f"`chat_template_kwargs.{key}`" in r.json()["error"]["message"], r.text
        assert seconds < REFUSED_WITHIN, f"the refusal took {seconds:.2f} s"
        r = c.post("/v1/tokenize", json={**body, "chat_template_kwargs": {"enable_thinking": False}})
        assert r.status_code == 200 and r.json()["token_ids"], r.text


def test_a_long_tokenization_leaves_the_agents_event_loop_free(cluster):
    """A prompt near the agent's 8 MiB body limit takes seconds to tokenize (6 MiB: 7-12 s here,
    request and answer included); /healthz, asked every 50 ms meanwhile, still answers at once.
    On the event loop, a /healthz that came during the encoding waited for all of it."""
    agent = cluster["agent"]
    words = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda", "sigma")
    text = " ".join(f"{words[i % 10]}{i % 997}" for i in range(800_000))[: 6 << 20]
    body = {"messages": [{"role": "user", "content": text}]}
    done = threading.Event()
    result: dict = {}

    def tokenize() -> None:
        try:
            with httpx.Client(base_url=agent.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
                result["response"], result["seconds"] = timed(lambda: c.post("/v1/tokenize", json=body))
        finally:
            done.set()

    probes = []  # seconds each /healthz took, while the tokenize was in flight
    with httpx.Client(base_url=agent.url, timeout=120) as c:
        assert c.get("/healthz").status_code == 200  # its connection is open before the tokenize starts
        worker = threading.Thread(target=tokenize)
        worker.start()
        while not done.wait(0.05):  # one probe every 50 ms: sampling, not waiting
            r, seconds = timed(lambda: c.get("/healthz"))
            assert r.status_code == 200
            probes.append(seconds)
        worker.join()
    r, tokenize_seconds = result["response"], result["seconds"]
    assert r.status_code == 200 and len(r.json()["token_ids"]) > 1_000_000, r.text[:300]
    # the slowest probe: a small part of the tokenization it overlapped (a ratio in this run;
    # measured 0.22 s of 12.3 s and 0.24 s of 7.6 s; on the event loop, 12.5 s of 12.7 s), and
    # many answered
    assert max(probes) < tokenize_seconds / 5, (max(probes), tokenize_seconds, len(probes))
    assert len(probes) >= 10, (probes, tokenize_seconds)


# What a hostile agent answers a tokenize with: the review's worst case for the old scrubbing
# pattern, 60 KB of address-like text (8 KB of it took 2.6 s; 60 KB, minutes), under the 64 KiB
# the panel reads of an error.
HUGE_REFUSAL = "cannot tokenize: " + "a-" * 30_000


class HostileRelay(BaseHTTPRequestHandler):
    """An agent that holds the cluster key and turns hostile: every call goes to the real agent
    behind it (so it proves its identity and reports a model), but a tokenize is answered 400 with
    HUGE_REFUSAL."""

    upstream = ""

    def do_GET(self):
        self.relay()

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/v1/tokenize":
            self.answer(400, json.dumps({"error": {"type": "RequestError", "message": HUGE_REFUSAL}}).encode())
        else:
            self.relay(body)

    def relay(self, body: bytes | None = None):
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
        r = httpx.request(self.command, self.upstream + self.path, content=body, headers=headers, timeout=60)
        self.answer(r.status_code, r.content, r.headers.get("content-type", "application/json"))

    def answer(self, status: int, body: bytes, content_type: str = "application/json"):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_hostile_agents_huge_refusal_leaves_the_panel_free(cluster):
    """H2 through real processes: a panel whose node is reached through HostileRelay. The API
    request gets the refusal cut to a few hundred characters within a second, and the panel's
    /healthz answers meanwhile; the old scrubbing held the panel's event loop for minutes."""
    HostileRelay.upstream = cluster["agent"].url
    with (
        LocalHTTPServer(HostileRelay, port=cluster["relay_port"]) as relay,
        PanelProcess(cluster["home"] / "panel-relayed", "--node", relay.url, key=KEY) as panel,
    ):
        headers = {"Authorization": f"Bearer {panel.api_key}"}
        with httpx.Client(base_url=panel.url, headers=headers, timeout=WAIT) as api:
            probes: list[float] = []
            done = threading.Event()

            def probe() -> None:  # the panel's /healthz at once, then every 50 ms while the request runs
                with httpx.Client(base_url=panel.url, timeout=WAIT) as c:
                    while True:  # (a first probe only after 50 ms missed a refusal that came sooner)
                        probes.append(timed(lambda: c.get("/healthz"))[1])
                        if done.wait(0.05):
                            break

            prober = threading.Thread(target=probe)
            prober.start()
            try:
                r, seconds = timed(lambda: api.post("/v1/chat/completions", json=normal_chat()))
            finally:
                done.set()
                prober.join()
    message = r.json()["error"]["message"]
    # cut before it was scrubbed, at a word: the one 60 KB word is left out whole
    assert r.status_code == 400 and message.startswith("cannot tokenize:"), r.text[:300]
    assert len(message) < 600, len(message)
    assert seconds < REFUSED_WITHIN, f"the refusal took {seconds:.2f} s"
    assert probes and max(probes) < REFUSED_WITHIN, probes
