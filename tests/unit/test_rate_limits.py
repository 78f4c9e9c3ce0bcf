"""Per-API-key limits (control_panel/rate_limits.py): the limiter alone, then through the panel's
API on fake agents (tests/unit/test_router.py's) and on the Settings page."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest
import sqlalchemy as sa
from alembic import command
from fastapi.testclient import TestClient
from sqlmodel import Session, select

from control_panel.api.errors import OpenAIError
from control_panel.db import alembic_config, open_db
from control_panel.models import ApiKey
from control_panel.rate_limits import RateLimiter, TokenBucket
from control_panel.security import create_api_key, presented_key, set_admin_password, set_key_limits

from .test_router import DONE, PROMPT, TOKENS, FakeAgents, Lines, chat, pair_app

PASSWORD = "unit-admin-password"


# ---- the limiter alone ----------------------------------------------------------------------------
def test_the_bucket_refills_at_the_rate_up_to_one_minute_s_worth():
    bucket = TokenBucket(600, now=0.0)  # 10 tokens a second
    bucket.level -= 900  # an answer longer than the bucket: 300 below zero
    assert bucket.seconds_until_open(0.0) == pytest.approx(30.0)
    assert bucket.seconds_until_open(10.0) == pytest.approx(20.0) and bucket.level == pytest.approx(-200)
    assert bucket.seconds_until_open(30.0) == 0.0 and bucket.level == pytest.approx(0)
    bucket.refill(1000.0)
    assert bucket.level == 600  # never more than a minute's worth
    bucket.resize(100)
    assert (bucket.per_minute, bucket.level) == (100, 100)


def test_a_key_s_requests_in_flight_are_limited_and_each_release_frees_one_once():
    limiter = RateLimiter()
    first, second = limiter.admit(1, 2, None), limiter.admit(1, 2, None)
    with pytest.raises(OpenAIError) as e:
        limiter.admit(1, 2, None)
    assert (e.value.status, e.value.kind, e.value.code, e.value.retry_after) == (
        429,
        "requests",
        "rate_limit_exceeded",
        1,
    )
    limiter.admit(2, 2, None).release()  # another key is not this one
    first.release()
    first.release()  # a second release (two failure paths) frees nothing more
    assert limiter.in_flight == {1: 1, 2: 0}
    limiter.admit(1, 2, None)
    with pytest.raises(OpenAIError):
        limiter.admit(1, 2, None)
    second.release()
    assert [limiter.admit(3, None, None) for _ in range(100)]  # no limit: never refused


def test_the_token_rate_refuses_with_the_seconds_until_the_bucket_refills():
    now = [0.0]
    limiter = RateLimiter(clock=lambda: now[0])
    slot = limiter.admit(1, None, 60)
    slot.charge(90)  # 30 below zero, refilled at 1 token a second
    slot.release()
    with pytest.raises(OpenAIError) as e:
        limiter.admit(1, None, 60)
    assert (e.value.status, e.value.kind, e.value.retry_after) == (429, "tokens", 30)
    now[0] = 29.5
    with pytest.raises(OpenAIError) as e:
        limiter.admit(1, None, 60)
    assert e.value.retry_after == 1
    now[0] = 30.0
    limiter.admit(1, None, 60)
    limiter.admit(1, None, None).charge(10**9)  # the limit removed: nothing is counted
    assert 1 not in limiter.buckets


# ---- through the API -------------------------------------------------------------------------------
def held(body: dict) -> httpx.Response:
    """D's stream: the tokens, then nothing until the panel closes it (a decode still running)."""
    return httpx.Response(200, stream=Lines(TOKENS, hold=True), headers={"content-type": "application/x-ndjson"})


@pytest.fixture
def api(tmp_path):
    """The panel on fake agents, with a TestClient (its event loop kept for the test), and the
    clock of its limiter in the test's hands (`api.now[0]`)."""
    app = pair_app(tmp_path, FakeAgents())
    now = [0.0]
    app.state.panel.limits = RateLimiter(clock=lambda: now[0])
    set_admin_password(app.state.db, PASSWORD)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        client.app_state, client.now = app.state, now
        yield client


