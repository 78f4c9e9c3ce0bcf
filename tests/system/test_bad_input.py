"""Bad input, against real processes (two torch agents on the embedded model and a panel pairing
them): schemathesis over the panel's OpenAI API and the agent's API, then targeted bad requests
through the panel. Whatever comes in: no 5xx, no crash (the processes stay up and answer), no
hang (every call has a timeout), no leak (the agents end idle), each refusal a clear JSON error,
and the next good request works.

Cost is kept bounded on two cores: the agents serve a 64-token context, so the product's own
check (prompt + max_tokens within the context, a 400 otherwise) caps what any request can make
the model generate; the fuzzed schemas ask for at most 4 tokens and short prompts in valid cases,
and cases that would still run the model for longer are skipped (`runs_long`). The schemathesis
counts (cases, statuses, 5xx per operation) go to reports/bad_input.json.
"""

from __future__ import annotations

import contextlib
import re
import select
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from node_agent.app import OPEN_PATHS

from ..agents import AgentProcess, PanelProcess, settle
from ..conftest import write_report
from ..fuzzing import (
    CALL_TIMEOUT,
    VOCAB,
    fuzz,
    fuzz_agent,
    narrowed,
    panel_answer,
    path_parameter,
    without_headers,
)

CONTEXT = 64  # tokens: the agents' context length (see the module docstring)
COUNTS: dict[str, dict] = {}  # schemathesis cases and 5xx per API, written to reports/bad_input.json


