"""Who is signed in to the web UI, and the CSRF token every POST must carry.

Sessions are itsdangerous-signed cookies (HttpOnly, SameSite=Lax) that carry a CSRF token; every
POST checks that token (a form field, or the X-CSRF-Token header that htmx and the playground's
fetch() send). Before login the token lives in its own signed cookie. A session is also a row on
the server (`UiSession`, by the cookie's `sid`): signing out deletes it, so a copy of the cookie
opens nothing afterwards; a session unused for IDLE_SECONDS ends; and every session dies with the
admin password it was signed under (`pv`, the password's version).
"""

from __future__ import annotations

import hmac
import secrets
import time

from fastapi import HTTPException, Request, Response
from itsdangerous import BadSignature, URLSafeTimedSerializer
from sqlalchemy import Engine, delete
from sqlmodel import Session

from ..models import UiSession
from ..security import admin_password_version, ui_session_secret

SESSION_COOKIE, ANON_COOKIE = "tandem_session", "tandem_csrf"
SESSION_MAX_AGE = 12 * 3600
IDLE_SECONDS = 2 * 3600  # a session unused this long ends
TOUCH_SECONDS = 60  # how stale a session's last_seen may get before a request writes it


def cookie_args(request: Request) -> dict:
    return {"httponly": True, "samesite": "lax", "secure": request.url.scheme == "https", "path": "/"}


def safe_next(value: str | None) -> str:
    """Where to go after login or a language switch: a path of ours, never another site."""
    ours = value and value.startswith("/") and not value.startswith("//") and "\\" not in value
    return value if ours else "/nodes"


def wants_fragment(request: Request) -> bool:
    """An htmx or fetch() call (answered 401 when signed out), not a page (redirected to /login)."""
    return request.headers.get("HX-Request") == "true" or request.url.path.startswith("/ui/")


class UiSessions:
    """Signs and reads the session and the pre-login CSRF cookie with the panel's own secret."""

    def __init__(self, db: Engine):
        self.db = db
        secret = ui_session_secret(db)
        self._sessions = URLSafeTimedSerializer(secret, salt="tandem-ui-session")
        self._anon = URLSafeTimedSerializer(secret, salt="tandem-ui-csrf")

    def of(self, request: Request) -> dict | None:
        """The request's session, or None (no cookie, a bad signature, expired, an old password)."""
        raw = request.cookies.get(SESSION_COOKIE)
        if not raw:
            return None
        try:
            data = self._sessions.loads(raw, max_age=SESSION_MAX_AGE)
        except BadSignature:
            return None
        if not isinstance(data, dict) or data.get("pv") != admin_password_version(self.db):
            return None
        return data if self._live(data.get("sid")) else None

    def _live(self, sid: object) -> bool:
        """The session's row exists and has not idled out (touched, at most once a minute)."""
        if not isinstance(sid, str):
            return False
        now = time.time()
        with Session(self.db) as s:
            row = s.get(UiSession, sid)
            if row is None:
                return False
            if now - row.last_seen > IDLE_SECONDS:
                s.delete(row)
                s.commit()
                return False
            if now - row.last_seen > TOUCH_SECONDS:
                row.last_seen = now
                s.add(row)
                s.commit()
        return True

    def anon_token(self, request: Request) -> str | None:
        raw = request.cookies.get(ANON_COOKIE)
        if not raw:
            return None
        try:
            return self._anon.loads(raw, max_age=SESSION_MAX_AGE)
        except BadSignature:
            return None

    def check_csrf(self, request: Request, presented: str | None) -> None:
        data = self.of(request)
        expected = data["csrf"] if data else self.anon_token(request)
        presented = presented or request.headers.get("X-CSRF-Token")
        # compare_digest takes str only when ASCII (else TypeError, a 500): a token never is anything else
        if not expected or not presented or not presented.isascii() or not hmac.compare_digest(expected, presented):
            raise HTTPException(403, "CSRF token missing or wrong: reload the page and try again")

    def new_session(self) -> dict:
        sid = secrets.token_urlsafe(24)
        with Session(self.db) as s:
            s.exec(delete(UiSession).where(UiSession.last_seen < time.time() - IDLE_SECONDS))
            s.add(UiSession(sid=sid))
            s.commit()
        return {"u": "admin", "csrf": secrets.token_urlsafe(24), "pv": admin_password_version(self.db), "sid": sid}

    def end(self, request: Request) -> None:
        """Sign the request's session out, for good."""
        data = self.of(request)
        if data is not None:
            with Session(self.db) as s:
                s.exec(delete(UiSession).where(UiSession.sid == data["sid"]))
                s.commit()

    def end_all(self) -> None:
        """Every session ends (the admin password changed)."""
        with Session(self.db) as s:
            s.exec(delete(UiSession))
            s.commit()

    def sign_in(self, request: Request, response: Response, data: dict) -> None:
        response.set_cookie(SESSION_COOKIE, self._sessions.dumps(data), max_age=SESSION_MAX_AGE, **cookie_args(request))

    def set_anon_token(self, request: Request, response: Response, token: str) -> None:
        response.set_cookie(ANON_COOKIE, self._anon.dumps(token), max_age=SESSION_MAX_AGE, **cookie_args(request))
