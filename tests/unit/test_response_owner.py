"""The Responses store's owner and bounds (control_panel/response_store.py, the store's parts of
control_panel/api/responses.py, migration 0012): a stored response is its API key's alone, the
fields it keeps that no template renders are bounded as OpenAI bounds them, the store is capped in
bytes per key and in all, and revoking a key deletes its responses. Each test performs the attack
of the security review's M4 on the real panel in process, on fake agents (tests/unit/test_router.py's)."""

from __future__ import annotations

import re

import pytest
import sqlalchemy as sa
from alembic import command
from fastapi.testclient import TestClient
from sqlmodel import Session, select

from control_panel import response_store
from control_panel.db import alembic_config, open_db
from control_panel.models import ApiKey, StoredResponse
from control_panel.security import create_api_key, set_admin_password

from .test_rate_limits import PASSWORD, signed_in
from .test_router import FakeAgents, pair_app


def panel_on_fakes(tmp_path):
    """The real panel in process on fake agents, its admin password PASSWORD: a TestClient (with
    the panel's state as `app_state`), for a fixture to `yield from`."""
    app = pair_app(tmp_path, FakeAgents())
    set_admin_password(app.state.db, PASSWORD)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        client.app_state = app.state
        yield client


@pytest.fixture
def api(tmp_path):
    yield from panel_on_fakes(tmp_path)


def new_key(api, name: str) -> tuple[dict, int]:
    """A new API key: its request headers and its id."""
    key = create_api_key(api.app_state.db, name)
    with Session(api.app_state.db) as s:
        key_id = s.exec(select(ApiKey.id).where(ApiKey.prefix == key[:10])).one()
    return {"Authorization": f"Bearer {key}"}, key_id


def respond(api, headers: dict, **extra) -> dict:
    """A stored response of the key's, as POST /v1/responses answered it."""
    body = {"model": "pd", "input": "hi", "max_output_tokens": 3, "temperature": 0} | extra
    r = api.post("/v1/responses", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def stored_text(api) -> str:
    """Everything the store holds, as text."""
    with api.app_state.db.connect() as c:
        return "".join(c.execute(sa.text("SELECT conversation || response FROM storedresponse")).scalars())


def stored_bytes(api) -> dict[str, int]:
    """Each stored row's bytes (its two JSON texts), by id, read from the table itself."""
    with api.app_state.db.connect() as c:
        rows = c.execute(sa.text("SELECT id, length(CAST(conversation || response AS BLOB)) FROM storedresponse"))
        return dict(rows.all())


UNKNOWN = "resp_" + "0" * 32


def as_unknown(r, rid: str) -> dict:
    """An answer about `rid`, written as if it had been about the unknown id."""
    return {**r.json(), "error": {**r.json()["error"], "message": r.json()["error"]["message"].replace(rid, UNKNOWN)}}


# ---- an owner -----------------------------------------------------------------------------------
def test_another_key_gets_404_for_a_key_s_response_exactly_as_for_an_unknown_id(api):
    """Key B, knowing key A's response id (it is in the logs), can neither read it, continue it nor
    delete it, and learns nothing: every answer is the one an unknown id gets."""
    a, _ = new_key(api, "a")
    b, _ = new_key(api, "b")
    rid = respond(api, a, metadata={"secret": "of a"})["id"]
    streamed = api.post("/v1/responses", json={"model": "pd", "input": "hi", "stream": True}, headers=a)
    sid = re.search(r'"id": "(resp_\w+)"', streamed.text).group(1)  # a streamed answer is kept for its key too
    agents = api.app_state.agents.reset()
    for owned in (rid, sid):
        for method, path, body in (
            ("GET", f"/v1/responses/{owned}", None),
            ("DELETE", f"/v1/responses/{owned}", None),
            ("POST", "/v1/responses", {"model": "pd", "input": "go on", "previous_response_id": owned}),
        ):
            theirs = api.request(method, path, json=body, headers=b)
            unknown = api.request(
                method, path.replace(owned, UNKNOWN), json=body and {**body, "previous_response_id": UNKNOWN}, headers=b
            )
            assert theirs.status_code == unknown.status_code == 404, (method, path, theirs.text)
            assert as_unknown(theirs, owned) == unknown.json() and "of a" not in theirs.text
            assert theirs.json()["error"]["code"] == "response_not_found"
    assert agents.calls == []  # no continuation reached a node
    # A's own: still there, continued, then deleted
    assert api.get(f"/v1/responses/{rid}", headers=a).json()["metadata"] == {"secret": "of a"}
    assert api.get(f"/v1/responses/{sid}", headers=a).status_code == 200
    assert respond(api, a, previous_response_id=rid)["previous_response_id"] == rid
    assert api.delete(f"/v1/responses/{rid}", headers=a).json() == {"id": rid, "object": "response", "deleted": True}
    assert api.get(f"/v1/responses/{rid}", headers=a).status_code == 404


# ---- what is kept of a request ------------------------------------------------------------------
FUNCTION = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"metadata": {"k" * 65: "v"}}, "metadata", "a key is at most 64 characters (got 65)"),
        ({"metadata": {"k": "v" * 513}}, "metadata", "`metadata.k`: a value is at most 512 characters (got 513)"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16 keys"),
        ({"user": "u" * 65}, "user", "`user`: at most 64 characters (got 65)"),
        ({"tools": [{**FUNCTION, "name": f"f{i}"} for i in range(129)]}, "tools", "at most 128 tools (got 129)"),
    ],
)
def test_a_kept_field_over_openai_s_bound_is_400_naming_it_before_any_call(api, extra, param, words):
    a, _ = new_key(api, "a")
    agents = api.app_state.agents.reset()
    r = api.post("/v1/responses", json={"model": "pd", "input": "hi"} | extra, headers=a)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and words in r.json()["error"]["message"], r.text
    assert agents.calls == [] and stored_bytes(api) == {}


