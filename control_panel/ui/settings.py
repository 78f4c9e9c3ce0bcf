"""The Settings page: language, API keys (shown once, stored hashed) with their limits, whether
they share the prefix cache, and the admin password."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import RedirectResponse
from sqlmodel import Session, col, select

from ..cache_salt import set_shared
from ..deps import SIGNED_IN, CsrfForm, Db, Panel, Render, Tr
from ..models import ApiKey
from ..security import (
    check_admin_password,
    create_api_key,
    off_loop_argon2,
    revoke_api_key,
    set_admin_password,
    set_key_limits,
)
from .pools import whole_number

router = APIRouter(include_in_schema=False, dependencies=SIGNED_IN)


def settings_context(panel: Panel, **extra) -> dict:
    with Session(panel.db) as s:
        keys = list(s.exec(select(ApiKey).order_by(col(ApiKey.created).desc())))
    return {
        "keys": keys,
        "most_concurrent": MOST_CONCURRENT,
        "most_tokens_per_minute": MOST_TOKENS_PER_MINUTE,
        "new_key": None,
        "key_error": None,
        "pw_error": None,
        "pw_ok": False,
        "share_prefix_cache": panel.cache_salts.shared,
        "mdns": panel.watcher is not None,
        "mdns_seen": len(panel.watcher.peers) if panel.watcher else 0,
        "mdns_error": panel.discovery_error,
        **extra,
    }


@router.get("/settings")
async def settings_page(panel: Panel, render: Render):
    return render("settings.html", **settings_context(panel))


@router.post("/settings/keys")
async def settings_new_key(_csrf: CsrfForm, panel: Panel, render: Render, t: Tr, name: Annotated[str, Form()] = ""):
    name = name.strip()
    if not name:
        error = t.gettext("Give the key a name.")
        return render("settings.html", status_code=400, **settings_context(panel, key_error=error))
    key = create_api_key(panel.db, name[:100])
    return render("settings.html", **settings_context(panel, new_key=key, new_key_name=name))


@router.post("/settings/keys/{key_id}/delete")
async def settings_delete_key(_csrf: CsrfForm, key_id: int, db: Db):
    await asyncio.to_thread(revoke_api_key, db, key_id)  # its stored responses may be many MiB
    return RedirectResponse("/settings", status_code=303)


@router.post("/settings/prefix-cache")
async def settings_prefix_cache(_csrf: CsrfForm, panel: Panel, share: Annotated[str, Form()] = ""):
    """Share the prefix cache across API keys (the box ticked) or give each key its own (cache_salt.py)."""
    await asyncio.to_thread(set_shared, panel.db, panel.cache_salts, share == "on")
    return RedirectResponse("/settings", status_code=303)


# The most a key's limit may be set to: past these a limit limits nothing on a home cluster.
MOST_CONCURRENT = 1000
MOST_TOKENS_PER_MINUTE = 1_000_000_000


def limit_of(text: str) -> int | None:
    """A limit as typed: None when blank (no limit)."""
    return whole_number(text, 1) if text.strip() else None


def limits_problem(concurrent: str, tokens: str, t: Tr) -> str | None:
    """What is wrong with the limits typed, or None."""
    for text, label, most in (
        (concurrent, t.gettext("Requests at once"), MOST_CONCURRENT),
        (tokens, t.gettext("Tokens per minute"), MOST_TOKENS_PER_MINUTE),
    ):
        value = whole_number(text, 1) if text.strip() else 1
        if value is None or value > most:
            return t.gettext(
                "%(limit)s: a whole number from 1 to %(most)s, or blank for no limit.", limit=label, most=most
            )
    return None


@router.post("/settings/keys/{key_id}/limits")
async def settings_key_limits(
    _csrf: CsrfForm,
    key_id: int,
    panel: Panel,
    render: Render,
    t: Tr,
    max_concurrent: Annotated[str, Form()] = "",
    tokens_per_minute: Annotated[str, Form()] = "",
):
    if error := limits_problem(max_concurrent, tokens_per_minute, t):
        return render("settings.html", status_code=400, **settings_context(panel, key_error=error))
    set_key_limits(panel.db, key_id, limit_of(max_concurrent), limit_of(tokens_per_minute))
    return RedirectResponse("/settings", status_code=303)


def password_problem(db, current: str, new: str, confirm: str, t: Tr) -> str | None:
    _ = t.gettext
    if not check_admin_password(db, current):
        return _("The current password is wrong.")
    if len(new) < 8:
        return _("The new password needs at least 8 characters.")
    if new != confirm:
        return _("The two new passwords differ.")
    return None


@router.post("/settings/password")
async def settings_password(
    _csrf: CsrfForm,
    request: Request,
    panel: Panel,
    render: Render,
    t: Tr,
    current: Annotated[str, Form()] = "",
    new: Annotated[str, Form()] = "",
    confirm: Annotated[str, Form()] = "",
):
    if error := await off_loop_argon2(password_problem, panel.db, current, new, confirm, t):
        return render("settings.html", status_code=400, **settings_context(panel, pw_error=error))
    await off_loop_argon2(set_admin_password, panel.db, new)
    panel.sessions.end_all()
    # the old session is now invalid: sign a new one for this browser, and render the page with
    # its CSRF token (the forms on it must work without a reload)
    data = panel.sessions.new_session()
    response = render("settings.html", session=data, **settings_context(panel, pw_ok=True))
    panel.sessions.sign_in(request, response, data)
    return response
