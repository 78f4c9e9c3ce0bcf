"""Every agent route but the liveness check refuses a missing or wrong cluster key."""

from __future__ import annotations

import re

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from node_agent.app import AgentConfig, create_app

KEY = "tdm_right-key-for-the-auth-test-0001"


@pytest.fixture(scope="module")
def client(engines):
    app = create_app(engines["torch"], AgentConfig(node_id="n" * 32, name="auth", cluster_key=KEY))
    with TestClient(app) as c:
        yield c


def api_routes(routes):
    """Every APIRoute, looking inside included routers too."""
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from api_routes(inner.routes)


def every_route(app):
    routes = {(m, r.path) for r in api_routes(app.routes) for m in r.methods}
    assert {path for _, path in routes} >= set(app.openapi()["paths"])
    return sorted((m, re.sub(r"\{[^}]+\}", "0" * 32, path)) for m, path in routes)


def test_routes_refuse_without_the_key(client):
    routes = every_route(client.app)
    assert len(routes) >= 12
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Bearer "}):
            r = client.request(method, path, headers=headers, json={})
            if path == "/healthz":
                assert r.status_code == 200
            else:
                assert r.status_code == 401, (method, path, headers, r.status_code)
                assert r.json()["error"]["type"] == "Unauthorized"
                assert KEY not in r.text


def test_the_key_opens_them(client):
    headers = {"Authorization": f"Bearer {KEY}"}
    assert client.get("/v1/info", headers=headers).status_code == 200
    assert client.get("/v1/openapi.json", headers=headers).json()["info"]["title"] == "Tandem node agent"
    assert "tandem_budget_capacity_bytes" in client.get("/metrics", headers=headers).text
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert client.get(path).status_code == 404


def test_bad_bodies_get_clear_400s(client):
    headers = {"Authorization": f"Bearer {KEY}"}
    r = client.post("/v1/handoffs", headers=headers, json={"room": "not-hex", "token_ids": [1], "contract": "x"})
    assert r.status_code == 400 and "room" in r.json()["error"]["message"]
    r = client.post("/v1/generate", headers=headers, json={"token_ids": [1, 2], "sampling": {"temperature": -1}})
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]
    r = client.post("/v1/tokenize", headers=headers, json={})
    assert r.status_code == 400 and "exactly one" in r.json()["error"]["message"]
