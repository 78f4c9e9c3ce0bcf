"""Security review (issue 8, item 5): what a stranger on the LAN or a wrong credential gets.

1. Every route of the panel needs its credential (enumerated from the app object); the agent's
   routes are checked the same way, with the same enumerator, in tests/unit/test_agent_auth.py.
2. No secret in mDNS announcements, process logs, the request log or error bodies.
3. Model paths stay inside an agent's model roots, on the agent and through the panel's form.
4. Failed logins are rate-limited per client address.
5. Cookies are HttpOnly and SameSite (and Secure over HTTPS).
6. Passwords and API keys are stored hashed; the cluster key is stored as is (it must be recovered).
7. The UI's add-node and pair forms hand the cluster key only to a URL that proved it holds it.

In-process tests use the real panel app through Starlette's TestClient; the leak and path tests
run one real agent and one real panel process, because logs and files are what they check.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import sqlite3
import statistics
import time
from http.cookies import SimpleCookie
from http.server import BaseHTTPRequestHandler

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlmodel import Session, select

from control_panel.app import create_panel_app
from control_panel.login_limit import LoginLimiter
from control_panel.models import Node
from control_panel.security import create_api_key, ensure_admin_password
from control_panel.services import MAX_FOUND, note_discovered
from control_panel.ui import sessions
from control_panel.ui.sessions import IDLE_SECONDS, SESSION_COOKIE
from tandem_protocol.discovery import Peer

from ..agents import AgentProcess, LocalHTTPServer, PanelProcess
from ..unit.test_agent_auth import http_routes

CLUSTER_KEY = "tdm_security-review-cluster-key-4e8a1f"
LOCAL = "http://127.0.0.1"  # a Host the panel answers to (TestClient's default, testserver, is not)

# Routes that answer without a credential, and why each may.
OPEN = {
    ("GET", "/healthz"): "liveness for supervisors and `tandem up`; says only that the panel runs",
    ("GET", "/login"): "the page where one logs in",
    ("POST", "/login"): "logging in itself (CSRF-checked and rate-limited)",
    ("POST", "/lang"): "the language switcher on the login page (CSRF-checked; sets only the lang cookie)",
}
OPEN_MOUNTS = {"/static": "htmx and the stylesheet: public files, no data"}


class Clock:
    """A clock the test moves, for the login limiter."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def clock():
    return Clock()


@pytest.fixture(scope="module")
def panel(tmp_path_factory, clock):
    """The real panel app in-process, with an admin password, an API key and a login limiter on a
    clock the test moves."""
    app = create_panel_app(
        tmp_path_factory.mktemp("panel-security"), CLUSTER_KEY, login_limiter=LoginLimiter(clock=clock)
    )
    app.state.password = ensure_admin_password(app.state.db)
    app.state.api_key = create_api_key(app.state.db, "security")
    return app


