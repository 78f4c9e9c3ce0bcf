"""What an API client is told when its model's nodes fail: a generic message with the request's id,
never an agent's address or an exception's text; the request log (and the panel's log) keep the
detail. Refusals (4xx) keep the agent's words, less any address. On fake agents at 127.0.0.1
(tests/unit/test_router.py's)."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlmodel import Session, select

from control_panel.models import RequestLog
from control_panel.security import set_admin_password

from .test_rate_limits import PASSWORD, signed_in
from .test_router import TOKENS, FakeAgents, ask, chat, pair_app, refusal, sse_chunks, stream

P, D = "http://127.0.0.1:7001", "http://127.0.0.1:7002"
# what must never reach a client: the nodes' addresses, and the names of the errors behind a failure
LEAKS = ("127.0.0.1", "http://", ":7001", ":7002", "ConnectError", "EngineError", "StreamBroken", "ReadTimeout")


@pytest.fixture(scope="module")
def panel(tmp_path_factory):
    return pair_app(tmp_path_factory.mktemp("errors"), FakeAgents(), P, D)


def unreachable(body: dict) -> httpx.Response:
    raise httpx.ConnectError("[Errno 111] Connect call failed ('127.0.0.1', 7002)")


def engine_failed(body: dict) -> httpx.Response:
    return refusal(500, "EngineError", f"the engine died while its prefiller {P} was sending pages")


def broken_mid_stream(body: dict) -> httpx.Response:
    return stream([TOKENS[0], {"error": {"type": "StreamBroken", "message": f"prefiller {P} stalled: ReadTimeout"}}])


def logged(app, rid: str) -> RequestLog:
    with Session(app.state.db) as s:
        return s.exec(select(RequestLog).where(RequestLog.request_id == rid)).one()


def told_generically(text: str) -> str:
    """The request id a generic failure message names; nothing of the failure is in `text`."""
    assert not [leak for leak in LEAKS if leak in text], text
    return re.search(r"the model's nodes could not serve this request; .*\(request (\S+)\)", text).group(1)


@pytest.mark.parametrize(
    "answers, detail",
    [
        ({"tokenize": unreachable}, "Connect call failed ('127.0.0.1', 7002)"),
        ({"decode": unreachable}, "127.0.0.1:7002 is not reachable"),
        (
            {"decode": engine_failed},
            f"127.0.0.1:7002 answered 500 EngineError: the engine died while its prefiller {P}",
        ),
    ],
)
@pytest.mark.parametrize("streamed", [False, True])
def test_a_failing_route_tells_the_client_no_address_and_the_request_log_the_detail(
    panel, answers, detail, streamed, caplog
):
    r, _ = ask(panel, chat(model="pd-strict", stream=streamed), **answers)
    assert r.status_code == 503, r.text
    rid = told_generically(r.text)
    row = logged(panel, rid)
    assert row.outcome == "error" and detail in row.error, row
    assert detail in caplog.text  # and the panel's log


def test_a_stream_that_breaks_after_its_first_token_ends_with_a_generic_error_event(panel):
    r, _ = ask(panel, chat(model="pd-strict", stream=True), decode=broken_mid_stream)
    assert r.status_code == 200
    error = json.loads(r.text.split("data: ")[-2])["error"]
    rid = told_generically(r.text)
    assert rid == sse_chunks(r)[0]["id"] and error["message"].endswith(f"(request {rid})")
    assert f"prefiller {P} stalled: ReadTimeout" in logged(panel, rid).error


def test_a_response_that_breaks_mid_stream_fails_generically(panel):
    body = {"model": "pd-strict", "input": "hi", "stream": True, "max_output_tokens": 3}
    r, _ = ask(panel, body, "/v1/responses", decode=broken_mid_stream)
    failed = [json.loads(x[6:]) for x in r.text.split("\n") if x.startswith("data: ") and "response.failed" in x]
    assert failed, r.text
    rid = told_generically(r.text)
    assert failed[0]["response"]["id"] == rid and "stalled" in logged(panel, rid).error


def test_a_refusal_keeps_the_agent_s_words_without_any_address(panel):
    busy = f"the prefiller {P} refused the handoff: 127.0.0.1:7001 answered 429 BudgetTimeout: the staging budget stayed busy for 30.0 s"
    r, _ = ask(panel, chat(), decode=lambda body: refusal(429, "BudgetTimeout", busy, headers={"Retry-After": "7"}))
    assert r.status_code == 429 and r.headers["Retry-After"] == "7", r.text
    error = r.json()["error"]
    assert "the staging budget stayed busy for 30.0 s" in error["message"] and "127.0.0.1" not in r.text, error
    too_long = "prompt of 40 tokens plus max_tokens 3000 exceeds the context length 2048"
    r, _ = ask(panel, chat(), decode=lambda body: refusal(400, "RequestError", too_long))
    assert r.status_code == 400 and too_long in r.json()["error"]["message"] and "127.0.0.1" not in r.text, r.text


def test_the_requests_page_shows_the_id_a_client_was_told_beside_the_detail(panel):
    r, _ = ask(panel, chat(model="pd-strict"), decode=engine_failed)
    rid = told_generically(r.text)
    set_admin_password(panel.state.db, PASSWORD)
    ui = TestClient(panel, base_url="http://127.0.0.1")  # no lifespan: the module's panel stays open
    signed_in(ui)
    row = re.search(rf"<tr[^>]*>(?:(?!</tr>).)*{rid}(?:(?!</tr>).)*</tr>", ui.get("/requests").text, re.S)
    assert row and "answered 500 EngineError" in row.group(0), rid