def test_at_the_bounds_every_field_is_kept(api):
    a, _ = new_key(api, "a")
    metadata = {f"{i:064d}": "v" * 512 for i in range(16)}
    tools = [{**FUNCTION, "name": f"f{i}"} for i in range(128)]
    rid = respond(api, a, metadata=metadata, user="u" * 64, tools=tools)["id"]
    kept = api.get(f"/v1/responses/{rid}", headers=a).json()
    assert (kept["metadata"], kept["user"], len(kept["tools"])) == (metadata, "u" * 64, 128)


def test_only_the_known_fields_of_tools_formats_and_tool_choice_are_kept(api):
    """Extra keys of a tool, of `text.format` and of a named `tool_choice` reach no template and
    were stored as sent (a 4 MiB string in each, for 30 days): they are dropped."""
    a, _ = new_key(api, "a")
    junk = "x" * 1000
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "name": "s", "schema": schema, "strict": True, "junk": junk}
    tool = {**FUNCTION, "description": "d", "strict": True}
    called = respond(api, a, tools=[tool | {"junk": junk}], tool_choice={"type": "function", "name": "f", "junk": junk})
    shaped = respond(api, a, text={"format": fmt})  # a format and a forced call cannot go together
    kept = api.get(f"/v1/responses/{called['id']}", headers=a).json()
    assert (kept["tools"], kept["tool_choice"]) == ([tool], {"type": "function", "name": "f"})
    kept = api.get(f"/v1/responses/{shaped['id']}", headers=a).json()
    assert kept["text"]["format"] == {"type": "json_schema", "name": "s", "schema": schema, "strict": True}
    assert "junk" not in stored_text(api) and "x" * 100 not in stored_text(api)


