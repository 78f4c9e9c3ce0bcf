"""Comparing secrets with what a client sent (review L7, L13), in process: a token that is not
ASCII is refused like any wrong token (hmac.compare_digest raises TypeError on such a str, which
was a 500), and the TLS pin check compares the certificate its own handshake was given."""

from __future__ import annotations

import ssl
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from control_panel.app import create_panel_app
from control_panel.security import ensure_admin_password
from tandem_protocol.auth import identity_answer, new_nonce, proof_matches
from tandem_protocol.tls import PinMismatch, PinnedContext, _check_pin, client_context, fingerprint

LOCAL = "http://127.0.0.1"  # a Host the panel answers to


@pytest.fixture
def panel(tmp_path):
    app = create_panel_app(tmp_path)
    app.state.password = ensure_admin_password(app.state.db)
    with TestClient(app, base_url=LOCAL, follow_redirects=False, raise_server_exceptions=False) as c:
        yield c, app.state.password


def test_a_non_ascii_csrf_token_is_refused_not_a_server_error(panel):
    """Before login (the token of the pre-login cookie) and after (the session's), as a form field
    and as the X-CSRF-Token header: 403, as for any wrong token."""
    c, password = panel
    c.get("/login")  # the pre-login CSRF cookie: a token to compare with
    for csrf in ("é" * 32, "tokén"):
        assert c.post("/login", data={"password": password, "csrf": csrf}).status_code == 403
    assert c.post("/login", headers={"X-CSRF-Token": "é".encode("latin-1") * 32}).status_code == 403
    token = c.get("/login").text.split('name="csrf" value="', 1)[1].split('"', 1)[0]
    assert c.post("/login", data={"password": password, "csrf": token}).status_code == 303  # signed in
    assert c.post("/logout", data={"csrf": "é" * 32}).status_code == 403
    assert c.post("/logout", headers={"X-CSRF-Token": b"\xe9" * 32}).status_code == 403


def test_a_non_ascii_proof_is_refused_not_an_error():
    """An identity answer (from whoever announced an address) whose proof is not ASCII does not
    prove anything; it raises nothing either."""
    key, nonce, node, address = "tdm_" + "k" * 40, new_nonce(), "a" * 32, "192.168.1.20:7411"
    answer = identity_answer(key, nonce, node, address)
    assert proof_matches(answer, key, nonce, node, address)
    for proof in ("é" * 64, answer.proof[:-1] + "é", "\ud800"):
        assert not proof_matches(answer.model_copy(update={"proof": proof}), key, nonce, node, address)


class RacingContext(PinnedContext):
    """A pinned context shared by two handshakes: the other one (with the pinned certificate)
    records its fingerprint on the context just after this one did."""

    @property
    def seen(self) -> str | None:
        return self._seen

    @seen.setter
    def seen(self, value: str | None) -> None:
        self._seen = self.pin  # the other handshake's write lands in between


def test_the_pin_check_compares_its_own_handshakes_certificate():
    pinned, presented = fingerprint(b"the node's certificate"), b"a man in the middle's certificate"
    context = RacingContext(ssl.PROTOCOL_TLS_CLIENT)
    context.pin = pinned
    with pytest.raises(PinMismatch, match=fingerprint(presented)[:16]):
        _check_pin(SimpleNamespace(context=context, getpeercert=lambda binary_form: presented))
    plain = client_context(pinned)  # without a race, the right certificate passes and is recorded
    _check_pin(SimpleNamespace(context=plain, getpeercert=lambda binary_form: b"the node's certificate"))
    assert plain.seen == pinned