def key_with(api, max_concurrent: int | None = None, tokens_per_minute: int | None = None) -> tuple[dict, int]:
    """A new key with these limits: its request headers and its id."""
    key = create_api_key(api.app_state.db, "limited")
    with Session(api.app_state.db) as s:
        key_id = s.exec(select(ApiKey.id).where(ApiKey.prefix == key[:10])).one()
    set_key_limits(api.app_state.db, key_id, max_concurrent, tokens_per_minute)
    return {"Authorization": f"Bearer {key}"}, key_id


def open_streams(api, stack: ExitStack, headers: dict, n: int) -> list[Iterator[str]]:
    """`n` streamed chats, each with its first line read (its answer under way), closed when
    `stack` closes; keep what this returns: a line reader collected closes its stream."""
    readers = []
    for _ in range(n):
        r = stack.enter_context(api.stream("POST", "/v1/chat/completions", json=chat(stream=True), headers=headers))
        assert r.status_code == 200, r.read()
        readers.append(r.iter_lines())
        assert next(readers[-1]).startswith("data: ")
    return readers


def test_the_request_past_a_key_s_concurrency_gets_429_before_any_agent_call(api):
    headers, key_id = key_with(api, max_concurrent=2)
    agents = api.app_state.agents.reset(decode=held)
    with ExitStack() as stack:
        streams = open_streams(api, stack, headers, 2)
        calls = len(agents.calls)
        r = api.post("/v1/chat/completions", json=chat(), headers=headers)
        assert r.status_code == 429 and r.headers["Retry-After"] == "1", r.text
        error = r.json()["error"]
        assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded") and "2 requests" in error[
            "message"
        ]
        assert len(agents.calls) == calls  # refused before any agent was asked anything
        r = api.post("/v1/completions", json={"model": "pd", "prompt": "hi"}, headers=headers)
        assert r.status_code == 429  # every generating route
        assert api.app_state.panel.limits.in_flight == {key_id: 2} and len(streams) == 2
    agents.reset()
    r = api.post("/v1/chat/completions", json=chat(), headers=headers)  # both streams ended
    assert r.status_code == 200, r.text


def test_a_client_that_hangs_up_mid_stream_frees_its_slot(api):
    headers, key_id = key_with(api, max_concurrent=1)
    agents = api.app_state.agents.reset(decode=held)
    with api.stream("POST", "/v1/chat/completions", json=chat(stream=True), headers=headers) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert api.post("/v1/chat/completions", json=chat(), headers=headers).status_code == 429
    # leaving the block closes the connection before the answer's end: the client went away
    assert api.app_state.panel.limits.in_flight == {key_id: 0}
    agents.reset()
    r = api.post("/v1/chat/completions", json=chat(), headers=headers)
    assert r.status_code == 200, r.text


def test_a_stream_read_to_its_end_and_a_failed_request_free_their_slots(api):
    headers, key_id = key_with(api, max_concurrent=1)
    r = api.post("/v1/chat/completions", json=chat(stream=True), headers=headers)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), r.text
    api.app_state.agents.reset(tokenize=lambda body: httpx.Response(500, json={"error": {"message": "down"}}))
    assert api.post("/v1/chat/completions", json=chat(), headers=headers).status_code == 503
    assert api.post("/v1/chat/completions", json=chat(model="nope"), headers=headers).status_code == 404
    api.app_state.agents.reset()
    assert api.post("/v1/chat/completions", json=chat(), headers=headers).status_code == 200


def test_a_key_over_its_token_rate_gets_429_with_the_seconds_to_wait(api):
    headers, _ = key_with(api, tokens_per_minute=60)  # 1 token a second
    used = len(PROMPT) + len(TOKENS)  # 43 a request: prompt and answer
    assert DONE["finish_reason"] == "length"
    for _ in range(2):  # 60 -> 17 -> -26
        r = api.post("/v1/chat/completions", json=chat(), headers=headers)
        assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == used, r.text
    r = api.post("/v1/chat/completions", json=chat(), headers=headers)
    assert r.status_code == 429 and r.headers["Retry-After"] == "26", (r.headers, r.text)
    assert (r.json()["error"]["type"], r.json()["error"]["code"]) == ("tokens", "rate_limit_exceeded")
    api.now[0] = 25.5
    assert api.post("/v1/chat/completions", json=chat(), headers=headers).headers["Retry-After"] == "1"
    api.now[0] = 26.0
    assert api.post("/v1/chat/completions", json=chat(), headers=headers).status_code == 200