# ---- the store's caps ---------------------------------------------------------------------------
def test_a_key_past_its_cap_evicts_its_own_oldest_and_no_other_key_s(api, monkeypatch):
    """A key that stores response after response (each 512 characters of metadata, 16 values) holds
    at most KEY_BYTES: its oldest go first, the newest is always kept, another key's are untouched.
    It is not refused: a client keeps working, as it would after its oldest expired."""
    a, a_id = new_key(api, "a")
    b, _ = new_key(api, "b")
    big = {f"k{i}": "v" * 512 for i in range(16)}
    theirs = respond(api, b, metadata=big)["id"]
    one = stored_bytes(api)[theirs]  # every response below is the same size, give or take its ids
    monkeypatch.setattr(response_store, "KEY_BYTES", int(2.5 * one), raising=False)
    ids = [respond(api, a, metadata=big)["id"] for _ in range(5)]
    kept = stored_bytes(api)
    assert [rid in kept for rid in ids] == [False, False, False, True, True], kept
    assert sum(kept[rid] for rid in ids[-2:]) <= 2.5 * one and theirs in kept
    assert api.get(f"/v1/responses/{ids[0]}", headers=a).status_code == 404
    assert respond(api, a, previous_response_id=ids[-1])["previous_response_id"] == ids[-1]
    with Session(api.app_state.db) as s:  # and the rows say whose they are
        assert {r.id: r.key_id for r in s.exec(select(StoredResponse))}.get(ids[-1]) == a_id


def test_the_store_past_its_total_cap_evicts_the_oldest_of_any_key(api, monkeypatch):
    a, _ = new_key(api, "a")
    b, _ = new_key(api, "b")
    first = respond(api, a)["id"]
    one = stored_bytes(api)[first]
    monkeypatch.setattr(response_store, "TOTAL_BYTES", int(3.5 * one), raising=False)
    later = [respond(api, key)["id"] for key in (b, a, b)]
    assert set(stored_bytes(api)) == set(later)  # a's first went; the three newest fit
    newest = respond(api, a)["id"]
    assert set(stored_bytes(api)) == {*later[1:], newest}  # b's oldest made room for it


# ---- revocation ---------------------------------------------------------------------------------
def test_revoking_a_key_deletes_its_responses_and_a_key_given_its_id_finds_none(api):
    b, _ = new_key(api, "b")
    a, a_id = new_key(api, "a")
    mine, theirs = respond(api, a)["id"], respond(api, b)["id"]
    csrf = signed_in(api)
    assert api.post(f"/settings/keys/{a_id}/delete", data={"csrf": csrf}, follow_redirects=False).status_code == 303
    assert set(stored_bytes(api)) == {theirs}  # a's gone from the disk, not only from the API
    assert api.get(f"/v1/responses/{mine}", headers=a).status_code == 401  # the key itself is gone
    c, c_id = new_key(api, "c")
    assert c_id == a_id  # SQLite gives the next key the largest id again, once it was deleted
    assert api.get(f"/v1/responses/{mine}", headers=c).status_code == 404


def test_an_answer_finished_after_its_key_was_revoked_is_not_kept(tmp_path):
    """A request still running when its key is revoked: its answer finds the key gone and is
    dropped, so no later key given the same id inherits it."""
    db = open_db(tmp_path / "panel.db")
    response_store.save(db, 7, {"id": "resp_late"}, [{"role": "user", "content": "hi"}])  # no key 7
    with Session(db) as s:
        assert s.exec(select(StoredResponse)).all() == []


# ---- the migration ------------------------------------------------------------------------------
def test_migration_0012_deletes_responses_without_an_owner_and_back(tmp_path):
    """Rows stored before 0012 have no owner; no key may read them, so they are deleted."""
    db = tmp_path / "panel.db"
    engine = open_db(db, "0011")
    with engine.begin() as c:
        c.execute(sa.text("INSERT INTO storedresponse VALUES ('resp_old', 1.0, 9e12, '[]', '{}')"))
    engine.dispose()
    engine = open_db(db)
    with Session(engine) as s:
        assert s.exec(select(StoredResponse)).all() == []
    key = create_api_key(engine, "k")
    with Session(engine) as s:
        key_id = s.exec(select(ApiKey.id).where(ApiKey.prefix == key[:10])).one()
    response_store.save(engine, key_id, {"id": "resp_new"}, [])
    with Session(engine) as s:
        row = s.get(StoredResponse, "resp_new")
        assert (row.key_id, row.size) == (key_id, len('{"id": "resp_new"}') + len("[]"))
    engine.dispose()
    command.downgrade(alembic_config(f"sqlite:///{db}"), "0011")
    columns = {c["name"] for c in sa.inspect(sa.create_engine(f"sqlite:///{db}")).get_columns("storedresponse")}
    assert columns == {"id", "created", "expires", "conversation", "response"}
