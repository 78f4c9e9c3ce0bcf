"""Every agent route but the liveness check and the identity proof refuses a missing or wrong cluster key."""

from __future__ import annotations

import re

import pytest
from fastapi.staticfiles import StaticFiles
from fastapi.testclient import TestClient
from starlette.routing import Mount, Route

from node_agent.app import AgentConfig, create_app
from tandem_protocol.auth import IdentityAnswer

KEY = "tdm_right-key-for-the-auth-test-0001"


@pytest.fixture(scope="module")
def client(engines):
    app = create_app(engines["torch"], AgentConfig(node_id="n" * 32, name="auth", cluster_key=KEY))
    with TestClient(app, base_url="http://127.0.0.1") as c:
        yield c


def http_routes(app) -> tuple[list[tuple[str, str]], list[str]]:
    """Every (method, path) the app answers, and the paths of its mounts (static files), found in
    the app object itself, included routers too. A route of any other kind (a websocket, a
    sub-application) fails here, so nothing can be added that this enumeration misses."""
    routes: set[tuple[str, str]] = set()
    mounts: list[str] = []

    def walk(items, prefix: str) -> None:
        for route in items:
            inner = getattr(route, "original_router", None)  # FastAPI >= 0.165 includes routers lazily
            if inner is not None:
                walk(inner.routes, prefix + route.include_context.prefix)
            elif isinstance(route, Route):  # APIRoute is one
                routes.update((m, prefix + route.path) for m in route.methods)
            elif isinstance(route, Mount) and isinstance(route.app, StaticFiles):
                mounts.append(prefix + route.path)
            else:
                raise AssertionError(f"a route this test cannot enumerate: {route!r}")

    walk(app.routes, "")
    return sorted(routes), mounts


def every_route(app):
    routes, mounts = http_routes(app)
    assert not mounts
    assert {path for _, path in routes} >= set(app.openapi()["paths"])
    return sorted((m, re.sub(r"\{[^}]+\}", "0" * 32, path)) for m, path in routes)


def test_routes_refuse_without_the_key(client):
    routes = every_route(client.app)
    assert len(routes) >= 12
    presented = "tdm_presented-wrong-key-5c1e"
    for method, path in routes:
        for headers in (
            {},
            {"Authorization": f"Bearer {presented}"},
            {"Authorization": KEY},
            {"Authorization": "Bearer "},
            {"Authorization": f"Basic {KEY}"},
        ):
            r = client.request(method, path, headers=headers, json={})
            if path == "/healthz":
                assert r.status_code == 200
            elif path == "/v1/identity":  # needs no key, and takes only a nonce (the proof: test_node_identity)
                assert r.status_code == 400 and "nonce" in r.text, r.text
                assert KEY not in r.text and presented not in r.text
            else:
                assert r.status_code == 401, (method, path, headers, r.status_code)
                assert r.json()["error"]["type"] == "Unauthorized"
                assert r.headers["WWW-Authenticate"] == "Bearer"
                assert KEY not in r.text and presented not in r.text  # neither the real key nor the one sent


def test_the_key_opens_them(client):
    headers = {"Authorization": f"Bearer {KEY}"}
    assert client.get("/v1/info", headers=headers).status_code == 200
    assert client.get("/v1/openapi.json", headers=headers).json()["info"]["title"] == "Tandem node agent"
    assert "tandem_budget_capacity_bytes" in client.get("/metrics", headers=headers).text
    for path in ("/docs", "/redoc", "/openapi.json"):  # none served; without the key, not even that is said
        assert client.get(path, headers=headers).status_code == 404 and client.get(path).status_code == 401


def test_bad_bodies_get_clear_400s(client):
    headers = {"Authorization": f"Bearer {KEY}"}
    r = client.post("/v1/handoffs", headers=headers, json={"handoff_id": "not-hex", "token_ids": [1], "contract": "x"})
    assert r.status_code == 400 and "handoff_id" in r.json()["error"]["message"]
    r = client.post("/v1/generate", headers=headers, json={"token_ids": [1, 2], "sampling": {"temperature": -1}})
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]
    r = client.post("/v1/tokenize", headers=headers, json={})
    assert r.status_code == 400 and "exactly one" in r.json()["error"]["message"]


def test_an_agent_signs_only_addresses_its_operator_advertised(engines):
    """Behind a port forward or proxy an agent proves its identity at the address it advertises
    (--advertise-address); any other address a caller names is ignored and the socket's own is
    signed, so a relay cannot make it vouch for the relay's address."""
    from tandem_protocol.auth import new_nonce, proof_matches

    config = AgentConfig(node_id="a" * 32, name="fwd", cluster_key=KEY, advertised=frozenset({"192.0.2.7:7411"}))
    with TestClient(create_app(engines["torch"], config), base_url="http://127.0.0.1") as c:
        for asked, signed in (
            ("192.0.2.7:7411", "192.0.2.7:7411"),
            ("198.51.100.9:80", "127.0.0.1:80"),
            (None, "127.0.0.1:80"),
        ):
            nonce = new_nonce()
            answer = IdentityAnswer.model_validate(
                c.post("/v1/identity", json={"nonce": nonce, "address": asked}).json()
            )
            assert answer.address == signed, (asked, answer)
            assert proof_matches(answer, KEY, nonce, "a" * 32, signed)


def test_foreign_hosts_and_origins_are_refused(client):
    """Issue 22: a name that is not this machine's (DNS rebinding) and a page of another site."""
    headers = {"Authorization": f"Bearer {KEY}"}
    for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example"):
        r = client.get("/healthz", headers={"Host": host})
        assert r.status_code == 400 and "TANDEM_ALLOWED_HOSTS" in r.json()["error"]["message"], (host, r.text)
    for host in ("127.0.0.1:9", "[::1]:9", "localhost", "LOCALHOST:1"):
        assert client.get("/healthz", headers={"Host": host}).status_code == 200, host
    r = client.post("/v1/tokenize", headers={**headers, "Origin": "http://evil.example"}, json={"text": "hi"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "Forbidden", r.text
    same = client.post("/v1/tokenize", headers={**headers, "Origin": "http://127.0.0.1"}, json={"text": "hi"})
    assert (
        same.status_code != 403
        and client.get("/v1/info", headers={**headers, "Origin": "http://x.example"}).status_code == 200
    )