def csrf_of(html: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', html).group(1)


def log_in(client: TestClient | httpx.Client, password: str):
    return client.post("/login", data={"password": password, "csrf": csrf_of(client.get("/login").text)})


# ---- 1. every panel route needs its credential ---------------------------------------------------


def test_every_panel_route_needs_its_credential(panel):
    """The OpenAI API answers 401 in OpenAI's error shape; a UI page redirects to /login (a GET
    comes back there after login), an htmx or fetch() call gets 401. A UI session does not open
    the API, an API key or the cluster key does not open the UI."""
    routes, mounts = http_routes(panel)
    assert mounts == list(OPEN_MOUNTS)
    assert len(routes) >= 20, routes
    assert set(OPEN) <= set(routes), "the allow-list names a route that no longer exists"
    with TestClient(panel, base_url=LOCAL, follow_redirects=False) as c:
        assert log_in(c, panel.state.password).status_code == 303
        session = c.cookies.get("tandem_session")
        c.cookies.clear()
        api_creds = [
            {},
            {"Authorization": "Bearer tsk_wrong"},
            {"Authorization": f"Bearer {CLUSTER_KEY}"},
            {"Authorization": panel.state.api_key},
            {"Cookie": f"tandem_session={session}"},
        ]
        ui_creds = [
            {},
            {"Cookie": "tandem_session=forged.value.sig"},
            {"Authorization": f"Bearer {panel.state.api_key}"},
            {"Authorization": f"Bearer {CLUSTER_KEY}"},
        ]
        for method, path in routes:
            url = re.sub(r"\{[^}]+\}", "1", path)
            if (method, path) in OPEN:  # answered without any credential (a POST needs only its CSRF token)
                c.cookies.clear()
                if method == "GET":
                    assert c.get(url).status_code == 200, path
                else:
                    form = {
                        "csrf": csrf_of(c.get("/login").text),
                        "password": panel.state.password,
                        "lang": "de",
                        "next": "/help",
                    }
                    r = c.post(url, data=form)
                    assert r.status_code == 303 and r.headers["location"] == "/help", (path, r.status_code)
                continue
            if path.startswith("/v1/"):
                for headers in api_creds:
                    c.cookies.clear()
                    r = c.request(method, url, headers=headers, json={})
                    assert r.status_code == 401, (method, path, headers, r.status_code)
                    assert r.json()["error"]["code"] == "invalid_api_key", r.text
                    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
                continue
            for headers in ui_creds:
                for fragment in (False, True):  # a page or form, then an htmx request
                    hx = {"HX-Request": "true"} if fragment else {}
                    c.cookies.clear()
                    r = c.request(method, url, headers={"Accept": "text/html", **hx, **headers}, json={})
                    if fragment or path.startswith("/ui/"):
                        assert r.status_code == 401 and r.headers["HX-Redirect"] == "/login", (method, path, headers)
                    else:
                        back = f"?next={url}" if method == "GET" else ""
                        assert r.status_code == 303 and r.headers["location"] == f"/login{back}", (
                            method,
                            path,
                            headers,
                            r.status_code,
                            r.headers.get("location"),
                        )
                    assert CLUSTER_KEY not in r.text and panel.state.api_key not in r.text
        assert c.get("/static/htmx.min.js").status_code == 200
        c.cookies.clear()  # and the credentials refused above open their own side
        assert c.get("/v1/models", headers={"Authorization": f"Bearer {panel.state.api_key}"}).status_code == 200
        assert c.get("/help", headers={"Cookie": f"tandem_session={session}"}).status_code == 200


def test_a_deleted_key_is_refused_from_the_next_request(tmp_path):
    """The API's key check and model lookup are kept in memory between requests; a key deleted or
    a pair changed in the panel counts from the very next request."""
    from sqlmodel import Session

    from control_panel.api.errors import OpenAIError
    from control_panel.db import open_db
    from control_panel.models import ApiKey, Node, Pool, PoolMember
    from control_panel.security import api_key_valid
    from control_panel.services import delete_pool, delete_row
    from control_panel.targets import resolve_target

    engine = open_db(tmp_path / "panel.db")
    key = create_api_key(engine, "t")
    assert api_key_valid(engine, key) and api_key_valid(engine, key)
    assert not api_key_valid(engine, key + "x")
    with Session(engine) as s:
        a, b = Node(name="a", url="http://a:1", paired=True), Node(name="b", url="http://b:1", paired=True)
        s.add(a), s.add(b)
        s.commit()
        pool = Pool(name="p", context_length=64)
        s.add(pool)
        s.flush()
        for node, role in ((a, "prefill"), (b, "decode")):
            s.add(PoolMember(pool_id=pool.id, node_id=node.id, role=role, engine="torch", model_path="m"))
        s.commit()
        pool_id, key_id = pool.id, s.exec(select(ApiKey.id)).first()
    assert resolve_target(engine, "p").prefill_urls == ("http://a:1",)
    assert resolve_target(engine, "p") is resolve_target(engine, "p")  # served from memory
    with Session(engine) as s:
        for member in s.exec(select(PoolMember)):
            member.role = "decode" if member.role == "prefill" else "prefill"
            s.add(member)
        s.commit()
    assert resolve_target(engine, "p").prefill_urls == ("http://b:1",)
    delete_row(engine, ApiKey, key_id)
    assert not api_key_valid(engine, key)
    delete_pool(engine, pool_id)
    with pytest.raises(OpenAIError):
        resolve_target(engine, "p")


# ---- 4. login rate limit -------------------------------------------------------------------------


def test_failed_logins_are_limited_per_address(panel, clock):
    """5 failures within 60 s: the next attempts get 429 + Retry-After and a translated message,
    even with the right password; other addresses are not affected; a success starts over."""
    password = panel.state.password
    guesser = TestClient(panel, base_url=LOCAL, follow_redirects=False, client=("198.51.100.7", 40000))
    other = TestClient(panel, base_url=LOCAL, follow_redirects=False, client=("198.51.100.8", 40000))
    start = clock.now
    for i in range(5):
        clock.now = start + i
        assert log_in(guesser, f"guess-{i}").status_code == 401
    clock.now = start + 10
    r = log_in(guesser, password)  # right, but not even looked at
    assert r.status_code == 429 and r.headers["Retry-After"] == "50"  # when the first failure leaves the window
    assert "Too many failed attempts: wait 50 s, then try again." in r.text and "tandem_session" not in r.cookies
    r = guesser.post(
        "/login",
        data={"password": password, "csrf": csrf_of(guesser.get("/login").text)},
        headers={"Accept-Language": "de"},
    )
    assert r.status_code == 429 and "Zu viele Fehlversuche: Warten Sie 50 s" in r.text
    assert log_in(other, password).status_code == 303  # another address logs in
    clock.now = start + 59.5
    assert log_in(guesser, password).headers["Retry-After"] == "1"
    clock.now = start + 60.5  # the first failure has left the window: one more try
    assert log_in(guesser, "guess-5").status_code == 401
    assert log_in(guesser, password).status_code == 429
    clock.now = start + 200
    assert log_in(guesser, "guess-6").status_code == 401
    assert log_in(guesser, password).status_code == 303  # a success clears the count: 5 more failures pass
    guesser.cookies.clear()  # logged out again
    for i in range(5):
        assert log_in(guesser, f"again-{i}").status_code == 401
    assert log_in(guesser, password).status_code == 429


# ---- 5. cookies ----------------------------------------------------------------------------------


def _cookies(response) -> dict:
    jar = SimpleCookie()
    for header in response.headers.get_list("set-cookie"):
        jar.load(header)
    return dict(jar)


def test_a_signed_out_or_idle_session_opens_nothing(panel, monkeypatch):
    """Issue 22: a copy of a session cookie taken before sign-out (or left idle past
    IDLE_SECONDS) is refused: sessions are rows on the server, not only signed cookies."""
    for ending in ("sign out", "idle"):
        c = TestClient(panel, base_url=LOCAL, follow_redirects=False)
        assert log_in(c, panel.state.password).status_code == 303
        stolen = c.cookies.get(SESSION_COOKIE)
        assert c.get("/nodes").status_code == 200
        if ending == "sign out":
            assert c.post("/logout", data={"csrf": csrf_of(c.get("/settings").text)}).status_code == 303
        else:
            later = time.time() + IDLE_SECONDS + 1
            monkeypatch.setattr(sessions.time, "time", lambda later=later: later)
        thief = TestClient(panel, base_url=LOCAL, follow_redirects=False, cookies={SESSION_COOKIE: stolen})
        r = thief.get("/nodes")
        assert r.status_code == 303 and r.headers["location"].startswith("/login"), (ending, r.status_code)
        monkeypatch.undo()


def test_foreign_hosts_and_origins_are_refused_by_the_panel(panel):
    """Issue 22: the panel answered 200 to `Host: evil.example` (DNS rebinding); a page of
    another site posting to it is refused too."""
    c = TestClient(panel, base_url=LOCAL, follow_redirects=False)
    for path in ("/login", "/v1/models", "/healthz"):
        r = c.get(path, headers={"Host": "evil.example"})
        assert r.status_code == 400 and "TANDEM_ALLOWED_HOSTS" in r.text, (path, r.status_code, r.text)
    page = c.get("/login", headers={"Host": "localhost:8000"})
    assert page.status_code == 200 and page.headers["X-Content-Type-Options"] == "nosniff"
    assert "script-src 'self';" in page.headers["Content-Security-Policy"] and "<script>" not in page.text
    r = c.post("/login", data={"password": "x", "csrf": "y"}, headers={"Origin": "http://evil.example"})
    assert r.status_code == 403, r.text
    r = c.post("/v1/chat/completions", json={}, headers={"Origin": "https://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["message"], r.text


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_cookies_are_httponly_and_samesite(panel, scheme):
    c = TestClient(
        panel,
        base_url=f"{scheme}://127.0.0.1",
        follow_redirects=False,
        client=(f"203.0.113.{1 if scheme == 'http' else 2}", 1),
    )
    page = c.get("/login")
    r = log_in(c, panel.state.password)
    lang = c.post("/lang", data={"lang": "fr", "csrf": csrf_of(c.get("/nodes").text), "next": "/nodes"})
    set_cookies = {**_cookies(page), **_cookies(r), **_cookies(lang)}
    assert set(set_cookies) == {"tandem_csrf", "tandem_session", "lang"}, set_cookies
    for name, morsel in set_cookies.items():
        assert morsel["httponly"] is True, name
        assert morsel["samesite"].lower() == "lax", name
        assert morsel["path"] == "/", name
        assert bool(morsel["secure"]) == (scheme == "https"), name  # Secure wherever the panel is served over TLS


# ---- 2. no secret in mDNS ------------------------------------------------------------------------


def test_mdns_announces_no_secret(engines):
    """The TXT record an agent would send, built by the code the agent runs, from a config that
    holds the cluster key; then after an engine switch. A property outside the list is refused."""
    from node_agent.app import AgentConfig
    from tandem_protocol.discovery import ANNOUNCED_KEYS, Announcer, announced_properties

    config = AgentConfig(node_id="a" * 32, name="desk-pc", cluster_key=CLUSTER_KEY, model_name="smollm2")
    announcer = Announcer(announced_properties(config, engines["torch"]), 7411, ["127.0.0.1"])
    txt = announcer._service_info().text  # the record's bytes as zeroconf sends them
    assert set(announcer.properties) == set(ANNOUNCED_KEYS)
    assert b"engine=torch" in txt and b"node_id=" + b"a" * 32 in txt
    asyncio.run(announcer.update(engine="mlx", model="other"))
    txt += announcer._service_info().text
    assert b"engine=mlx" in txt
    for secret in (CLUSTER_KEY, CLUSTER_KEY[4:], "cluster_key"):
        assert secret.encode() not in txt, secret
    for bad in (
        lambda: Announcer({**announcer.properties, "cluster_key": CLUSTER_KEY}, 1, ["127.0.0.1"]),
        lambda: asyncio.run(announcer.update(cluster_key=CLUSTER_KEY)),
    ):
        with pytest.raises(ValueError, match="cluster_key"):
            bad()


# ---- real processes: an agent and a panel --------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def paths(tmp_path_factory, smol_dir):
    """A model root `models/` with a link in it to a loadable checkpoint outside every root; and
    the agent on it, started first so that it loads while the in-process tests run."""
    home = tmp_path_factory.mktemp("security")
    root, outside = home / "models", home / "elsewhere" / "model"
    root.mkdir()
    outside.mkdir(parents=True)
    for f in smol_dir.iterdir():
        (outside / f.name).symlink_to(f)
    (root / "escape").symlink_to(outside, target_is_directory=True)
    agent = AgentProcess("torch", smol_dir, home / "agent", "--model-root", str(root), key=CLUSTER_KEY)
    # a second node for the pair form, sharing the first one's data dir (each has its own node id)
    second = AgentProcess(
        "torch", smol_dir, home / "agent", "--model-root", str(root), "--name", "torch-agent-2", key=CLUSTER_KEY
    )
    try:
        yield {"home": home, "root": root, "outside": outside, "agent": agent, "second": second}
    finally:
        agent.stop()
        second.stop()


@pytest.fixture(scope="module")
def cluster(paths):
    """The agents, ready, and a panel that knows them, so that the pair form has two nodes to pair."""
    agent, second = paths["agent"], paths["second"]
    agent.wait_ready(), second.wait_ready()
    with PanelProcess(paths["home"] / "panel", "--node", agent.url, "--node", second.url, key=CLUSTER_KEY) as panel:
        yield {
            **paths,
            "panel": panel,
            "db": paths["home"] / "panel" / "panel" / "panel.db",  # $TANDEM_HOME/panel/
            "password": panel.admin_password,
            "api_keys": [panel.api_key],
        }


@pytest.fixture(scope="module")
def traffic(cluster):
    """Drive both processes: good and bad API keys, the cluster key where an API key belongs, a
    wrong and a right password, a new API key and a new password made in the UI, a wrong cluster
    key when pairing, every page. Returns what each request answered, and the wrong values sent."""
    agent, panel = cluster["agent"], cluster["panel"]
    wrong = {
        "api_key": "tsk_presented-wrong-api-key-91d2",
        "password": "presented-wrong-password-77b1",
        "cluster_key": "tdm_presented-wrong-cluster-key-3c55",
    }
    answers = {}
    api = httpx.Client(base_url=panel.url, timeout=120)
    auth = {"Authorization": f"Bearer {panel.api_key}"}
    chat = {"model": "node/torch-agent", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    answers["api wrong key"] = api.get("/v1/models", headers={"Authorization": f"Bearer {wrong['api_key']}"})
    answers["api cluster key"] = api.post(
        "/v1/chat/completions", json=chat, headers={"Authorization": f"Bearer {CLUSTER_KEY}"}
    )
    answers["api ok"] = api.post("/v1/chat/completions", json=chat, headers=auth)
    answers["api refused sampling"] = api.post("/v1/chat/completions", json={**chat, "min_p": 0.5}, headers=auth)
    with httpx.Client(base_url=agent.url, timeout=30) as a:
        answers["agent wrong key"] = a.get("/v1/status", headers={"Authorization": f"Bearer {wrong['cluster_key']}"})
        answers["agent no key"] = a.post("/v1/generate", json={"token_ids": [1]})
    ui = httpx.Client(base_url=panel.url, timeout=120)
    answers["login wrong"] = log_in(ui, wrong["password"])
    answers["login"] = log_in(ui, cluster["password"])
    csrf = csrf_of(ui.get("/settings").text)
    answers["new key"] = ui.post("/settings/keys", data={"name": "made-in-ui", "csrf": csrf})
    cluster["api_keys"].append(re.search(r'id="new-key"[^>]*>(tsk_[^<]+)<', answers["new key"].text).group(1))
    answers["password wrong"] = ui.post(
        "/settings/password", data={"current": wrong["password"], "new": "x" * 12, "confirm": "x" * 12, "csrf": csrf}
    )
    new_password = "new-admin-password-5a0f"
    answers["password"] = ui.post(
        "/settings/password",
        data={"current": cluster["password"], "new": new_password, "confirm": new_password, "csrf": csrf},
    )
    cluster["old_password"], cluster["password"] = cluster["password"], new_password
    csrf = csrf_of(answers["password"].text)  # the session was signed anew, with a new token
    answers["pair wrong key"] = ui.post("/nodes/1/pair", data={"key": wrong["cluster_key"], "csrf": csrf})
    for page in (
        "/nodes",
        "/nodes/table",
        "/nodes/1/pair",
        "/models",
        "/playground",
        "/requests",
        "/help",
        "/settings",
    ):
        answers[page] = ui.get(page)
    api.close()
    yield {"answers": answers, "wrong": wrong, "ui": ui}
    ui.close()


def _secrets(cluster) -> dict[str, str]:
    return {
        "cluster key": CLUSTER_KEY,
        "admin password": cluster["old_password"],
        "new admin password": cluster["password"],
        **{f"API key {i}": k for i, k in enumerate(cluster["api_keys"])},
    }


def test_error_bodies_echo_no_key(cluster, traffic):
    """A refused credential's answer names neither the credential sent nor the real one; nor
    does any page (but the one that shows a new API key once)."""
    a = traffic["answers"]
    expected = {
        "api wrong key": 401,
        "api cluster key": 401,
        "api ok": 200,
        "api refused sampling": 400,
        "agent wrong key": 401,
        "agent no key": 401,
        "login wrong": 401,
        "login": 303,
        "new key": 200,
        "password wrong": 400,
        "password": 200,
        "pair wrong key": 400,
    }
    assert {k: a[k].status_code for k in expected} == expected, {k: a[k].text[:300] for k in expected}
    assert all(a[page].status_code == 200 for page in a if page.startswith("/"))
    assert "differs from the panel" in a["pair wrong key"].text and "wrong" in a["password wrong"].text
    assert a["api wrong key"].json()["error"]["code"] == "invalid_api_key"
    secrets = {**_secrets(cluster), **traffic["wrong"]}
    for name, r in a.items():
        for what, secret in secrets.items():
            if name == "new key" and secret == cluster["api_keys"][1]:
                continue  # shown once, by design
            assert secret not in r.text, f"{name} answer contains the {what}"


def test_no_secret_in_logs_or_the_request_log(cluster, traffic):
    """The processes' output and the request log table hold no key or password, sent right or
    wrong — but the panel's one-time reveal of its first admin password and API key."""
    agent, panel = cluster["agent"], cluster["panel"]
    reveal = panel.lines_matching("admin password") + panel.lines_matching("API key")
    assert len(reveal) == 2 and cluster["old_password"] in reveal[0] and panel.api_key in reveal[1]
    logs = {"agent": "".join(agent.log), "panel": "".join(line for line in panel.log if line not in reveal)}
    with sqlite3.connect(f"file:{cluster['db']}?mode=ro", uri=True) as db:
        rows = db.execute("SELECT * FROM requestlog").fetchall()
        outcomes = {r[0] for r in db.execute("SELECT outcome FROM requestlog")}
    assert outcomes == {"ok", "error"}, rows  # the chat that answered and the one refused
    logs["request log"] = repr(rows)
    for where, text in logs.items():
        for what, secret in {**_secrets(cluster), **traffic["wrong"]}.items():
            assert secret not in text, f"the {where} contains the {what}"


def test_model_paths_stay_in_the_roots(cluster, traffic):
    """`..`, an absolute path elsewhere and a link in a root to a directory outside: refused by the
    agent (400, field model_path) and on the panel's pair form, before anything loads; the link is
    not offered either. The checkpoint outside is loadable, so only the confinement refuses it."""
    from tandem_protocol.model_dir import inspect_model

    agent, root, outside = cluster["agent"], cluster["root"], cluster["outside"]
    inspect_model(outside)  # a supported checkpoint: nothing else would refuse it
    paths = [f"{root}/../elsewhere/model", str(outside), str(root / "escape"), f"{root}/escape/../escape"]
    before = agent.status()
    with agent.client() as c:
        for path in paths:
            for dry_run in (True, False):
                r = c.post("/v1/config", json={"engine": "torch", "model_path": path, "dry_run": dry_run})
                error = r.json()["error"]
                assert r.status_code == 400 and error["field"] == "model_path", (path, r.text)
                assert "outside this node's model roots" in error["message"], error
        listed = c.get("/v1/models/local").json()["models"]
    assert listed and not [m for m in listed if "escape" in m["path"] or "elsewhere" in m["path"]], listed
    ui = traffic["ui"]
    page = ui.get("/models")
    assert "escape" not in page.text and str(outside) not in page.text  # not among the path suggestions
    node_ids = re.findall(r'<option value="(\d+)" [^>]*>torch-agent(?:-2)? \(', page.text)[:2]
    form = {
        "name": "escape",
        "prefill": node_ids[0],
        "decode": node_ids[1],
        "threshold": "0",
        "fallback": "fail",
        "csrf": csrf_of(page.text),
    }
    for path in paths:
        for role in ("prefill", "decode"):
            r = ui.post("/models", data={**form, f"{role}_model_path": path})
            assert r.status_code == 400 and f"{role} node:" in r.text, r.text[-1500:]
            assert "outside this node&#39;s model roots" in r.text
            assert re.search(rf'name="{role}_model_path"[^>]*aria-invalid="true"', r.text)
    after = agent.status()
    assert (after["model_path"], after["contract"]) == (before["model_path"], before["contract"])  # nothing loaded
    with httpx.Client(base_url=cluster["panel"].url) as api:
        models = api.get("/v1/models", headers={"Authorization": f"Bearer {cluster['panel'].api_key}"}).json()
    assert "escape" not in [m["id"] for m in models["data"]]  # no pair was made


# ---- 6. stored hashed ----------------------------------------------------------------------------


def test_secrets_are_stored_hashed(cluster, traffic):
    """The panel's database holds the admin password only as argon2 and API keys only as SHA-256.
    The cluster key is the exception, by design: the panel presents it to every agent (a Bearer
    token), so it must be recoverable; it is stored as is."""
    files = sorted(cluster["db"].parent.glob("panel.db*"))  # with any journal beside it
    stored = b"".join(f.read_bytes() for f in files)
    for what, secret in _secrets(cluster).items():
        if what != "cluster key":
            assert secret.encode() not in stored, f"the {what} is stored in plain text"
    for key in cluster["api_keys"]:
        assert hashlib.sha256(key.encode()).hexdigest().encode() in stored
    assert stored.count(b"$argon2id$") >= 1
    assert CLUSTER_KEY.encode() in stored  # recoverable, see above
    # and the old admin password no longer opens the panel, the new one does
    with httpx.Client(base_url=cluster["panel"].url) as c:
        assert log_in(c, cluster["old_password"]).status_code == 401
        assert log_in(c, cluster["password"]).status_code == 303


# ---- 7. the UI hands the cluster key only to a URL that proved it holds it -----------------------


class Impostor(LocalHTTPServer):
    """An HTTP server on 127.0.0.1 posing as an agent: it answers the identity check with a wrong
    proof, everything else with 200 {}, and records each request: (method, path, Authorization)."""

    def __init__(self):
        self.requests: list[tuple[str, str, str]] = []
        super().__init__(ImpostorHandler)


class ImpostorHandler(BaseHTTPRequestHandler):
    def _answer(self, body: dict):
        self.server.requests.append((self.command, self.path, self.headers.get("Authorization") or ""))
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._answer({})

    def do_POST(self):
        if self.path == "/v1/identity":
            address = f"127.0.0.1:{self.server.server_port}"
            return self._answer({"node_id": "e" * 32, "address": address, "proof": "0" * 64})
        self._answer({})

    def log_message(self, *args):
        pass


UNPROVED = "could not prove it holds the cluster key, so the key was not sent"
UNPROVED_JA = "クラスターキーを持つことを証明できなかったため、キーは送信されていません"


def _refused(r, impostor: Impostor, message: str = UNPROVED):
    assert not any(CLUSTER_KEY in auth for *_, auth in impostor.requests), impostor.requests
    assert r.status_code == 400 and message in r.text, r.text


def _pair_impostor(c: TestClient, app, impostor: Impostor, key: str):
    """The impostor announced on the LAN (as the discovery watcher records it), then paired in the UI."""
    peer = Peer("impostor._tandem._tcp.local.", ["127.0.0.1"], impostor.server_port, {"node_id": "e" * 32})
    asyncio.run(note_discovered(app.state.db, peer, True, app.state.router.cluster_key))
    node_id = re.search(r'href="/nodes/(\d+)/pair"', c.get("/nodes").text).group(1)
    page = c.get(f"/nodes/{node_id}/pair").text
    return c.post(f"/nodes/{node_id}/pair", data={"key": key, "csrf": csrf_of(page)})


def test_an_impostor_is_never_handed_the_cluster_key(panel):
    """Typed in the add-node form, or discovered and paired (with the key typed; left blank, it is
    refused before the node is asked anything), an impostor gets a refusal that says why, and never
    a request carrying the key."""
    with TestClient(panel, base_url=LOCAL, follow_redirects=False) as c, Impostor() as impostor:
        assert log_in(c, panel.state.password).status_code == 303
        _refused(c.post("/nodes", data={"url": impostor.url, "csrf": csrf_of(c.get("/nodes").text)}), impostor)
        # a blank key is not "the panel's own": the user vouches for a node by typing its key
        _refused(_pair_impostor(c, panel, impostor, ""), impostor, "Enter the cluster key")
        _refused(_pair_impostor(c, panel, impostor, CLUSTER_KEY), impostor)
        # asked only whether it is up and to prove itself, once a form with a key
        assert [r[:2] for r in impostor.requests] == [("GET", "/healthz"), ("POST", "/v1/identity")] * 2


def test_the_first_pairing_proves_the_typed_key_before_sending_it(tmp_path):
    """A panel with no cluster key yet pairs with the key the user types: the agent proves it
    holds that key before the key is sent anywhere, and a failed proof leaves the panel keyless."""
    app = create_panel_app(tmp_path)
    app.state.password = ensure_admin_password(app.state.db)
    with TestClient(app, base_url=LOCAL, follow_redirects=False) as c, Impostor() as impostor:
        assert log_in(c, app.state.password).status_code == 303
        _refused(_pair_impostor(c, app, impostor, CLUSTER_KEY), impostor)
        assert app.state.router.cluster_key == ""
        c.cookies.set("lang", "ja")  # the refusal is translated
        _refused(_pair_impostor(c, app, impostor, CLUSTER_KEY), impostor, UNPROVED_JA)
        assert [r[:2] for r in impostor.requests] == [("GET", "/healthz"), ("POST", "/v1/identity")] * 2
        assert app.state.router.cluster_key == ""


def test_files_are_private_to_their_owner(cluster, traffic):
    """Issue 22: the data dirs are 0700 (made 0755 by this test's harness: the processes close
    them), and what is in them (the panel's database with its WAL, node ids) is its owner's alone."""
    homes = [cluster["home"] / "agent", cluster["home"] / "panel"]
    db = cluster["db"]
    files = [db, db.with_name("panel.db-wal"), *(cluster["home"] / "agent" / "node-ids").iterdir()]
    modes = {str(p): oct(p.stat().st_mode & 0o777) for p in [*homes, db.parent, *files]}
    assert all(modes[str(p)] == "0o700" for p in [*homes, db.parent]), modes
    assert all(modes[str(p)] == "0o600" for p in files), modes


def test_a_flood_of_announcements_is_bounded(tmp_path):
    """Issue 22: 1,000 nodes announced by mDNS (anyone on the LAN can announce): the panel keeps
    at most MAX_FOUND unpaired ones, the newest, and its pages stay quick. Costs are CPU seconds
    of this process (the panel runs in it), which other work on the machine does not inflate:
    neither an announcement nor the pages cost more late in the flood than early, and all of it
    stays within 3x of what it costs on a loaded machine."""
    app = create_panel_app(tmp_path, CLUSTER_KEY)
    password = ensure_admin_password(app.state.db)
    costs: list[float] = []

    async def flood(numbers):
        for i in numbers:
            peer = Peer(f"n{i}._tandem._tcp.local.", [f"10.{i // 250}.{i % 250}.1"], 8000, {"node_id": f"{i:032x}"})
            t = time.process_time()
            await note_discovered(app.state.db, peer, True, CLUSTER_KEY)
            costs.append(time.process_time() - t)

    def page_cost(c: TestClient) -> float:
        """/nodes and its found-nodes part, the cheapest of three (the first renders cold)."""
        spent = []
        for _ in range(3):
            t = time.process_time()
            assert c.get("/nodes").status_code == 200 and c.get("/nodes/discovered").status_code == 200
            spent.append(time.process_time() - t)
        return min(spent)

    with TestClient(app, base_url=LOCAL, follow_redirects=False) as c:
        assert log_in(c, password).status_code == 303
        asyncio.run(flood(range(200)))  # the list is full from the 64th on
        full = page_cost(c)
        asyncio.run(flood(range(200, 1000)))
        flooded = page_cost(c)
    with Session(app.state.db) as s:
        found = s.exec(select(Node).where(Node.source == "mdns")).all()
    assert len(found) == MAX_FOUND and {n.node_id for n in found} == {
        f"{i:032x}" for i in range(1000 - MAX_FOUND, 1000)
    }
    early, late = statistics.median(costs[100:200]), statistics.median(costs[900:])
    print(
        f"\n1,000 announcements: {sum(costs):.2f} CPU s, {early * 1000:.1f} ms each at 100-200, "
        f"{late * 1000:.1f} ms at 900-1000; /nodes and its found-nodes part: {full * 1000:.0f} ms "
        f"at 200 announced, {flooded * 1000:.0f} ms at 1,000"
    )
    assert late < 2 * early and flooded < 2 * full, (early, late, full, flooded)
    # measured at load average 6 on two cores: 3.5-4.2 CPU s, pages 24-32 ms (the wall-clock
    # bounds they replace, 10 s and 0.3 s, failed there at 25 s and 550 ms)
    assert sum(costs) < 15 and flooded < 0.1, (sum(costs), flooded)


def test_an_ignored_agent_stays_out_of_sight(tmp_path):
    """An agent found on the network that the user does not know: Ignore hides it, and its next
    announcements (at any address) change nothing; "show them again" brings it back."""
    app = create_panel_app(tmp_path, CLUSTER_KEY)
    password = ensure_admin_password(app.state.db)

    def announce(host: str):
        peer = Peer("stranger._tandem._tcp.local.", [host], 7411, {"node_id": "f" * 32, "name": "stranger"})
        asyncio.run(note_discovered(app.state.db, peer, True, CLUSTER_KEY))

    announce("10.9.9.9")
    with TestClient(app, base_url=LOCAL, follow_redirects=False) as c:
        assert log_in(c, password).status_code == 303
        page = c.get("/nodes").text
        node_id = re.search(r'action="/nodes/(\d+)/ignore"', page).group(1)
        assert c.post(f"/nodes/{node_id}/ignore", data={"csrf": csrf_of(page)}).status_code == 303
        announce("10.9.9.10")  # it keeps announcing, elsewhere too
        found = c.get("/nodes/discovered").text
        assert 'data-node="stranger"' not in found and "Ignored agents: 1" in found
        with Session(app.state.db) as s:
            assert s.exec(select(Node.url).where(Node.node_id == "f" * 32)).one() == "http://10.9.9.9:7411"
        assert c.post("/nodes/ignored/show", data={"csrf": csrf_of(c.get("/nodes").text)}).status_code == 303
        assert 'data-node="stranger"' in c.get("/nodes/discovered").text
        # without the CSRF token, nothing is ignored
        assert c.post(f"/nodes/{node_id}/ignore", data={}).status_code == 403
