"""The panel's web UI in a real browser (Debian's Chromium through Playwright), on real agents."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tandem_protocol.tls import spaced

from ..agents import TEST_KEY, AgentProcess, PanelProcess, side_by_side
from ..conftest import make_tiny_checkpoint
from ..netns import host_namespace, netns_available
from ..prerequisites import missing

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
SCREENSHOT = "/tmp/ui_nodes.png"
MORE_SCREENSHOTS = os.environ.get("TANDEM_UI_SCREENSHOTS")  # set it to also save the other pages in /tmp

try:
    import playwright.sync_api as playwright_api
except ImportError:  # the browser test says so (tests/prerequisites.py)
    playwright_api = None


@pytest.fixture(scope="module")
def cluster(smol_dir, tmp_path_factory):
    if not netns_available():
        missing("the panel's cluster runs in a network namespace: needs root and iproute2")
    home = tmp_path_factory.mktemp("panel_ui")
    models = home / "models"  # a model root on both nodes with another model in it, for the pair form
    make_tiny_checkpoint(models / "tiny-qwen3", "qwen3", smol_dir)
    roots = ("--model-root", str(models))
    # one test host (a namespace): the agents announce themselves by mDNS inside it and the panel,
    # also inside, finds them; the browser and the test reach everything over the host's veth
    with host_namespace() as host:
        mdns = ("--mdns", "--mdns-interface", host.mdns_addr)
        # two serve HTTPS, as agents do by default; one plain HTTP (--insecure-http), which the UI marks
        with side_by_side(
            lambda: AgentProcess(
                "torch", smol_dir, home / "torch", *roots, *mdns, host=host.addr, netns=host.ns, tls=True
            ),
            lambda: AgentProcess("mlx", smol_dir, home / "mlx", *roots, *mdns, host=host.addr, netns=host.ns, tls=True),
            lambda: AgentProcess("mlx", smol_dir, home / "mlx2", *mdns, host=host.addr, netns=host.ns),
        ) as (t, m, m2):
            with PanelProcess(home / "panel", "--host", host.addr, *mdns, netns=host.ns) as panel:
                yield {"panel": panel, "torch": t, "mlx": m, "mlx2": m2}


def pair_discovered(panel) -> None:
    """Pair every node the panel found by mDNS (what the browser test does by hand)."""
    with logged_in(panel) as c:
        page = c.get("/nodes")
        for node_id in re.findall(r'href="/nodes/(\d+)/pair"', page.text):
            r = c.post(
                f"/nodes/{node_id}/pair", data={"key": TEST_KEY, "csrf": _csrf(c.get(f"/nodes/{node_id}/pair").text)}
            )
            assert r.status_code == 303, r.text[-1500:]


@pytest.fixture(scope="module")
def browser():
    if playwright_api is None:
        missing("the browser test drives Chromium through playwright: pip install -e '.[test]'")
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
        for path in ("/", "/nodes", "/models", "/playground", "/requests", "/help", "/settings"):
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
        c.cookies.set("tandem_session", raw[:i] + ("A" if raw[i] != "A" else "B") + raw[i + 1 :])
        assert c.get("/nodes").status_code == 303


def test_node_failures_say_why(cluster, monkeypatch):
    from control_panel import pins
    from control_panel.ui import node_status as ui

    pins.pin(cluster["torch"].url, cluster["torch"].fingerprint)  # as the panel pinned it at pairing

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
    refused = []  # what the panel's CSP blocked: nothing may be (every script is a file of its own)
    page.on("console", lambda m: "Content Security Policy" in m.text and refused.append(m.text))
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

        # both agents appear by themselves (found by mDNS) under "Found on the local network", not
        # paired: the panel has sent them nothing
        for name in ("torch-torch", "mlx-mlx"):
            row = page.locator(f"#discovered tr[data-node='{name}'][data-source='mdns']")
            row.wait_for(timeout=30_000)  # the section refreshes every 3 s
            page.wait_for_selector(f"#discovered tr[data-node='{name}'][data-announcing='yes']")
            assert "announcing" in row.inner_text()
        assert page.locator("#nodes-table").count() == 0  # nothing paired yet
        # pairing shows the certificate the agent presents, as `tandem agent key` prints it on its
        # machine, and asks for the cluster key; a wrong one is refused and says why
        page.click("a[data-pair-node='torch-torch']")
        assert page.locator("#pair-node-fingerprint").inner_text() == spaced(cluster["torch"].fingerprint)
        page.fill("input[name=key]", "tdm_not-the-cluster-key")
        page.click("#pair-node-form button[type=submit]")
        assert "differs from the panel's cluster key" in page.locator("#pair-node-error").inner_text()
        page.fill("input[name=key]", TEST_KEY)
        page.click("#pair-node-form button[type=submit]")
        page.wait_for_url(re.compile(r"/nodes$"))
        # paired, torch-torch moves to the nodes table; mlx-mlx still waits below
        page.wait_for_selector("#nodes-table tr[data-node='torch-torch'][data-health='ok']")
        assert page.locator("#discovered tr[data-node='torch-torch']").count() == 0
        assert page.locator("#discovered tr[data-node='mlx-mlx']").count() == 1
        page.screenshot(path=SCREENSHOT, full_page=True)
        for name in ("mlx-mlx", "mlx-mlx2"):
            page.click(f"a[data-pair-node='{name}']")
            page.fill("input[name=key]", TEST_KEY)
            page.click("#pair-node-form button[type=submit]")
            page.wait_for_url(re.compile(r"/nodes$"))
        assert page.locator("#discovered-none").is_visible()  # no agent left to pair: it says so
        # the plain-HTTP node is marked, the HTTPS ones are not
        page.wait_for_selector("tr[data-node='mlx-mlx2'] [data-plain-http]")
        assert page.locator("tr[data-node='torch-torch'] [data-plain-http]").count() == 0

        # both agents are listed with their live status, refreshed by htmx without a reload
        for name in ("torch-torch", "mlx-mlx"):
            row = page.locator(f"tr[data-node='{name}']")
            page.wait_for_selector(f"tr[data-node='{name}'][data-health='ok']")
            assert "healthy" in row.inner_text()
        assert "torch" in page.locator("tr[data-node='torch-torch']").inner_text()
        assert "smollm2" in page.locator("tr[data-node='mlx-mlx']").inner_text().lower()
        with page.expect_response(lambda r: r.url.endswith("/nodes/table") and r.status == 200, timeout=15_000):
            pass
        page.evaluate("window.__stillHere = true")
        with page.expect_response(lambda r: r.url.endswith("/nodes/table") and r.status == 200, timeout=15_000):
            pass
        assert page.evaluate("window.__stillHere") is True  # the table refreshed in place
        for column in ("staging", "decoding", "prefix-cache"):  # the staging budget's, the decoder's KV, the cache's
            assert page.locator(f"tr[data-node='torch-torch'] td.{column} .gauge").count() == 1

        # adding a node that does not answer says why, on the form
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
        page.fill("input[name=url]", dead)
        page.click("form[action='/nodes'] button[type=submit]")
        assert "unreachable" in page.locator("p.error").inner_text()

        # create a model from a pair through the form: a bad name is refused on the form, a good
        # one is listed
        page.goto(panel.url + "/models")
        page.fill("input[name=name]", "ui-pair")
        page.select_option("select[name=prefill]", label="torch-torch (torch)")
        page.select_option("select[name=decode]", label="mlx-mlx (mlx)")
        page.fill("input[name=threshold]", "0")
        page.select_option("select[name=fallback]", "decode_alone")
        page.click("#model-form button[type=submit]")
        page.wait_for_url(re.compile(r"/models$"))
        row = page.locator("tr[data-model='ui-pair']")
        assert "torch-torch" in row.inner_text() and "mlx-mlx" in row.inner_text()
        page.fill("input[name=name]", "same-node")
        page.select_option("select[name=prefill]", label="torch-torch (torch)")
        page.select_option("select[name=decode]", label="torch-torch (torch)")
        page.click("#model-form button[type=submit]")
        assert "must be different" in page.locator("#model-error").inner_text()
        assert page.locator("select[name=prefill][aria-invalid=true]").count() == 1

        # a third node joins the model as a second decoder: a three-node pool
        page.goto(panel.url + "/models")
        row = page.locator("tr[data-model='ui-pair']")
        row.locator("details summary").click()
        form = row.locator("form.member-form")
        form.locator("select[name=node]").select_option(label="mlx-mlx2 (mlx)")
        form.locator("select[name=role]").select_option("decode")
        form.locator("button[type=submit]").click()
        page.wait_for_selector("tr[data-model='ui-pair'] tr[data-member='mlx-mlx2:decode']")  # back on /models
        members = page.locator("tr[data-model='ui-pair'] tr[data-member]")
        roles = sorted(members.nth(i).get_attribute("data-member") for i in range(members.count()))
        assert roles == ["mlx-mlx2:decode", "mlx-mlx:decode", "torch-torch:prefill"], roles
        assert "mlx · " in members.filter(has_text="mlx-mlx2").inner_text()
        if MORE_SCREENSHOTS:
            page.screenshot(path="/tmp/ui_models.png", full_page=True)
        # and leaves it: the pair is left, serving as before
        page.locator("tr[data-member='mlx-mlx2:decode'] button[type=submit]").click()
        page.wait_for_selector("tr[data-member='mlx-mlx2:decode']", state="detached")
        members = page.locator("tr[data-model='ui-pair'] tr[data-member]")
        roles = sorted(members.nth(i).get_attribute("data-member") for i in range(members.count()))
        assert roles == ["mlx-mlx:decode", "torch-torch:prefill"], roles

        # chat in the playground: the answer streams in, with TTFT, tokens/s and bytes moved
        page.goto(panel.url + "/playground")
        page.select_option("#model", "ui-pair")
        page.fill("#message", "What is the capital of France?")
        page.fill("#max_tokens", "24")
        page.evaluate("""() => { window.__updates = 0;
            new MutationObserver(() => window.__updates++).observe(document.getElementById('answer'),
                {childList: true, characterData: true, subtree: true}); }""")
        page.click("#send")
        # (a locator waits; wait_for_function would evaluate a string in the page, which its CSP forbids)
        page.locator("#s-ttft", has_text=re.compile(r"ms$")).wait_for(timeout=120_000)
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
        page.locator("html[lang='ja']").wait_for(state="attached")
        assert "/requests" in page.url
        nav = page.locator("header nav").inner_text()
        for word in ("ノード", "モデル", "プレイグラウンド", "リクエスト", "ヘルプ", "設定"):
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
        assert not refused, refused
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


@contextmanager
def logged_in(panel) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=panel.url, timeout=300) as c:
        r = c.post("/login", data={"password": panel.admin_password, "csrf": _csrf(c.get("/login").text)})
        assert r.status_code == 303
        yield c


def test_pair_form_checks_engines_model_paths_and_contracts(cluster, tmp_path):
    """Everything on real agents: a path outside the roots and a model whose contract differs are
    refused on the form, naming the field, before any node loads anything; an engine switch works."""
    t, m = cluster["torch"], cluster["mlx"]
    pair_discovered(cluster["panel"])  # nothing to do when the browser test paired them already
    with logged_in(cluster["panel"]) as c:
        page = c.get("/models")
        assert str(t.status()["model_path"]) in page.text  # the model-path suggestions come from the nodes
        ids = dict((name, i) for i, name in re.findall(r'<option value="(\d+)" [^>]*>([\w-]+) \(', page.text))
        form = {
            "name": "checked",
            "prefill": ids["torch-torch"],
            "decode": ids["mlx-mlx"],
            "threshold": "0",
            "fallback": "fail",
            "csrf": _csrf(page.text),
        }
        r = c.post("/models", data={**form, "decode_model_path": str(tmp_path)})
        assert r.status_code == 400 and "decode node:" in r.text and "outside this node&#39;s model roots" in r.text
        assert re.search(r'name="decode_model_path"[^>]*aria-invalid="true"', r.text)
        tiny = str(Path(m.status()["model_roots"][-1]) / "tiny-qwen3")
        r = c.post("/models", data={**form, "decode_model_path": tiny})
        assert r.status_code == 400
        assert "their contracts differ in weights, model config, context length" in r.text
        assert 'name="prefill" aria-invalid="true"' in r.text
        assert m.status()["model"] != "tiny-qwen3"  # refused before anything loaded
        c.cookies.set("lang", "de")
        r = c.post("/models", data={**form, "decode_model_path": tiny})
        assert "Ihre Verträge unterscheiden sich in Gewichte, Modellkonfiguration, Kontextlänge" in r.text
        c.cookies.delete("lang")
        r = c.post("/models", data={**form, "context_length": "0"})
        assert r.status_code == 400 and re.search(r'name="context_length"[^>]*aria-invalid="true"', r.text)
        r = c.post("/models", data={**form, "decode_kv_mib": "0"})
        assert r.status_code == 400 and re.search(r'name="decode_kv_mib"[^>]*aria-invalid="true"', r.text)
        r = c.post("/models", data={**form, "threshold": "-3"})
        assert r.status_code == 400 and re.search(r'name="threshold"[^>]*value="-3" aria-invalid="true"', r.text)
        # a real switch: the mlx node decodes with torch for this pair, with a 64 MiB staging budget
        # on P and a 256 MiB KV budget on D (P's own KV budget stays as it was)
        p_kv = t.status()["decode"]["kv_capacity"]
        r = c.post("/models", data={**form, "decode_engine": "torch", "staging_mib": "64", "decode_kv_mib": "256"})
        assert r.status_code == 303, r.text[-2000:]
        assert m.status()["engine"] == "torch" and t.status()["budget"]["capacity"] == 64 << 20
        assert m.status()["decode"]["kv_capacity"] == 256 << 20 and t.status()["decode"]["kv_capacity"] == p_kv
        back = {**form, "decode_engine": "mlx", "staging_mib": "512", "replace": "1"}  # and back: the model set anew
        r = c.post("/models", data=back)
        assert r.status_code == 303 and m.status()["engine"] == "mlx"
        pair_id = re.search(r'data-model="checked">.*?/models/(\d+)/delete', c.get("/models").text, re.S).group(1)
        assert c.post(f"/models/{pair_id}/delete", data={"csrf": form["csrf"]}).status_code == 303


def test_language_comes_from_cookie_then_accept_language(local_panel):
    assert '<html lang="fr">' in local_panel.get("/help", headers={"Accept-Language": "fr-CA,fr;q=0.9"}).text
    assert '<html lang="zh-TW">' in local_panel.get("/help", headers={"Accept-Language": "zh-Hant"}).text
    assert '<html lang="en">' in local_panel.get("/help", headers={"Accept-Language": "sv"}).text
    page = local_panel.get("/settings")
    r = local_panel.post("/lang", data={"lang": "ko", "csrf": _csrf(page.text), "next": "//evil.example/"})
    assert r.status_code == 200 and str(r.url).endswith("/nodes")  # no open redirect
    assert '<html lang="ko">' in local_panel.get("/help", headers={"Accept-Language": "fr"}).text
    assert "노드" in local_panel.get("/nodes").text


def test_requests_page_shows_the_last_ttft_benchmark(local_panel, tmp_path):
    """The benchmark keeps its latest result in the panel's data dir; the Requests page shows it
    (here: a result the benchmark wrote, kept in bench/results)."""
    import json

    from control_panel.bench_results import LATEST_TTFT

    assert "tandem bench ttft" in local_panel.get("/requests").text  # how to get one
    result = json.loads((Path(__file__).parents[2] / "bench/results/ttft-shaped-zstd-20261130-082556.json").read_text())
    (tmp_path / LATEST_TTFT).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / LATEST_TTFT).write_text(json.dumps(result))
    page = local_panel.get("/requests").text
    section = page[page.index('id="bench-ttft"') :]
    cell = next(c for c in result["cells"] if c["column"] == "a-torch->b-mlx+zstd" and c["tokens"] == 744)
    assert "a-torch-&gt;b-mlx+zstd" in section and f"{cell['ttft']['median'] * 1000:.0f} ms" in section
    assert (
        f"{cell['ttft_over_bound']:.2f}" in section
        and f"{cell['ttft_minus_own_prefill']['median'] * 1000:+.1f} ms" in section
    )
    (tmp_path / LATEST_TTFT).write_text("{not json")
    assert "tandem bench ttft" in local_panel.get("/requests").text  # a broken file is not an error


def seed_old_nodes(db) -> None:
    """What a panel keeps from an earlier run: two nodes whose agents are gone, paired as
    `old-pair`, and an agent it found on the network and nobody paired."""
    from sqlmodel import Session

    from control_panel.models import Node, Pool, PoolMember

    with Session(db) as s:
        gpu = Node(name="old-gpu", url="http://127.0.0.1:11", engine="torch", paired=True)
        mac = Node(name="old-mac", url="http://127.0.0.1:12", engine="mlx", paired=True)
        found = Node(name="found-agent", url="http://127.0.0.1:13", engine="mlx", source="mdns", paired=False)
        s.add_all([gpu, mac, found])
        s.commit()
        pool = Pool(name="old-pair", context_length=64)
        s.add(pool)
        s.flush()
        for node, role, engine in ((gpu, "prefill", "torch"), (mac, "decode", "mlx")):
            s.add(PoolMember(pool_id=pool.id, node_id=node.id, role=role, engine=engine, model_path="m"))
        s.commit()


def test_browser_removes_a_node_from_the_panel_and_its_models(browser, tmp_path):
    """A node whose agent is gone is removed from the Nodes page: the confirmation names the model
    it serves in, dismissing it keeps everything, confirming removes the node; a model that keeps
    its decode node stays (it serves on the decoder alone), one that loses it goes (from the
    Models page and the API's model list); an unpaired node found on the network is removed too."""
    from control_panel.db import open_db

    db = open_db(tmp_path / "panel" / "panel.db")
    seed_old_nodes(db)
    db.dispose()
    with PanelProcess(tmp_path) as panel:
        context = browser.new_context(viewport={"width": 1400, "height": 900}, locale="en-US")
        page = context.new_page()
        page.set_default_timeout(60_000)
        dialogs: list[str] = []
        try:
            page.goto(panel.url + "/login")
            page.fill("input[name=password]", panel.admin_password)
            page.click("form[action='/login'] button[type=submit]")
            page.wait_for_url(re.compile(r"/nodes$"))
            page.wait_for_selector("#nodes-table tr[data-node='old-gpu'][data-health='unreachable']")
            # the unpaired agent is in its own section; without mDNS the panel cannot say if it announces
            assert page.locator("#discovered tr[data-node='found-agent'] a[data-pair-node]").count() == 1
            assert page.locator("#nodes-table tr[data-node='found-agent']").count() == 0

            page.once("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
            page.click("button[data-remove-node='old-gpu']")
            assert dialogs[-1] == (
                "Remove old-gpu from the panel? The agent itself keeps running. "
                "It leaves these models, and a model left without a decode node is removed: old-pair"
            )
            page.goto(panel.url + "/nodes")  # dismissed: nothing was removed
            page.wait_for_selector("#nodes-table tr[data-node='old-gpu']")

            page.once("dialog", lambda d: (dialogs.append(d.message), d.accept()))
            page.click("button[data-remove-node='old-gpu']")
            page.wait_for_selector("tr[data-node='old-gpu']", state="detached")
            page.wait_for_selector("#nodes-table tr[data-node='old-mac']")
            page.once("dialog", lambda d: (dialogs.append(d.message), d.accept()))
            page.click("button[data-remove-node='found-agent']")
            page.wait_for_selector("tr[data-node='found-agent']", state="detached")
            assert dialogs[-1] == "Remove found-agent from the panel? The agent itself keeps running."
            assert page.locator("#discovered").count() == 0  # no mDNS and nothing left to pair: no section
            if MORE_SCREENSHOTS:
                page.screenshot(path="/tmp/ui_nodes_removed.png", full_page=True)

            page.goto(panel.url + "/models")  # the model kept its decode node
            assert page.locator("tr[data-model='old-pair'] tr[data-member]").count() == 1
            r = httpx.get(panel.url + "/v1/models", headers={"Authorization": f"Bearer {panel.api_key}"}, timeout=30)
            assert sorted(m["id"] for m in r.json()["data"]) == ["node/old-mac", "old-pair"]
            page.goto(panel.url + "/nodes")
            page.once("dialog", lambda d: (dialogs.append(d.message), d.accept()))
            page.click("button[data-remove-node='old-mac']")  # its last decode node: the model goes
            page.wait_for_selector("tr[data-node='old-mac']", state="detached")
            page.goto(panel.url + "/models")
            assert page.locator("tr[data-model='old-pair']").count() == 0
            r = httpx.get(panel.url + "/v1/models", headers={"Authorization": f"Bearer {panel.api_key}"}, timeout=30)
            assert r.json()["data"] == []
        finally:
            context.close()


def test_removing_a_node_needs_the_csrf_token_and_is_idempotent(local_panel):
    from control_panel.services import model_names

    db = local_panel.app.state.db
    seed_old_nodes(db)
    page = local_panel.get("/nodes").text
    # old-mac is old-pair's only decode node: removing it removes the model
    node_id = re.search(r'action="/nodes/(\d+)/delete"[^>]*\n[^\n]*old-pair(?:(?!</form>).)*"old-mac"', page, re.S)
    node_id = node_id.group(1)
    assert local_panel.post(f"/nodes/{node_id}/delete", data={"csrf": "forged"}).status_code == 403
    assert "old-pair" in model_names(db)
    r = local_panel.post(f"/nodes/{node_id}/delete", data={"csrf": _csrf(page)})
    assert r.status_code == 200 and str(r.url).endswith("/nodes")
    assert "old-pair" not in model_names(db) and "node/old-mac" not in model_names(db)
    assert "node/old-gpu" in model_names(db)
    r = local_panel.post(f"/nodes/{node_id}/delete", data={"csrf": _csrf(page)})  # a second click
    assert r.status_code == 200 and str(r.url).endswith("/nodes")
