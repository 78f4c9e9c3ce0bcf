"""Every panel route — OpenAI API and UI — refuses a missing or wrong credential."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from control_panel.app import create_panel_app

from .test_agent_auth import api_routes

OPEN = {("GET", "/healthz"), ("GET", "/login")}  # liveness, and the page where one logs in


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    app = create_panel_app(tmp_path_factory.mktemp("panel-auth"), "tdm_auth-test-cluster-key-000000")
    with TestClient(app, follow_redirects=False) as c:
        yield c


def test_every_route_refuses_without_credentials(client):
    routes = sorted({(m, r.path) for r in api_routes(client.app.routes) for m in r.methods} - {("HEAD", "/login")})
    assert len(routes) >= 20, routes
    credentials = [{}, {"Authorization": "Bearer tsk_wrong"}, {"Cookie": "tandem_session=forged.value"}]
    for method, path in routes:
        url = re.sub(r"\{[^}]+\}", "1", path)
        for headers in credentials:
            r = client.request(method, url, headers={"Accept": "text/html", **headers}, json={})
            if (method, path) in OPEN:
                assert r.status_code == 200, (method, path)
                continue
            refused = r.status_code in (401, 403) or (r.status_code == 303 and r.headers["location"].startswith("/login"))
            assert refused, (method, path, headers, r.status_code)
            assert "tdm_auth-test-cluster-key" not in r.text
