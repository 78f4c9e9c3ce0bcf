"""Pages: Jinja2 templates rendered in the request's language, with the CSRF token and the labels
(marked for translation here, translated in the template) that several pages show."""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import jinja2
from fastapi import Request
from fastapi.responses import HTMLResponse

from ..i18n import LANGUAGES, Translator
from .sessions import UiSessions

PANEL_DIR = Path(__file__).resolve().parent.parent
TEMPLATES = PANEL_DIR / "templates"  # a symlink to the top-level templates/
STATIC_DIR = PANEL_DIR / "static"


def N_(message: str) -> str:
    """Marks a message for extraction; translated where it is shown."""
    return message


FALLBACKS = {"decode_alone": N_("Decode alone (run on the decoder)"), "fail": N_("Fail the request")}
PAGE_ENCODINGS = {
    "raw": N_("Raw FP16"),
    "zstd": N_("Compressed (zstd, lossless)"),
    "fp8": N_("FP8 (lossy, half the bytes)"),
    "int8": N_("INT8 (lossy, about half the bytes, closer to FP16)"),
}
ROLES = {"prefill": N_("prefill"), "decode": N_("decode")}
ROUTES = {"pd": N_("prefill → decode"), "decode_alone": N_("decoder alone"), "node": N_("single node")}
OUTCOMES = {
    "ok": N_("ok"),
    "error": N_("error"),
    "cancelled": N_("cancelled"),
    "running": N_("running"),
    "interrupted": N_("interrupted"),
}
CONTRACT_FIELDS = {
    "weights": N_("weights"),
    "tokenizer": N_("tokenizer"),
    "config": N_("model config"),
    "context_length": N_("context length"),
}
HEALTH = {
    "ok": N_("healthy"),
    "unpaired": N_("not paired"),
    "timeout": N_("timeout"),
    "key_rejected": N_("key rejected (401)"),
    "protocol": N_("protocol mismatch"),
    "unreachable": N_("unreachable"),
    "error": N_("error"),
    "unproved": N_("it could not prove it holds the cluster key, so the key was not sent"),
}
LABELS = {
    "fallbacks": FALLBACKS,
    "encodings": PAGE_ENCODINGS,
    "roles": ROLES,
    "routes": ROUTES,
    "outcomes": OUTCOMES,
    "fields": CONTRACT_FIELDS,
    "health": HEALTH,
}


def fmt_bytes(n: float | int | None) -> str:
    n = float(n or 0)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def fmt_time(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "—"


_env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True, extensions=["jinja2.ext.i18n"])
_env.newstyle_gettext = True  # {% trans %} and _() format with %(name)s, like Translator.gettext
_env.filters["bytes"] = fmt_bytes
_env.filters["time"] = fmt_time


class Renderer:
    """Renders pages for one request: its language, its session's CSRF token (or a new
    pre-login one, set as a cookie on the response) and the headers every page carries."""

    def __init__(self, request: Request, sessions: UiSessions, translator: Translator):
        self.request, self.sessions, self.t = request, sessions, translator

    def __call__(self, name: str, status_code: int = 200, session: dict | None = None, **context) -> HTMLResponse:
        """A page; `session`: one signed in this very response (the request's is no longer valid)."""
        request, t = self.request, self.t
        data = session or self.sessions.of(request)
        token = data["csrf"] if data else self.sessions.anon_token(request)
        new_anon = None
        if token is None:
            token = new_anon = secrets.token_urlsafe(24)
        html = _env.get_template(name).render(
            request=request,
            gettext=t.gettext,
            ngettext=t.ngettext,
            lang=t.lang,
            html_lang=t.html_lang,
            languages=LANGUAGES,
            csrf=token,
            logged_in=data is not None,
            path=request.url.path,
            N=LABELS,
            **context,
        )
        response = HTMLResponse(html, status_code=status_code)
        if new_anon:
            self.sessions.set_anon_token(request, response, new_anon)
        response.headers["Cache-Control"] = "no-store"
        response.headers["X-Frame-Options"] = "DENY"
        response.headers["Referrer-Policy"] = "same-origin"
        return response