@pytest.fixture(scope="module")
def cluster(smol_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("bad-input")
    args = ("--context-length", str(CONTEXT), "--handoff-ttl", "3")  # fuzzed handoffs nobody reads expire soon
    # one compute thread each: two agents, the panel and the test share two cores, and OpenMP
    # threads that spin-wait on a busy core made every forward pass several times slower
    env = {"OMP_NUM_THREADS": "1"}
    with contextlib.ExitStack() as stack:
        p = AgentProcess("torch", smol_dir, home / "p", *args, env=env)
        stack.callback(p.stop)
        d = AgentProcess("torch", smol_dir, home / "d", *args, env=env)
        stack.callback(d.stop)
        p.wait_ready(), d.wait_ready()  # both load at once
        panel = stack.enter_context(PanelProcess(home / "panel", "--pair", f"pd={p.url},{d.url},threshold=1"))
        api = stack.enter_context(
            httpx.Client(base_url=panel.url, timeout=CALL_TIMEOUT, headers={"Authorization": f"Bearer {panel.api_key}"})
        )
        yield {"p": p, "d": d, "panel": panel, "api": api, "node": f"node/{d.status()['name']}"}


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    if COUNTS:
        print(f"\nschemathesis: {COUNTS}")
        write_report("bad_input", COUNTS)


def alive_and_idle(cluster) -> None:
    """No process died, each answers, a good request works, and the agents hold nothing."""
    for name in ("p", "d", "panel"):
        assert cluster[name].proc.poll() is None, f"{name} exited:\n{''.join(cluster[name].log[-40:])}"
    for a in (cluster["p"], cluster["d"]):
        assert httpx.get(a.url + "/healthz", timeout=CALL_TIMEOUT).json() == {"ok": True}
    good(cluster)
    settle(cluster["p"], cluster["d"])


def good(cluster, model: str = "pd") -> None:
    r = cluster["api"].post(
        "/v1/completions", json={"model": model, "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def test_schemathesis_agent_api(cluster):
    """The decoder's API (tests/fuzzing.py: every route but the link benchmark, whose bound is
    checked here)."""
    d = cluster["d"]
    COUNTS["agent"] = fuzz_agent(d, cluster["p"], CONTEXT)
    with d.client() as c:
        for count in ("0", "100001", "many"):
            r = c.get("/v1/bench/pages", params={"count": count})
            assert r.status_code == 400 and r.json()["error"]["message"], (count, r.status_code, r.text)
    alive_and_idle(cluster)


def test_schemathesis_panel_openai_api(cluster):
    api = cluster["api"]
    doc = api.get("/v1/openapi.json").json()
    model = {"enum": ["pd", cluster["node"]]}
    # messages the chat template renders, prompts the engine takes; short, as prefill costs seconds
    # per long prompt on a busy CPU
    message = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"enum": ["system", "user", "assistant"]},
            "content": {"type": "string", "maxLength": 10},
        },
    }
    prompt = {
        "anyOf": [
            {"type": "string", "maxLength": 20},
            {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1},
            {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": VOCAB - 1},
                "minItems": 1,
                "maxItems": 8,
            },
        ]
    }
    small = {"type": "integer", "minimum": 1, "maximum": 4}
    doc = narrowed(
        without_headers(doc, "authorization"),
        {
            ("ChatBody", "model"): model,
            ("CompletionBody", "model"): model,
            ("ChatBody", "n"): {"type": "integer", "minimum": 1, "maximum": 2},
            ("CompletionBody", "n"): {"type": "integer", "minimum": 1, "maximum": 2},
            ("ChatBody", "messages"): {"type": "array", "minItems": 1, "maxItems": 2, "items": message},
            ("CompletionBody", "prompt"): prompt,
            ("ChatBody", "max_tokens"): small,
            ("CompletionBody", "max_tokens"): small,
            ("ChatBody", "max_completion_tokens"): small,
            ("CompletionBody", "max_completion_tokens"): small,
            ("ResponsesBody", "model"): model,
            ("ResponsesBody", "input"): {
                "anyOf": [{"type": "string", "maxLength": 20}, {"type": "array", "maxItems": 2, "items": message}]
            },
            ("ResponsesBody", "max_output_tokens"): small,
            # the API takes some parameters it does not declare (and refuses unknown ones): valid cases send none
            ("ChatBody", None): False,
            ("CompletionBody", None): False,
            ("ResponsesBody", None): False,
        },
    )
    # any text is a response id the panel looks up: invalid ids are those of another shape
    doc = path_parameter(doc, "response_id", {"type": "string", "pattern": "^resp_[0-9a-f]{32}$"})
    for body, field in (
        ("ChatBody", "max_tokens"),
        ("CompletionBody", "max_tokens"),
        ("ResponsesBody", "max_output_tokens"),
    ):
        doc["components"]["schemas"][body]["required"].append(field)  # without it: 256 tokens, more than fits
    COUNTS["panel"] = fuzz(cluster["panel"].url, doc, dict(api.headers), panel_answer, CONTEXT)
    alive_and_idle(cluster)


# ---- targeted bad requests through the panel -----------------------------------------------
ENDPOINTS = [
    ("/v1/chat/completions", False),
    ("/v1/chat/completions", True),
    ("/v1/completions", False),
    ("/v1/completions", True),
]


def request_body(path: str, stream: bool, model: str = "pd", **extra) -> dict:
    what = {"messages": [{"role": "user", "content": "Say hi."}]} if "chat" in path else {"prompt": "Say hi."}
    return {"model": model, **what, "max_tokens": 2, "temperature": 0, "stream": stream, **extra}


def refused(r: httpx.Response, status: int, *words: str) -> dict:
    """A 4xx in OpenAI's shape, whose message says what is wrong."""
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    error = r.json()["error"]
    assert error["message"] and error["type"], error
    for word in words:
        assert word in error["message"], (word, error["message"])
    return error


@pytest.mark.parametrize("path, stream", ENDPOINTS)
def test_prompt_longer_than_the_context_and_huge_max_tokens(cluster, path, stream):
    api = cluster["api"]
    long = "Tell me everything about rivers, lakes, mountains and seas. " * 12
    what = {"messages": [{"role": "user", "content": long}]} if "chat" in path else {"prompt": long}
    refused(api.post(path, json={**request_body(path, stream), **what}), 400, "context length")
    for max_tokens in (CONTEXT, 10**9, 10**30):
        error = refused(api.post(path, json=request_body(path, stream, max_tokens=max_tokens)), 400, "context length")
        assert str(max_tokens) in error["message"]
    for model in ("pd", cluster["node"]):
        refused(api.post(path, json=request_body(path, stream, model=model, max_tokens=0)), 400, "max_tokens")
    good(cluster)
    settle(cluster["p"], cluster["d"])


