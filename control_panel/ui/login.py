"""Logging in and out, and the language switcher (which works signed out, on the login page).

Failed logins are limited per client address (`control_panel/login_limit.py`): the limit is
checked before the CSRF token and the password, so a blocked guesser learns nothing.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import RedirectResponse

from ..deps import AdminSession, CsrfForm, Db, Panel, Render, Tr
from ..i18n import COOKIE as LANG_COOKIE
from ..i18n import LANGUAGES
from ..security import check_admin_password, off_loop_argon2
from .sessions import SESSION_COOKIE, cookie_args, safe_next

router = APIRouter(include_in_schema=False)


@router.get("/")
async def home(_session: AdminSession):
    return RedirectResponse("/nodes", status_code=303)


@router.get("/login")
async def login_page(request: Request, panel: Panel, render: Render, next: str = "/nodes"):
    if panel.sessions.of(request):
        return RedirectResponse(safe_next(next), status_code=303)
    return render("login.html", error=None, next=safe_next(next))


@router.post("/login")
async def login(
    request: Request,
    panel: Panel,
    db: Db,
    render: Render,
    t: Tr,
    password: Annotated[str, Form()] = "",
    csrf: Annotated[str, Form()] = "",
    next: Annotated[str, Form()] = "/nodes",
):
    _ = t.gettext
    address = request.client.host if request.client else ""
    wait = panel.login_limiter.retry_after(address)
    if wait is not None:  # the password is not even looked at
        error = _("Too many failed attempts: wait %(seconds)s s, then try again.", seconds=wait)
        response = render("login.html", status_code=429, next=safe_next(next), error=error)
        response.headers["Retry-After"] = str(wait)
        return response
    panel.sessions.check_csrf(request, csrf)
    if not await off_loop_argon2(check_admin_password, db, password):
        panel.login_limiter.failed(address)
        return render("login.html", status_code=401, error=_("Wrong password."), next=safe_next(next))
    panel.login_limiter.succeeded(address)
    response = RedirectResponse(safe_next(next), status_code=303)
    panel.sessions.sign_in(request, response, panel.sessions.new_session())
    return response


@router.post("/logout")
async def logout(request: Request, panel: Panel, _csrf: CsrfForm):
    panel.sessions.end(request)  # the cookie, copied or not, opens nothing from now on
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/")
    return response


@router.post("/lang")
async def set_language(
    request: Request,
    panel: Panel,
    lang: Annotated[str, Form()] = "en",
    csrf: Annotated[str, Form()] = "",
    next: Annotated[str, Form()] = "/nodes",
):
    panel.sessions.check_csrf(request, csrf)
    response = RedirectResponse(safe_next(next), status_code=303)
    if lang in LANGUAGES:
        response.set_cookie(LANG_COOKIE, lang, max_age=365 * 86400, **cookie_args(request))
    return response
