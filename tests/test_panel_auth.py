"""Every panel route — OpenAI API and UI — refuses a missing or wrong credential."""

from __future__ import annotations

import re

import pytest
from sqlmodel import select
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


def test_api_key_and_model_lookups_are_cached_but_never_stale(tmp_path):
    """The API's key check and model lookup are kept in memory between requests; a key deleted or
    a pair changed in the panel counts from the very next request."""
    from sqlmodel import Session

    from control_panel.db import open_db
    from control_panel.models import ApiKey, Node, Pair
    from control_panel.openai_api import OpenAIError, resolve_target
    from control_panel.security import api_key_valid, create_api_key
    from control_panel.services import delete_row

    engine = open_db(tmp_path / "panel.db")
    key = create_api_key(engine, "t")
    assert api_key_valid(engine, key) and api_key_valid(engine, key)
    assert not api_key_valid(engine, key + "x")
    with Session(engine) as s:
        a, b = Node(name="a", url="http://a:1", paired=True), Node(name="b", url="http://b:1", paired=True)
        s.add(a), s.add(b)
        s.commit()
        pair = Pair(name="p", prefill_node_id=a.id, decode_node_id=b.id, prefill_engine="torch",
                    decode_engine="mlx", prefill_model_path="m", decode_model_path="m", context_length=64)
        s.add(pair)
        s.commit()
        pair_id, key_id = pair.id, s.exec(select(ApiKey.id)).first()
    assert resolve_target(engine, "p").prefill_url == "http://a:1"
    assert resolve_target(engine, "p") is resolve_target(engine, "p")  # served from memory
    with Session(engine) as s:
        row = s.get(Pair, pair_id)
        row.prefill_node_id, row.decode_node_id = row.decode_node_id, row.prefill_node_id
        s.add(row)
        s.commit()
    assert resolve_target(engine, "p").prefill_url == "http://b:1"
    delete_row(engine, ApiKey, key_id)
    assert not api_key_valid(engine, key)
    delete_row(engine, Pair, pair_id)
    with pytest.raises(OpenAIError):
        resolve_target(engine, "p")