@pytest.mark.parametrize("path, stream", ENDPOINTS)
def test_bad_sampling_values(cluster, path, stream):
    api = cluster["api"]
    for name, value in [
        ("temperature", -1),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("max_tokens", -5),
        ("max_completion_tokens", "many"),
        ("max_completion_tokens", [1]),
        ("seed", 2**64),
        ("seed", "x"),
        ("presence_penalty", "x"),
        ("n", 17),
        ("stop", 3),
        ("stop", ["a", "b", "c", "d", "e"]),  # OpenAI's bound: 4
        ("top_logprobs", 21),  # on chat: needs logprobs (below: past its bound); on completions: not a field
        ("logprobs", 21 if "chat" not in path else "many"),
    ]:
        error = refused(api.post(path, json=request_body(path, stream, **{name: value})), 400, name)
        assert error["param"] == name, error
    # JSON has no NaN or Infinity, but Python's json (and so a lenient client) sends them
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        for value in ("NaN", "Infinity", "-Infinity"):
            raw = httpx.Request("POST", "/", json=request_body(path, stream)).content.decode()
            raw = raw[:-1] + f', "{name}": {value}}}'
            r = api.post(path, content=raw.encode(), headers={"Content-Type": "application/json"})
            error = refused(r, 400, name)
            assert error["param"] == name, error
    if "chat" in path:
        error = refused(api.post(path, json=request_body(path, stream, logprobs=True, top_logprobs=21)), 400, "20")
        assert error["param"] == "top_logprobs", error
    # a negative seed is valid (OpenAI's seed is a signed 64-bit integer)
    r = api.post(path, json=request_body(path, False, seed=-1, temperature=0.7))
    assert r.status_code == 200, r.text
    settle(cluster["p"], cluster["d"])


@pytest.mark.parametrize("path, stream", ENDPOINTS)
def test_unknown_model(cluster, path, stream):
    for model in ("nope", "node/nope", "", "pd/x"):
        error = refused(cluster["api"].post(path, json=request_body(path, stream, model=model)), 404, "does not exist")
        assert error["code"] == "model_not_found"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_bodies_that_are_not_json(cluster, path):
    api, json_type = cluster["api"], {"Content-Type": "application/json"}
    valid = httpx.Request("POST", "/", json=request_body(path, True)).content
    refused(api.post(path, content=valid[:-7], headers=json_type), 400, "not valid JSON")
    refused(api.post(path, content=b"", headers=json_type), 400)
    refused(api.post(path, content=b"[1, 2", headers=json_type), 400, "not valid JSON")
    # invalid UTF-8 inside a string and as a whole body
    refused(api.post(path, content=valid.replace(b"Say hi.", b"Say \xff\xfe hi."), headers=json_type), 400, "UTF-8")
    refused(api.post(path, content=b"\xc3\x28" * 100, headers=json_type), 400, "UTF-8")
    refused(api.post(path, content=b"[]", headers=json_type), 400)
    refused(api.post(path, content=b'"text"', headers=json_type), 400)
    # the wrong content type, or none
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {"Content-Type": content_type} if content_type else {}  # httpx sends none with raw content
        refused(api.post(path, content=valid, headers=headers), 415, "application/json")
    good(cluster)


def test_unknown_endpoint_and_method(cluster):
    api = cluster["api"]
    refused(api.get("/v1/nothing-here"), 404, "/v1/nothing-here")
    r = api.delete("/v1/completions")
    refused(r, 405, "DELETE")
    assert r.headers["allow"] == "POST"


