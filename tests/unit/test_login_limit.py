"""The login limiter against a guesser with many addresses, and argon2 off the event loop
(SECURITY_REVIEW.md L5). The per-address rules through the real app are
tests/system/test_security.py::test_failed_logins_are_limited_per_address."""

from __future__ import annotations

import asyncio
import re

from fastapi.testclient import TestClient

from control_panel import security
from control_panel.app import create_panel_app
from control_panel.login_limit import LoginLimiter
from control_panel.security import ensure_admin_password
from control_panel.ui import login


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_ipv6_guesser_rotating_addresses_within_its_64_counts_as_one():
    limiter = LoginLimiter(clock=Clock())
    for i in range(5):
        assert limiter.retry_after(f"2001:db8:1:2::{i + 1:x}") is None
        limiter.failed(f"2001:db8:1:2::{i + 1:x}")
    assert limiter.retry_after("2001:db8:1:2:ffff::9") == 60  # a new address, the same /64
    assert limiter.retry_after("2001:db8:1:3::1") is None  # the next /64 is another client
    assert limiter.retry_after("198.51.100.1") is None


def test_many_addresses_together_get_no_more_than_the_total_a_minute():
    clock = Clock()
    limiter = LoginLimiter(clock=clock, max_total=20)
    for i in range(20):  # one failure each from 20 addresses: none near its own limit of 5
        clock.now = 1000 + i
        assert limiter.retry_after(f"198.51.100.{i}") is None
        limiter.failed(f"198.51.100.{i}")
    clock.now = 1030
    assert limiter.retry_after("203.0.113.50") == 30  # a fresh address waits for the oldest failure
    assert limiter.retry_after("198.51.100.3") == 30
    clock.now = 1060.5  # the first failure has left the window: one more try, for anyone
    assert limiter.retry_after("203.0.113.50") is None
    limiter.failed("203.0.113.50")
    assert limiter.retry_after("203.0.113.51") == 1  # the second-oldest (at 1001) leaves at 1061


def test_argon2_runs_off_the_event_loop(tmp_path, monkeypatch):
    """Each login attempt's password check (argon2: ~64 MiB, ~0.1 s) runs in a thread, not on the
    loop that serves every other request."""
    app = create_panel_app(tmp_path, "tdm_unit-login-limit-0123456789abcdef")
    password = ensure_admin_password(app.state.db)
    on_loop: list[bool] = []
    verify = security.check_admin_password

    def spy(*args):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return verify(*args)

    monkeypatch.setattr(login, "check_admin_password", spy)
    with TestClient(app, base_url="http://127.0.0.1", follow_redirects=False) as c:
        for attempt in ("wrong", password):
            csrf = re.search(r'name="csrf" value="([^"]+)"', c.get("/login").text).group(1)
            c.post("/login", data={"password": attempt, "csrf": csrf})
    assert on_loop == [False, False]
