"""The panel's web UI in a real browser (Debian's Chromium through Playwright), on real agents."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket

import httpx
import pytest

from .agents import TEST_KEY, AgentProcess, PanelProcess

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]
SCREENSHOT = "/tmp/ui_nodes.png"
MORE_SCREENSHOTS = os.environ.get("TANDEM_UI_SCREENSHOTS")  # set it to also save the other pages in /tmp

playwright_api = pytest.importorskip("playwright.sync_api")


@pytest.fixture(scope="module")
def cluster(smol_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("panel_ui")
    with AgentProcess("torch", smol_dir, home / "torch") as t, AgentProcess("mlx", smol_dir, home / "mlx") as m:
        with PanelProcess(home / "panel", "--node", t.url, "--node", m.url) as panel:
            yield {"panel": panel, "torch": t, "mlx": m}


@pytest.fixture(scope="module")
def browser():
    if not shutil.which(CHROMIUM):
        pytest.fail(f"Chromium not found at {CHROMIUM} (apt-get install -y chromium)")
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def _csrf(html: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', html).group(1)


def test_every_page_needs_a_session(cluster):
    url = cluster["panel"].url
    with httpx.Client(base_url=url, timeout=30) as c:
        for path in ("/", "/nodes", "/pairs", "/playground", "/requests", "/help", "/settings"):
            r = c.get(path, headers={"Accept": "text/html"})
            assert r.status_code == 303 and r.headers["location"].startswith("/login"), path
        r = c.get("/nodes/table", headers={"HX-Request": "true"})
        assert r.status_code == 401 and r.headers["HX-Redirect"] == "/login"
        r = c.post("/ui/playground/stream", json={"model": "x", "message": "hi"})
        assert r.status_code == 401
        assert c.get("/static/htmx.min.js").status_code == 200
        login = c.get("/login")
        assert login.status_code == 200
        # a forged or missing CSRF token is refused, even with the right password
        r = c.post("/login", data={"password": cluster["panel"].admin_password, "csrf": "forged"})
        assert r.status_code == 403
        r = c.post("/login", data={"password": "wrong", "csrf": _csrf(login.text)})
        assert r.status_code == 401
        r = c.post("/login", data={"password": cluster["panel"].admin_password, "csrf": _csrf(login.text)})
        assert r.status_code == 303
        cookie = r.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=lax" in cookie.replace("SameSite=Lax", "SameSite=lax")
        assert c.get("/nodes").status_code == 200
        # logged in, a POST still needs the session's token
        assert c.post("/settings/keys", data={"name": "x", "csrf": "forged"}).status_code == 403
        assert c.post("/ui/playground/stream", json={"model": "x", "message": "hi"}).status_code == 403
        # a tampered session cookie is no session
        raw = c.cookies.get("tandem_session")
        i = len(raw) - 10  # inside the signature, where every base64 character carries 6 bits
        c.cookies.set("tandem_session", raw[:i] + ("A" if raw[i] != "A" else "B") + raw[i + 1:])
        assert c.get("/nodes").status_code == 303


def test_node_failures_say_why(cluster, monkeypatch):
    from control_panel import ui

    async def go():
        wrong_key = await ui.probe(cluster["torch"].url, "tdm_wrong-key")
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            port = closed.getsockname()[1]
        refused = await ui.probe(f"http://127.0.0.1:{port}", TEST_KEY)
        with socket.socket() as silent:  # accepts connections, never answers
            silent.bind(("127.0.0.1", 0))
            silent.listen(8)
            monkeypatch.setattr(ui, "STATUS_TIMEOUT", 0.5)
            hung = await ui.probe(f"http://127.0.0.1:{silent.getsockname()[1]}", TEST_KEY)
        monkeypatch.setattr(ui, "PROTOCOL_VERSION", 99)
        other_protocol = await ui.probe(cluster["torch"].url, TEST_KEY)
        return wrong_key, refused, hung, other_protocol

    wrong_key, refused, hung, other_protocol = asyncio.run(go())
    assert wrong_key["health"] == "key_rejected"
    assert refused["health"] == "unreachable"
    assert hung["health"] == "timeout"
    assert other_protocol["health"] == "protocol" and "99" in other_protocol["detail"]


def test_browser_flow(cluster, browser):
    panel = cluster["panel"]
    context = browser.new_context(viewport={"width": 1400, "height": 900}, locale="en-US")
    page = context.new_page()
    page.set_default_timeout(60_000)
    try:
        # log in (a page asked for first sends the browser to /login and back)
        page.goto(panel.url + "/nodes")
        assert "/login" in page.url
        page.fill("input[name=password]", "not the password")
        page.click("form[action='/login'] button[type=submit]")
        assert page.locator("p.error").is_visible()
        page.fill("input[name=password]", panel.admin_password)
        page.click("form[action='/login'] button[type=submit]")
        page.wait_for_url(re.compile(r"/nodes$"))

        # both agents are listed with their live status, refreshed by htmx without a reload
        for name in ("torch-torch", "mlx-mlx"):
            row = page.locator(f"tr[data-node='{name}']")
            assert row.get_attribute("data-health") == "ok"
            assert "healthy" in row.inner_text()
        assert "torch" in page.locator("tr[data-node='torch-torch']").inner_text()
        assert "smollm2" in page.locator("tr[data-node='mlx-mlx']").inner_text().lower()
        with page.expect_response(lambda r: r.url.endswith("/nodes/table") and r.status == 200, timeout=15_000):
            pass
        page.evaluate("window.__stillHere = true")
        with page.expect_response(lambda r: r.url.endswith("/nodes/table") and r.status == 200, timeout=15_000):
            pass
        assert page.evaluate("window.__stillHere") is True  # the table refreshed in place
        assert page.locator("tr[data-node='torch-torch'] .gauge").count() == 1
        page.screenshot(path=SCREENSHOT, full_page=True)

        # adding a node that does not answer says why, on the form
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
        page.fill("input[name=url]", dead)
        page.click("form[action='/nodes'] button[type=submit]")
        assert "unreachable" in page.locator("p.error").inner_text()

        # create a pair through the form: a bad name is refused on the form, a good one is listed
        page.goto(panel.url + "/pairs")
        page.fill("input[name=name]", "ui-pair")
        page.select_option("select[name=prefill]", label="torch-torch (torch)")
        page.select_option("select[name=decode]", label="mlx-mlx (mlx)")
        page.fill("input[name=threshold]", "0")
        page.select_option("select[name=fallback]", "decode_alone")
        page.click("#pair-form button[type=submit]")
        page.wait_for_url(re.compile(r"/pairs$"))
        row = page.locator("tr[data-pair='ui-pair']")
        assert "torch-torch" in row.inner_text() and "mlx-mlx" in row.inner_text()
        page.fill("input[name=name]", "same-node")
        page.select_option("select[name=prefill]", label="torch-torch (torch)")
        page.select_option("select[name=decode]", label="torch-torch (torch)")
        page.click("#pair-form button[type=submit]")
        assert "must be different" in page.locator("#pair-error").inner_text()
        assert page.locator("select[name=prefill][aria-invalid=true]").count() == 1

        # chat in the playground: the answer streams in, with TTFT, tokens/s and bytes moved
        page.goto(panel.url + "/playground")
        page.select_option("#model", "ui-pair")
        page.fill("#message", "What is the capital of France?")
        page.fill("#max_tokens", "24")
        page.evaluate("""() => { window.__updates = 0;
            new MutationObserver(() => window.__updates++).observe(document.getElementById('answer'),
                {childList: true, characterData: true, subtree: true}); }""")
        page.click("#send")
        page.wait_for_function("document.getElementById('s-ttft').textContent.endsWith('ms')", timeout=120_000)
        answer = page.locator("#answer").inner_text()
        assert "Paris" in answer, answer
        assert page.evaluate("window.__updates") > 3  # many deltas, not one final blob
        assert page.locator("#s-route").inner_text().startswith("prefill → decode (pd)")
        assert float(page.locator("#s-tps").inner_text()) > 0
        assert re.match(r"[\d.]+ (KiB|MiB|GiB)$", page.locator("#s-bytes").inner_text())
        assert page.locator("#answer-error").is_hidden()
        if MORE_SCREENSHOTS:
            page.screenshot(path="/tmp/ui_playground.png", full_page=True)

        # the request is in the log, with its route and a TTFT bar
        page.goto(panel.url + "/requests")
        row = page.locator("#requests-table tbody tr").first
        text = row.inner_text()
        assert "ui-pair" in text and row.get_attribute("data-route") == "pd" and "prefill → decode" in text
        assert row.get_attribute("data-outcome") == "ok"
        assert page.locator("#ttft-chart rect.bar.pd").count() >= 1
        if MORE_SCREENSHOTS:
            page.screenshot(path="/tmp/ui_requests.png", full_page=True)

        # switch to Japanese: the UI and the Help page are translated
        page.select_option("#lang-select", "ja")
        page.wait_for_load_state()
        page.wait_for_function("document.documentElement.lang === 'ja'")
        assert "/requests" in page.url
        nav = page.locator("header nav").inner_text()
        for word in ("ノード", "ペア", "プレイグラウンド", "リクエスト", "ヘルプ", "設定"):
            assert word in nav, nav
        assert "プリフィル → デコード" in page.locator("#requests-table tbody tr").first.inner_text()
        page.click("header nav a[href='/help']")
        page.wait_for_url(re.compile(r"/help$"))
        help_text = page.locator("article.help").inner_text()
        assert "各マシンでエージェントを起動する" in help_text
        assert "クラスターキー" in help_text and "tandem agent key" in help_text
        assert "Start an agent" not in help_text
        if MORE_SCREENSHOTS:
            page.screenshot(path="/tmp/ui_help_ja.png", full_page=True)
        page.goto(panel.url + "/nodes")
        assert "正常" in page.locator("tr[data-node='mlx-mlx']").inner_text()

        # settings: a new API key is shown once and works on the OpenAI API
        page.goto(panel.url + "/settings")
        page.fill("form[action='/settings/keys'] input[name=name]", "browser")
        page.click("form[action='/settings/keys'] button[type=submit]")
        key = page.locator("#new-key").inner_text().strip()
        r = httpx.get(panel.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert r.status_code == 200 and "ui-pair" in {x["id"] for x in r.json()["data"]}
        page.goto(panel.url + "/settings")
        assert page.locator("#new-key").count() == 0 and key not in page.content()

        # log out: pages send the browser back to the login page
        page.click("form[action='/logout'] button[type=submit]")
        page.wait_for_url(re.compile(r"/login"))
        page.goto(panel.url + "/requests")
        assert "/login" in page.url and page.locator("html").get_attribute("lang") == "ja"
    finally:
        context.close()


# ---- in-process checks of what the real cluster cannot show cheaply ----------------------------

@pytest.fixture()
def local_panel(tmp_path):
    from fastapi.testclient import TestClient
    from sqlmodel import Session

    from control_panel.app import create_panel_app
    from control_panel.models import Node
    from control_panel.security import ensure_admin_password

    app = create_panel_app(tmp_path, TEST_KEY)
    password = ensure_admin_password(app.state.db)
    with Session(app.state.db) as s:
        s.add(Node(name="gpu", url="http://127.0.0.1:1", engine="torch", paired=True))
        s.add(Node(name="mac", url="http://127.0.0.1:2", engine="mlx", paired=True))
        s.commit()
    with TestClient(app, base_url="http://127.0.0.1") as c:
        r = c.post("/login", data={"password": password, "csrf": _csrf(c.get("/login").text)})
        assert r.status_code == 200 and "/nodes" in str(r.url)
        yield c


def test_contract_mismatch_is_named_on_the_pair_form(local_panel, monkeypatch):
    from control_panel import ui
    from engine_adapters.errors import ContractMismatch

    async def mismatch(*args, **kwargs):
        raise ContractMismatch(["weights", "tokenizer"], "the prefiller and the decoder do not run the same model")

    monkeypatch.setattr(ui, "create_pair", mismatch)
    page = local_panel.get("/pairs")
    ids = re.findall(r'<option value="(\d+)"', page.text)
    form = {"name": "p", "prefill": ids[0], "decode": ids[1], "threshold": "0", "fallback": "fail",
            "csrf": _csrf(page.text)}
    r = local_panel.post("/pairs", data=form)
    assert r.status_code == 400
    assert "their contracts differ in weights, tokenizer" in r.text
    assert 'name="prefill" aria-invalid="true"' in r.text
    local_panel.cookies.set("lang", "de")
    r = local_panel.post("/pairs", data=form)
    assert "Ihre Verträge unterscheiden sich in Gewichte, Tokenizer" in r.text
    local_panel.cookies.delete("lang")
    r = local_panel.post("/pairs", data={**form, "threshold": "-3"})
    assert r.status_code == 400 and re.search(r'name="threshold"[^>]*value="-3" aria-invalid="true"', r.text)


def test_language_comes_from_cookie_then_accept_language(local_panel):
    assert '<html lang="fr">' in local_panel.get("/help", headers={"Accept-Language": "fr-CA,fr;q=0.9"}).text
    assert '<html lang="zh-TW">' in local_panel.get("/help", headers={"Accept-Language": "zh-Hant"}).text
    assert '<html lang="en">' in local_panel.get("/help", headers={"Accept-Language": "sv"}).text
    page = local_panel.get("/settings")
    r = local_panel.post("/lang", data={"lang": "ko", "csrf": _csrf(page.text), "next": "//evil.example/"})
    assert r.status_code == 200 and str(r.url).endswith("/nodes")  # no open redirect
    assert '<html lang="ko">' in local_panel.get("/help", headers={"Accept-Language": "fr"}).text
    assert "노드" in local_panel.get("/nodes").text