def raw_http(url: str, head: bytes, body: bytes = b"", rcvbuf: int | None = None) -> socket.socket:
    """A plain socket that sends a request (its head, then whatever part of the body we choose)."""
    u = urlsplit(url)
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(CALL_TIMEOUT)
    s.connect((u.hostname, u.port))
    s.sendall(head + body)
    return s


def read_all(s: socket.socket, pace: float = 0.0, size: int = 65536) -> bytes:
    out = b""
    while chunk := s.recv(size):
        out += chunk
        if pace:
            time.sleep(pace)
    return out


def read_one(s: socket.socket) -> tuple[bytes, bytes]:
    """One response with a Content-Length on a connection that stays open: (head, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    )
    while len(body) < length:
        body += s.recv(65536)
    return head, body


def head_for(cluster, path: str, length: int | None, close: bool = True) -> bytes:
    u = urlsplit(cluster["panel"].url)
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    connection = "Connection: close\r\n" if close else ""
    return (
        f"POST {path} HTTP/1.1\r\nHost: {u.netloc}\r\nAuthorization: Bearer {cluster['panel'].api_key}\r\n"
        f"Content-Type: application/json\r\n{framing}\r\n{connection}\r\n"
    ).encode()


def test_oversized_bodies_are_refused_without_being_read(cluster):
    from control_panel.gate import MAX_BODY_BYTES

    # announced as 1 GiB, of which 1 KiB is ever sent: the answer comes from the header alone
    t0 = time.monotonic()
    with contextlib.closing(
        raw_http(
            cluster["panel"].url,
            head_for(cluster, "/v1/completions", 1 << 30),
            b'{"model": "pd", "prompt": "' + b"x" * 1024,
        )
    ) as s:
        answer = read_all(s)
    took = time.monotonic() - t0
    assert took < 5, took  # 4 ms measured at load average 7.5 on two cores
    status, _, body = answer.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 413"), answer[:300]
    assert b'"error"' in body and b"larger than the limit" in body, body
    # a chunked body (no length announced) is refused once it passes the limit; the panel reads
    # the rest of it to keep the connection, which then serves the next request
    chunk = b"x" * 65536
    framed = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(MAX_BODY_BYTES // len(chunk) + 2))
    with contextlib.closing(
        raw_http(
            cluster["panel"].url, head_for(cluster, "/v1/chat/completions", None, close=False), framed + b"0\r\n\r\n"
        )
    ) as s:
        head, body = read_one(s)
        assert head.startswith(b"HTTP/1.1 413") and b"larger than the limit" in body, (head, body)
        s.sendall(
            b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer %s\r\n\r\n"
            % cluster["panel"].api_key.encode()
        )
        head, body = read_one(s)
        assert head.startswith(b"HTTP/1.1 200") and b'"pd"' in body, (head, body)
    # through an ordinary client, both endpoints
    big = {"model": "pd", "prompt": "x" * (MAX_BODY_BYTES + 1), "max_tokens": 1}
    for path in ("/v1/completions", "/v1/chat/completions"):
        refused(cluster["api"].post(path, json=big), 413, "larger than the limit")
    alive_and_idle(cluster)


FLOOD = 256 << 20  # bytes a flood offers (issue 22's measured attack: 1.5 GB of an agent's RSS)
MIB = 1 << 20


def flood(url: str, method: str, path: str, key: str | None) -> tuple[bytes, int]:
    """Offer a FLOOD-byte chunked body, 1 MiB a chunk, until the server answers or stops reading:
    (the answer's status line, the bytes sent by then)."""
    u = urlsplit(url)
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: {u.netloc}\r\n{auth}Content-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    ).encode()
    chunk = b"%x\r\n%s\r\n" % (MIB, b" " * MIB)
    sent = 0
    with socket.create_connection((u.hostname, u.port), timeout=CALL_TIMEOUT) as s:
        s.sendall(head)
        s.settimeout(1)  # a server that stops reading: stop sending, read its answer
        try:
            while sent < FLOOD and not select.select([s], [], [], 0)[0]:
                s.sendall(chunk)
                sent += MIB
        except (TimeoutError, BrokenPipeError, ConnectionResetError):
            pass
        s.settimeout(CALL_TIMEOUT)
        answer = b""
        with contextlib.suppress(ConnectionResetError):
            while b"\r\n" not in answer and (data := s.recv(65536)):
                answer += data
    return answer.split(b"\r\n", 1)[0], sent


