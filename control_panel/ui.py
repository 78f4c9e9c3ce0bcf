"""The panel's web UI: server-rendered pages (Jinja2), live parts with htmx, no build step.

Sessions are itsdangerous-signed cookies (HttpOnly, SameSite=Lax) that carry a CSRF token; every
POST checks that token (a form field, or the X-CSRF-Token header that htmx and the playground's
fetch() send). Before login the token lives in its own signed cookie. A page asked for without a
session redirects to /login; an htmx or fetch() call gets 401 (with HX-Redirect for htmx). Failed
logins are limited per client address (`login_limit.py`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path

import jinja2
from fastapi import APIRouter, Form, HTTPException, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from itsdangerous import BadSignature, URLSafeTimedSerializer
from sqlmodel import Session, col, select

from tandem_protocol import ENGINES
from tandem_protocol.auth import key_matches
from tandem_protocol.client import AgentClient, AgentHTTPError, TransportError
from tandem_protocol.errors import ContractMismatch
from tandem_protocol.pages import PROTOCOL_VERSION

from . import services
from .bench_results import latest_ttft
from .db import set_setting
from .i18n import COOKIE as LANG_COOKIE
from .i18n import LANGUAGES, Translator, load_all, pick_language
from .login_limit import LoginLimiter
from .models import ApiKey, Node, Pair, RequestLog
from .openai_api import OpenAIError, resolve_target
from .request_log import save as log_request
from .router import RouteError, RouteStats
from .security import (
    admin_password_version,
    check_admin_password,
    create_api_key,
    set_admin_password,
    ui_session_secret,
)
from .services import PanelError, add_node, create_pair, delete_row

TEMPLATES = Path(__file__).resolve().parent / "templates"  # a symlink to the top-level templates/
STATIC_DIR = Path(__file__).resolve().parent / "static"
SESSION_COOKIE, ANON_COOKIE = "tandem_session", "tandem_csrf"
SESSION_MAX_AGE = 12 * 3600
STATUS_TIMEOUT = 3.0


def N_(message: str) -> str:
    """Marks a message for extraction; translated where it is shown."""
    return message


FALLBACKS = {"decode_alone": N_("Decode alone (run on the decoder)"), "fail": N_("Fail the request")}
PAGE_ENCODINGS = {"raw": N_("Raw FP16"), "zstd": N_("Compressed (zstd, lossless)")}
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
}


_env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True, extensions=["jinja2.ext.i18n"])
_env.newstyle_gettext = True  # {% trans %} and _() format with %(name)s, like Translator.gettext


def _fmt_bytes(n: float | int | None) -> str:
    n = float(n or 0)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _fmt_time(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "—"


_env.filters["bytes"] = _fmt_bytes
_env.filters["time"] = _fmt_time


async def probe(url: str, key: str | None) -> dict:
    """An agent's /v1/status, or why it failed: {"health": ok|timeout|key_rejected|protocol|unreachable|error}.
    With no key (a node not paired yet is sent none), only its liveness: "unpaired" when it is up."""
    client = AgentClient(url, key or "", timeout=STATUS_TIMEOUT)
    try:
        if key is None:
            await asyncio.wait_for(client.healthz(), STATUS_TIMEOUT)
            return {"health": "unpaired", "detail": ""}
        status = await asyncio.wait_for(client.status(), STATUS_TIMEOUT)
    except TimeoutError as e:
        return {"health": "timeout", "detail": f"no answer within {STATUS_TIMEOUT:.0f} s" if not str(e) else str(e)}
    except AgentHTTPError as e:
        if e.status == 401:
            return {"health": "key_rejected", "detail": str(e)}
        if e.status == 400 and "protocol" in str(e):
            return {"health": "protocol", "detail": str(e)}
        return {"health": "error", "detail": str(e)}
    except TransportError as e:
        return {"health": "unreachable", "detail": f"{type(e).__name__}: {e}"}
    finally:
        await client.aclose()
    if status.get("protocol_version") != PROTOCOL_VERSION:
        return {
            "health": "protocol",
            "status": status,
            "detail": f"agent speaks protocol {status.get('protocol_version')}, panel speaks {PROTOCOL_VERSION}",
        }
    return {"health": "ok", "status": status, "detail": ""}


def make_ui_router(
    engine, router, watcher=None, data_dir: Path | None = None, login_limiter: LoginLimiter | None = None
) -> APIRouter:
    load_all()
    limiter = login_limiter or LoginLimiter()
    ui = APIRouter(include_in_schema=False)
    secret = ui_session_secret(engine)
    sessions = URLSafeTimedSerializer(secret, salt="tandem-ui-session")
    anon = URLSafeTimedSerializer(secret, salt="tandem-ui-csrf")

    # ---- sessions, CSRF, language -------------------------------------------------------------

    def session_of(request: Request) -> dict | None:
        raw = request.cookies.get(SESSION_COOKIE)
        if not raw:
            return None
        try:
            data = sessions.loads(raw, max_age=SESSION_MAX_AGE)
        except BadSignature:
            return None
        if not isinstance(data, dict) or data.get("pv") != admin_password_version(engine):
            return None
        return data

    def wants_fragment(request: Request) -> bool:
        return request.headers.get("HX-Request") == "true" or request.url.path.startswith("/ui/")

    def anon_token(request: Request) -> str | None:
        raw = request.cookies.get(ANON_COOKIE)
        if raw:
            try:
                return anon.loads(raw, max_age=SESSION_MAX_AGE)
            except BadSignature:
                return None
        return None

    def expected_csrf(request: Request) -> str | None:
        data = session_of(request)
        return data["csrf"] if data else anon_token(request)

    def check_csrf(request: Request, presented: str | None) -> None:
        expected = expected_csrf(request)
        presented = presented or request.headers.get("X-CSRF-Token")
        if not expected or not presented or not hmac.compare_digest(expected, presented):
            raise HTTPException(403, "CSRF token missing or wrong: reload the page and try again")

    def translator(request: Request) -> Translator:
        return Translator(pick_language(request.cookies.get(LANG_COOKIE), request.headers.get("accept-language")))

    def cookie_args(request: Request) -> dict:
        return {"httponly": True, "samesite": "lax", "secure": request.url.scheme == "https", "path": "/"}

    def render(
        request: Request, name: str, status_code: int = 200, session: dict | None = None, **context
    ) -> HTMLResponse:
        """A page; `session`: one signed in this very response (the request's is no longer valid)."""
        t = translator(request)
        data = session or session_of(request)
        new_anon = None
        token = data["csrf"] if data else anon_token(request)
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
            N={
                "fallbacks": FALLBACKS,
                "encodings": PAGE_ENCODINGS,
                "routes": ROUTES,
                "outcomes": OUTCOMES,
                "fields": CONTRACT_FIELDS,
                "health": HEALTH,
            },
            **context,
        )
        response = HTMLResponse(html, status_code=status_code)
        if new_anon:
            response.set_cookie(ANON_COOKIE, anon.dumps(new_anon), max_age=SESSION_MAX_AGE, **cookie_args(request))
        response.headers["Cache-Control"] = "no-store"
        response.headers["X-Frame-Options"] = "DENY"
        response.headers["Referrer-Policy"] = "same-origin"
        return response

    def safe_next(value: str | None) -> str:
        return (
            value if value and value.startswith("/") and not value.startswith("//") and "\\" not in value else "/nodes"
        )

    async def guard(request: Request):
        """Every UI route but /login and /lang: a page redirects to /login, htmx and fetch() get 401.
        Only a GET comes back after login (`next`): a form's POST cannot be replayed as a GET."""
        if session_of(request) is None:
            if wants_fragment(request):
                return Response("login required", status_code=401, headers={"HX-Redirect": "/login"})
            back = f"?next={request.url.path}" if request.method == "GET" else ""
            return RedirectResponse(f"/login{back}", status_code=303)
        return None

    # ---- login ---------------------------------------------------------------------------------

    @ui.get("/login")
    async def login_page(request: Request, next: str = "/nodes"):
        if session_of(request):
            return RedirectResponse(safe_next(next), status_code=303)
        return render(request, "login.html", error=None, next=safe_next(next))

    @ui.post("/login")
    async def login(request: Request, password: str = Form(""), csrf: str = Form(""), next: str = Form("/nodes")):
        _ = translator(request).gettext
        address = request.client.host if request.client else ""
        wait = limiter.retry_after(address)
        if wait is not None:  # the password is not even looked at
            response = render(
                request,
                "login.html",
                status_code=429,
                next=safe_next(next),
                error=_("Too many failed attempts: wait %(seconds)s s, then try again.", seconds=wait),
            )
            response.headers["Retry-After"] = str(wait)
            return response
        check_csrf(request, csrf)
        if not check_admin_password(engine, password):
            limiter.failed(address)
            return render(request, "login.html", status_code=401, error=_("Wrong password."), next=safe_next(next))
        limiter.succeeded(address)
        response = RedirectResponse(safe_next(next), status_code=303)
        token = sessions.dumps({"u": "admin", "csrf": secrets.token_urlsafe(24), "pv": admin_password_version(engine)})
        response.set_cookie(SESSION_COOKIE, token, max_age=SESSION_MAX_AGE, **cookie_args(request))
        return response

    @ui.post("/logout")
    async def logout(request: Request, csrf: str = Form("")):
        if r := await guard(request):
            return r
        check_csrf(request, csrf)
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(SESSION_COOKIE, path="/")
        return response

    @ui.post("/lang")
    async def set_language(request: Request, lang: str = Form("en"), csrf: str = Form(""), next: str = Form("/nodes")):
        check_csrf(request, csrf)
        response = RedirectResponse(safe_next(next), status_code=303)
        if lang in LANGUAGES:
            response.set_cookie(LANG_COOKIE, lang, max_age=365 * 86400, **cookie_args(request))
        return response

    @ui.get("/")
    async def home(request: Request):
        return (await guard(request)) or RedirectResponse("/nodes", status_code=303)

    # ---- nodes ---------------------------------------------------------------------------------

    def nodes_list() -> list[Node]:
        with Session(engine) as s:
            return list(s.exec(select(Node).order_by(Node.name)))

    async def node_rows() -> list[dict]:
        nodes = nodes_list()
        # an unpaired node (found by mDNS) gets no key until the user pairs it: only its liveness
        results = await asyncio.gather(*(probe(n.url, router.cluster_key if n.paired else None) for n in nodes))
        now = time.time()
        with Session(engine) as s:
            for n, r in zip(nodes, results):
                row = s.get(Node, n.id)
                if row is not None:
                    row.last_error = "" if r["health"] == "ok" else f"{r['health']}: {r['detail']}"[:500]
                    if r["health"] == "ok":
                        row.last_seen = now
                    s.add(row)
            s.commit()
        rows = []
        for n, r in zip(nodes, results):
            st = r.get("status") or {}
            budget = st.get("budget") or {}
            cap, reserved = budget.get("capacity") or 0, budget.get("reserved") or 0
            rows.append(
                {
                    "node": n,
                    "health": r["health"],
                    "detail": r["detail"],
                    "status": st,
                    "engine": st.get("engine") or n.engine,
                    "model": st.get("model") or n.model,
                    "accelerator": st.get("accelerator") or {},
                    "contract": ((st.get("contract") or {}).get("fingerprint") or n.contract)[:12],
                    "budget": {
                        "capacity": cap,
                        "reserved": reserved,
                        "waiting": budget.get("waiting", 0),
                        "percent": round(100 * reserved / cap) if cap else 0,
                    },
                    "open_handoffs": st.get("open_handoffs"),
                    "totals": st.get("totals") or {},
                }
            )
        return rows

    @ui.get("/nodes")
    async def nodes_page(request: Request):
        if r := await guard(request):
            return r
        return render(
            request,
            "nodes.html",
            rows=await node_rows(),
            error=None,
            added=None,
            url_value="",
            mdns=watcher is not None,
        )

    @ui.get("/nodes/table")
    async def nodes_table(request: Request):
        if r := await guard(request):
            return r
        return render(request, "_nodes_table.html", rows=await node_rows())

    @ui.post("/nodes")
    async def nodes_add(request: Request, url: str = Form(""), csrf: str = Form("")):
        if r := await guard(request):
            return r
        check_csrf(request, csrf)
        _ = translator(request).gettext
        url = url.strip().rstrip("/")
        error = None
        if not url.startswith(("http://", "https://")):
            error = _("Give the agent's URL, for example http://192.168.1.20:7411")
        else:
            probed = await probe(url, router.cluster_key)
            if probed["health"] != "ok":
                error = _("Could not add %(url)s: %(reason)s", url=url, reason=_(HEALTH[probed["health"]]))
                error += f" ({probed['detail']})" if probed["detail"] else ""
            else:
                try:
                    await add_node(engine, url, router.cluster_key)
                except PanelError as e:
                    error = _("Could not add %(url)s: %(reason)s", url=url, reason=str(e))
        if error:
            return render(
                request,
                "nodes.html",
                status_code=400,
                rows=await node_rows(),
                error=error,
                added=None,
                url_value=url,
                mdns=watcher is not None,
            )
        return RedirectResponse("/nodes", status_code=303)

    @ui.get("/nodes/{node_id}/pair")
    async def node_pair_page(request: Request, node_id: int):
        if r := await guard(request):
            return r
        with Session(engine) as s:
            node = s.get(Node, node_id)
        if node is None:
            return RedirectResponse("/nodes", status_code=303)
        return render(request, "node_pair.html", node=node, error=None, panel_has_key=bool(router.cluster_key))

    @ui.post("/nodes/{node_id}/pair")
    async def node_pair(request: Request, node_id: int, key: str = Form(""), csrf: str = Form("")):
        """Pair a node found by mDNS: the user vouches for it by giving the cluster key."""
        if r := await guard(request):
            return r
        check_csrf(request, csrf)
        _ = translator(request).gettext
        with Session(engine) as s:
            node = s.get(Node, node_id)
        if node is None:
            return RedirectResponse("/nodes", status_code=303)
        key = key.strip() or router.cluster_key
        error = None
        if not key:
            error = _("Enter the cluster key (run `tandem agent key` on the agent's machine).")
        elif router.cluster_key and not key_matches(key, router.cluster_key):
            error = _("This key differs from the panel's cluster key: every node of a panel shares one key.")
        else:
            probed = await probe(node.url, key)
            if probed["health"] != "ok":
                error = _("Could not pair %(name)s: %(reason)s", name=node.name, reason=_(HEALTH[probed["health"]]))
            else:
                if not router.cluster_key:
                    set_setting(engine, "cluster_key", key)
                    await router.set_cluster_key(key)
                try:
                    await add_node(engine, node.url, key, source=node.source)
                except PanelError as e:
                    error = _("Could not pair %(name)s: %(reason)s", name=node.name, reason=str(e))
        if error:
            return render(
                request,
                "node_pair.html",
                status_code=400,
                node=node,
                error=error,
                panel_has_key=bool(router.cluster_key),
            )
        return RedirectResponse("/nodes", status_code=303)

    # ---- pairs ---------------------------------------------------------------------------------

    async def pairs_context() -> dict:
        with Session(engine) as s:
            nodes = {n.id: n for n in s.exec(select(Node).order_by(Node.name))}
            pairs = [
                {"pair": p, "prefill": nodes.get(p.prefill_node_id), "decode": nodes.get(p.decode_node_id)}
                for p in s.exec(select(Pair).order_by(Pair.name))
            ]
        paired = [n for n in nodes.values() if n.paired]
        found = await asyncio.gather(*(node_models(n.url) for n in paired))
        model_paths = [(n.name, m["path"]) for n, models in zip(paired, found) for m in models if m["supported"]]
        return {"pairs": pairs, "nodes": paired, "engines": list(ENGINES), "model_paths": model_paths}

    async def node_models(url: str) -> list[dict]:
        """The checkpoints a node offers (for the pair form's model-path suggestions); [] if it does not answer."""
        client = AgentClient(url, router.cluster_key, timeout=STATUS_TIMEOUT)
        try:
            return (await asyncio.wait_for(client.local_models(), STATUS_TIMEOUT))["models"]
        except (TimeoutError, AgentHTTPError, *TransportError):
            return []
        finally:
            await client.aclose()

    @ui.get("/pairs")
    async def pairs_page(request: Request):
        if r := await guard(request):
            return r
        return render(request, "pairs.html", error=None, bad_fields=[], form={}, **(await pairs_context()))

    @ui.post("/pairs")
    async def pairs_create(
        request: Request,
        name: str = Form(""),
        prefill: str = Form(""),
        decode: str = Form(""),
        prefill_engine: str = Form(""),
        prefill_model_path: str = Form(""),
        decode_engine: str = Form(""),
        decode_model_path: str = Form(""),
        context_length: str = Form(""),
        staging_mib: str = Form(""),
        threshold: str = Form("0"),
        fallback: str = Form("decode_alone"),
        page_encoding: str = Form("raw"),
        csrf: str = Form(""),
    ):
        if r := await guard(request):
            return r
        check_csrf(request, csrf)
        _ = translator(request).gettext
        form = {
            "name": name.strip(),
            "prefill": prefill,
            "decode": decode,
            "threshold": threshold,
            "fallback": fallback,
            "page_encoding": page_encoding,
            "prefill_engine": prefill_engine,
            "prefill_model_path": prefill_model_path.strip(),
            "decode_engine": decode_engine,
            "decode_model_path": decode_model_path.strip(),
            "context_length": context_length.strip(),
            "staging_mib": staging_mib.strip(),
        }
        error, bad = None, []
        numbers = {}
        for key, message in (
            ("context_length", _("The context length must be a whole number of tokens, 1 or more.")),
            ("staging_mib", _("The staging budget must be a whole number of MiB, 1 or more.")),
        ):
            if form[key] and (not form[key].isdigit() or int(form[key]) < 1):
                error, bad = message, [key]
            numbers[key] = int(form[key]) if form[key].isdigit() and int(form[key]) >= 1 else None
        with Session(engine) as s:
            p_node = s.get(Node, int(prefill)) if prefill.isdigit() else None
            d_node = s.get(Node, int(decode)) if decode.isdigit() else None
        try:
            limit = int(threshold or 0)
            if limit < 0:
                raise ValueError
        except ValueError:
            limit, error, bad = 0, _("The threshold must be a whole number of tokens, 0 or more."), ["threshold"]
        if error is None:
            if not form["name"] or "/" in form["name"]:
                error, bad = _("A pair needs a name without '/' (it becomes the model name on the API)."), ["name"]
            elif p_node is None or d_node is None:
                error, bad = _("Choose a prefill node and a decode node."), ["prefill", "decode"]
            elif p_node.id == d_node.id:
                error, bad = _("The prefill node and the decode node must be different."), ["prefill", "decode"]
            elif fallback not in FALLBACKS:
                error, bad = _("Unknown fallback policy."), ["fallback"]
            elif page_encoding not in PAGE_ENCODINGS:
                error, bad = _("Unknown page encoding."), ["page_encoding"]
        if error is None:
            try:
                staging = numbers["staging_mib"] << 20 if numbers["staging_mib"] else None
                try:
                    await create_pair(
                        engine,
                        router.cluster_key,
                        form["name"],
                        p_node.url,
                        d_node.url,
                        limit,
                        fallback,
                        page_encoding,
                        prefill_engine=prefill_engine or None,
                        prefill_model_path=form["prefill_model_path"] or None,
                        decode_engine=decode_engine or None,
                        decode_model_path=form["decode_model_path"] or None,
                        context_length=numbers["context_length"],
                        staging_bytes=staging,
                    )
                finally:
                    router.forget(p_node.url, d_node.url)  # their engines may have just changed
            except ContractMismatch as e:
                names = ", ".join(_(CONTRACT_FIELDS.get(f, f)) for f in e.fields)
                error = _(
                    "The two nodes do not run the same model: their contracts differ in %(fields)s.", fields=names
                )
                bad = ["prefill", "decode"] + [f"contract:{f}" for f in e.fields]
            except PanelError as e:
                error, bad = _("Could not create the pair: %(reason)s", reason=str(e)), list(e.fields)
        if error:
            return render(
                request,
                "pairs.html",
                status_code=400,
                error=error,
                bad_fields=bad,
                form=form,
                **(await pairs_context()),
            )
        return RedirectResponse("/pairs", status_code=303)

    @ui.post("/pairs/{pair_id}/delete")
    async def pairs_delete(request: Request, pair_id: int, csrf: str = Form("")):
        if r := await guard(request):
            return r
        check_csrf(request, csrf)
        delete_row(engine, Pair, pair_id)
        return RedirectResponse("/pairs", status_code=303)

    # ---- playground ----------------------------------------------------------------------------

    def model_names() -> list[str]:
        return services.model_names(engine)

    @ui.get("/playground")
    async def playground_page(request: Request):
        if r := await guard(request):
            return r
        return render(request, "playground.html", models=model_names())

    @ui.post("/ui/playground/stream")
    async def playground_stream(request: Request):
        if r := await guard(request):
            return r
        check_csrf(request, None)
        _ = translator(request).gettext
        try:
            body = await request.json()
            model, message = str(body["model"]), str(body["message"])
            max_tokens = max(1, min(int(body.get("max_tokens") or 128), 2048))
            temperature = float(body.get("temperature") or 0.0)
        except (ValueError, KeyError, TypeError):
            return Response(
                json.dumps({"error": _("Bad request.")}) + "\n", status_code=400, media_type="application/x-ndjson"
            )
        if not message.strip():
            return Response(
                json.dumps({"error": _("Type a message first.")}) + "\n",
                status_code=400,
                media_type="application/x-ndjson",
            )
        try:
            target = resolve_target(engine, model)
        except OpenAIError:
            return Response(
                json.dumps({"error": _("Unknown model %(model)s.", model=model)}) + "\n",
                status_code=404,
                media_type="application/x-ndjson",
            )

        async def events() -> AsyncIterator[bytes]:
            stats = RouteStats()
            ids: list[int] = []
            outcome, error = "cancelled", ""
            try:
                ids = await router.tokenize(target, [{"role": "user", "content": message}], None)
                sampling = {
                    "max_tokens": max_tokens,
                    "temperature": temperature,
                    "top_p": 1.0,
                    "top_k": 0,
                    "seed": None,
                }
                gen = router.run(target, ids, sampling, stats)
                try:
                    async for event in gen:
                        if "error" in event:
                            raise RouteError(event["error"].get("message", "error"), 503)
                        if "token" in event:
                            yield (json.dumps({"text": event["text"]}) + "\n").encode()
                finally:
                    await gen.aclose()
                outcome = "ok"
            except RouteError as e:
                outcome, error = "error", str(e)
                yield (json.dumps({"error": str(e)}) + "\n").encode()
            finally:
                elapsed = time.perf_counter() - stats.started
                decode_s = elapsed - (stats.ttft_ms or 0) / 1000
                tps = (stats.output_tokens - 1) / decode_s if stats.output_tokens > 1 and decode_s > 0 else None
                log_request(
                    engine,
                    RequestLog(
                        model=model,
                        route=stats.route or "",
                        reason=stats.reason,
                        prompt_tokens=len(ids),
                        ttft_ms=stats.ttft_ms,
                        output_tokens=stats.output_tokens,
                        bytes_moved=stats.bytes_moved,
                        outcome=outcome,
                        error=error,
                    ),
                )
            yield (
                json.dumps(
                    {
                        "done": True,
                        "route": stats.route,
                        "reason": stats.reason,
                        "prompt_tokens": len(ids),
                        "output_tokens": stats.output_tokens,
                        "ttft_ms": stats.ttft_ms,
                        "tokens_per_s": tps,
                        "bytes_moved": stats.bytes_moved,
                        "bytes_label": _fmt_bytes(stats.bytes_moved),
                    }
                )
                + "\n"
            ).encode()

        return StreamingResponse(
            events(),
            media_type="application/x-ndjson",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    # ---- requests ------------------------------------------------------------------------------

    @ui.get("/requests")
    async def requests_page(request: Request):
        if r := await guard(request):
            return r
        with Session(engine) as s:
            rows = list(s.exec(select(RequestLog).order_by(col(RequestLog.created).desc()).limit(200)))
        bench = latest_ttft(data_dir) if data_dir is not None else None
        return render(request, "requests.html", rows=rows, chart=ttft_chart(list(reversed(rows[:60]))), bench=bench)

    # ---- help, settings ------------------------------------------------------------------------

    @ui.get("/help")
    async def help_page(request: Request):
        if r := await guard(request):
            return r
        return render(request, "help.html", base_url=str(request.base_url).rstrip("/"))

    def settings_context(**extra) -> dict:
        with Session(engine) as s:
            keys = list(s.exec(select(ApiKey).order_by(col(ApiKey.created).desc())))
        return {
            "keys": keys,
            "new_key": None,
            "key_error": None,
            "pw_error": None,
            "pw_ok": False,
            "mdns": watcher is not None,
            "mdns_seen": len(watcher.peers) if watcher else 0,
            **extra,
        }

    @ui.get("/settings")
    async def settings_page(request: Request):
        if r := await guard(request):
            return r
        return render(request, "settings.html", **settings_context())

    @ui.post("/settings/keys")
    async def settings_new_key(request: Request, name: str = Form(""), csrf: str = Form("")):
        if r := await guard(request):
            return r
        check_csrf(request, csrf)
        _ = translator(request).gettext
        name = name.strip()
        if not name:
            return render(
                request, "settings.html", status_code=400, **settings_context(key_error=_("Give the key a name."))
            )
        key = create_api_key(engine, name[:100])
        return render(request, "settings.html", **settings_context(new_key=key, new_key_name=name))

    @ui.post("/settings/keys/{key_id}/delete")
    async def settings_delete_key(request: Request, key_id: int, csrf: str = Form("")):
        if r := await guard(request):
            return r
        check_csrf(request, csrf)
        delete_row(engine, ApiKey, key_id)
        return RedirectResponse("/settings", status_code=303)

    @ui.post("/settings/password")
    async def settings_password(
        request: Request, current: str = Form(""), new: str = Form(""), confirm: str = Form(""), csrf: str = Form("")
    ):
        if r := await guard(request):
            return r
        check_csrf(request, csrf)
        _ = translator(request).gettext
        error = None
        if not check_admin_password(engine, current):
            error = _("The current password is wrong.")
        elif len(new) < 8:
            error = _("The new password needs at least 8 characters.")
        elif new != confirm:
            error = _("The two new passwords differ.")
        if error:
            return render(request, "settings.html", status_code=400, **settings_context(pw_error=error))
        set_admin_password(engine, new)
        # the old session is now invalid: sign a new one for this browser, and render the page with
        # its CSRF token (the forms on it must work without a reload)
        data = {"u": "admin", "csrf": secrets.token_urlsafe(24), "pv": admin_password_version(engine)}
        response = render(request, "settings.html", session=data, **settings_context(pw_ok=True))
        response.set_cookie(SESSION_COOKIE, sessions.dumps(data), max_age=SESSION_MAX_AGE, **cookie_args(request))
        return response

    return ui


def ttft_chart(rows: list[RequestLog], width: int = 720, height: int = 160) -> dict:
    """Bars of TTFT per request (oldest left), as numbers the template draws as inline SVG."""
    values = [r.ttft_ms for r in rows]
    top = max([v for v in values if v is not None] or [1.0])
    pad_left, pad_bottom = 72, 20
    plot_w, plot_h = width - pad_left - 8, height - pad_bottom - 8
    n = max(len(rows), 1)
    step = min(plot_w / n, 36.0)  # a few requests still look like bars, not one wall
    bars = []
    for i, r in enumerate(rows):
        v = r.ttft_ms
        h = 0 if v is None else max(1.0, plot_h * v / top)
        bars.append(
            {
                "x": round(pad_left + i * step + step * 0.1, 1),
                "w": round(max(step * 0.8, 1), 1),
                "y": round(8 + plot_h - h, 1),
                "h": round(h, 1),
                "ms": v,
                "route": r.route,
                "outcome": r.outcome,
                "model": r.model,
            }
        )
    return {
        "width": width,
        "height": height,
        "bars": bars,
        "top": round(top),
        "pad_left": pad_left,
        "base_y": 8 + plot_h,
        "plot_w": plot_w,
        "empty": not any(v is not None for v in values),
    }