def test_a_key_without_limits_is_not_limited(api):
    headers = {"Authorization": f"Bearer {api.app_state.api_key}"}
    key_with(api, max_concurrent=1, tokens_per_minute=1)  # another key's limits are not this one's
    api.app_state.agents.reset(decode=held)
    with ExitStack() as stack:
        streams = open_streams(api, stack, headers, 6)
        assert api.app_state.panel.limits.in_flight[1] == len(streams)  # the key without limits: id 1
    api.app_state.agents.reset()
    for _ in range(5):
        assert api.post("/v1/chat/completions", json=chat(), headers=headers).status_code == 200
    assert api.app_state.panel.limits.buckets == {}


def test_n_choices_count_as_n_requests_against_the_key_s_concurrency(api):
    """A request of n choices runs n sequences (security review L1): with a limit of 4, n=4 beside
    nothing runs, n=3 beside two running requests is refused 429 before its choices are asked for,
    n=5 can never run (400 naming n), and every place is freed after."""
    headers, key_id = key_with(api, max_concurrent=4)
    r = api.post("/v1/chat/completions", json=chat(n=4), headers=headers)
    assert r.status_code == 200 and len(r.json()["choices"]) == 4, r.text
    r = api.post("/v1/chat/completions", json=chat(n=5), headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert "may run 4 at once" in r.json()["error"]["message"]
    limits = api.app_state.panel.limits
    limits.in_flight[key_id] = 2  # two of the key's requests running (held streams: the test above)
    agents = api.app_state.agents
    decodes = sum(path == "/v1/decode" for _, path in agents.paths)
    r = api.post("/v1/chat/completions", json=chat(n=3), headers=headers)
    assert r.status_code == 429 and r.headers["Retry-After"] == "1", r.text
    assert "already has 2 other requests running of its 4" in r.json()["error"]["message"]
    assert sum(path == "/v1/decode" for _, path in agents.paths) == decodes  # no choice was asked for
    assert limits.in_flight == {key_id: 2}
    limits.in_flight[key_id] = 0
    assert api.post("/v1/chat/completions", json=chat(n=4), headers=headers).status_code == 200


def test_n_choices_hold_their_most_tokens_up_front_and_return_what_they_did_not_take(api):
    """n choices of max_tokens each: the extra n - 1 choices' max_tokens are held from the key's
    bucket before they run (refused 429 when the bucket lacks them; 400 past a minute's worth),
    and what was not generated is back when the request ends."""
    headers, key_id = key_with(api, tokens_per_minute=100)
    r = api.post("/v1/chat/completions", json=chat(n=4, max_tokens=40), headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text  # 3 x 40 held > 100 a minute
    r = api.post("/v1/chat/completions", json=chat(n=3, max_tokens=30), headers=headers)
    assert r.status_code == 200, r.text
    used = r.json()["usage"]["total_tokens"]
    bucket = api.app_state.panel.limits.buckets[key_id]
    assert bucket.level == pytest.approx(100 - used)  # the 60 held came back; the real use stays
    r = api.post("/v1/chat/completions", json=chat(n=3, max_tokens=30), headers=headers)
    assert r.status_code == 429 and r.json()["error"]["type"] == "tokens", r.text  # 60 needed, less left
    assert bucket.level == pytest.approx(100 - used)  # a refused request takes nothing


# ---- on the Settings page ---------------------------------------------------------------------------
def signed_in(api) -> str:
    """Sign in; the session's CSRF token."""
    token = re.search(r'name="csrf" value="([^"]+)"', api.get("/login").text).group(1)
    assert api.post("/login", data={"password": PASSWORD, "csrf": token}, follow_redirects=False).status_code == 303
    return re.search(r'name="csrf" value="([^"]+)"', api.get("/settings").text).group(1)


def test_the_settings_page_saves_a_key_s_limits_shows_them_and_the_api_applies_them(api):
    headers, key_id = key_with(api)
    csrf = signed_in(api)
    form = {"csrf": csrf, "max_concurrent": "1", "tokens_per_minute": " 5000 "}
    r = api.post(f"/settings/keys/{key_id}/limits", data=form, follow_redirects=False)
    assert r.status_code == 303, r.text
    page = api.get("/settings").text
    assert re.search(rf'form="limits-{key_id}"[^>]*name="max_concurrent"[^>]*value="1"', page), page
    assert re.search(rf'form="limits-{key_id}"[^>]*name="tokens_per_minute"[^>]*value="5000"', page)
    assert "Requests at once" in page and "Tokens per minute" in page
    running = api.app_state.panel.limits.admit(key_id, None, None)  # as a request of the key would
    assert api.post("/v1/chat/completions", json=chat(), headers=headers).status_code == 429
    running.release()
    assert api.post("/v1/chat/completions", json=chat(), headers=headers).status_code == 200
    # blank: no limit
    form = {"csrf": csrf, "max_concurrent": "", "tokens_per_minute": ""}
    assert api.post(f"/settings/keys/{key_id}/limits", data=form, follow_redirects=False).status_code == 303
    assert re.search(rf'form="limits-{key_id}"[^>]*name="max_concurrent"[^>]*value=""', api.get("/settings").text)
    with Session(api.app_state.db) as s:
        key = s.get(ApiKey, key_id)
        assert (key.max_concurrent, key.tokens_per_minute) == (None, None)


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("max_concurrent", "0", "Requests at once: a whole number from 1 to 1000"),
        ("max_concurrent", "1001", "Requests at once: a whole number from 1 to 1000"),
        ("tokens_per_minute", "1.5", "Tokens per minute: a whole number from 1 to 1000000000"),
        ("tokens_per_minute", "lots", "Tokens per minute: a whole number from 1 to 1000000000"),
    ],
)
def test_a_limit_that_is_not_a_whole_number_in_range_is_refused_with_a_message(api, field, value, words):
    _, key_id = key_with(api, max_concurrent=3)
    csrf = signed_in(api)
    r = api.post(f"/settings/keys/{key_id}/limits", data={"csrf": csrf, field: value})
    assert r.status_code == 400 and words in r.text, r.text
    assert re.search(rf'form="limits-{key_id}"[^>]*name="max_concurrent"[^>]*value="3"', r.text)  # unchanged
    api.cookies.set("lang", "de")
    r = api.post(f"/settings/keys/{key_id}/limits", data={"csrf": csrf, field: value})
    assert r.status_code == 400 and "eine ganze Zahl von 1 bis" in r.text


def test_the_limits_form_needs_the_csrf_token(api):
    _, key_id = key_with(api)
    signed_in(api)
    r = api.post(f"/settings/keys/{key_id}/limits", data={"max_concurrent": "1"})
    assert r.status_code == 403


def test_migration_0010_gives_existing_keys_no_limits_and_back(tmp_path):
    db = tmp_path / "panel.db"
    engine = open_db(db, "0009")
    key = "tsk_old-key-of-an-older-panel"
    with engine.begin() as c:
        row = {"h": hashlib.sha256(key.encode()).hexdigest(), "p": key[:10]}
        c.execute(sa.text("INSERT INTO apikey (name, prefix, key_hash, created) VALUES ('old', :p, :h, 1.0)"), row)
    engine.dispose()
    engine = open_db(db)
    assert presented_key(engine, key).name == "old"
    assert (presented_key(engine, key).max_concurrent, presented_key(engine, key).tokens_per_minute) == (None, None)
    engine.dispose()
    command.downgrade(alembic_config(f"sqlite:///{db}"), "0009")
    columns = {c["name"] for c in sa.inspect(sa.create_engine(f"sqlite:///{db}")).get_columns("apikey")}
    assert "max_concurrent" not in columns and "key_hash" in columns