def rss(process, field: str = "VmHWM") -> int:
    """The process's peak resident set so far (VmHWM), or its current one (VmRSS), in bytes."""
    status = open(f"/proc/{process.proc.pid}/status").read()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith(field + ":"))) * 1024


def test_a_flood_of_body_is_refused_before_it_is_read(cluster):
    """Issue 22: a 256 MiB chunked body to every agent route and to the panel's API. Without the
    credential: 401 before any of the body is read; with it: 413 once past the limit (8 MiB on an
    agent, 4 MiB on the panel). No process's peak RSS grows by 16 MiB."""
    d, panel = cluster["d"], cluster["panel"]
    with d.client() as c:
        doc = c.get("/v1/openapi.json").json()
    routes = [
        (method.upper(), re.sub(r"\{[^}]+\}", "0" * 32, path)) for path, ops in doc["paths"].items() for method in ops
    ]
    assert len(routes) >= 12, routes
    names = ("p", "d", "panel")
    before = {(n, f): rss(cluster[n], f) for n in names for f in ("VmHWM", "VmRSS")}
    for method, path in routes:
        status, sent = flood(d.url, method, path, None)
        if path in OPEN_PATHS:  # no key needed: a POST's body is cut at the limit, a GET's is not read
            assert status.startswith(b"HTTP/1.1 413" if method == "POST" else b"HTTP/1.1 200"), (path, status)
            continue
        assert status.startswith(b"HTTP/1.1 401"), (method, path, status)
        if method == "POST":
            status, sent = flood(d.url, method, path, d.key)
            assert status.startswith(b"HTTP/1.1 413"), (method, path, status)
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        status, _ = flood(panel.url, "POST", path, None)
        assert status.startswith(b"HTTP/1.1 401"), (path, status)
        status, _ = flood(panel.url, "POST", path, panel.api_key)
        assert status.startswith(b"HTTP/1.1 413"), (path, status)
    # the peak (a process's peak may sit well above its resident set, from loading the model) and
    # the resident set now
    grown = {f"{n} {f}": round((rss(cluster[n], f) - before[n, f]) / MIB, 1) for n, f in before}
    print(f"\nRSS growth under {len(routes)} agent routes and 3 panel routes flooded (MiB): {grown}")
    assert all(g < 16 for g in grown.values()), grown
    alive_and_idle(cluster)


def sse_request(cluster, max_tokens: int, rcvbuf: int | None = None) -> socket.socket:
    body = httpx.Request(
        "POST",
        "/",
        json={"model": "pd", "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0, "stream": True},
    ).content
    return raw_http(cluster["panel"].url, head_for(cluster, "/v1/completions", len(body)), body, rcvbuf=rcvbuf)


def test_a_client_that_reads_sse_slowly(cluster):
    with contextlib.closing(sse_request(cluster, 8, rcvbuf=1024)) as s:
        answer = read_all(s, pace=0.01, size=97)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    assert answer.count(b"data: ") >= 3 and b"data: [DONE]" in answer
    alive_and_idle(cluster)


def test_a_client_that_never_reads(cluster):
    """Holds a streaming request open without reading a byte, then hangs up: meanwhile the panel
    serves others, and afterwards nothing is held anywhere. (Outputs of this context are smaller
    than the socket buffers, so the panel is not held up by backpressure here.)"""
    s = sse_request(cluster, 8, rcvbuf=1024)
    try:
        good(cluster)  # served while the other client is stuck
        time.sleep(1)
        good(cluster, cluster["node"])
    finally:
        s.close()
    alive_and_idle(cluster)
    # hanging up at once, before the first token
    for _ in range(3):
        sse_request(cluster, 8).close()
    alive_and_idle(cluster)
