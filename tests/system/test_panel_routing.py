"""Routing behaviour of the panel: client disconnects, fallback when P is down, the request log,
migrations and restarts."""

from __future__ import annotations

import http.client
import time

import httpx
import openai
import pytest
import sqlalchemy as sa
from sqlmodel import Session, select

from control_panel.db import open_db
from control_panel.models import Pool, RequestLog

from ..agents import AgentProcess, PanelProcess, log_rows, settle, side_by_side
from ..panel_db import insert_old_pair


@pytest.fixture(scope="module")
def cluster(smol_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("routing")
    with side_by_side(
        # one compute thread each: OpenMP threads spin-waiting on a busy core slow every forward pass
        lambda: AgentProcess("torch", smol_dir, home / "p", env={"OMP_NUM_THREADS": "1"}),
        lambda: AgentProcess("torch", smol_dir, home / "d", env={"OMP_NUM_THREADS": "1"}),
    ) as (p, d):
        with PanelProcess(
            home, "--pair", f"pd={p.url},{d.url},threshold=1", "--pair", f"pdz={p.url},{d.url},zstd,threshold=1"
        ) as panel:
            yield {
                "p": p,
                "d": d,
                "panel": panel,
                "home": home,
                "client": openai.OpenAI(base_url=panel.url + "/v1", api_key=panel.api_key, max_retries=0),
            }


def test_a_connection_idle_past_the_sdks_expiry_still_takes_a_request(cluster):
    """OpenAI's SDK keeps an idle connection 5 s (httpx's keepalive_expiry) and then sends on it:
    a panel that closed its side after uvicorn's default 5 s raced that request, which failed with
    "Server disconnected without sending a response" (a test of the directions met it). The panel
    keeps an idle connection 75 s, as the agents do: one idle 6 s still takes the next request."""
    panel = cluster["panel"]
    url = httpx.URL(panel.url)
    conn = http.client.HTTPConnection(url.host, url.port, timeout=30)
    headers = {"Authorization": f"Bearer {panel.api_key}"}
    try:
        for idle in (6, 0):  # past the SDK's 5 s, then the next request on the same connection
            conn.request("GET", "/v1/models", headers=headers)
            r = conn.getresponse()
            assert r.status == 200 and r.read()
            time.sleep(idle)
    finally:
        conn.close()


@pytest.mark.parametrize("n", [1, 2])
def test_client_disconnect_aborts_both_roles(cluster, n):
    """A client gone mid-stream: every choice's roles stop and release, and each is logged."""
    before = len(log_rows(cluster["home"]))
    stream = cluster["client"].chat.completions.create(
        model="pd",
        stream=True,
        n=n,
        max_tokens=500,
        temperature=0,
        messages=[{"role": "user", "content": "Write a very long story about a lighthouse."}],
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    settle(cluster["p"], cluster["d"])
    deadline = time.monotonic() + 60  # a deadline, not a figure: a loaded machine writes late
    while time.monotonic() < deadline:  # each choice's row is written as running, then as it ended
        if all(r.outcome != "running" for r in log_rows(cluster["home"])[before:]):
            break
        time.sleep(0.1)
    rows = log_rows(cluster["home"])[before:]
    assert len(rows) == n, rows
    for row in rows:
        assert row.route == "pd" and row.outcome == "cancelled" and row.output_tokens < 500, row


def test_a_pair_with_compressed_pages_answers_the_same_with_fewer_bytes(cluster):
    ask = dict(
        messages=[{"role": "user", "content": "Name three rivers in Europe and say where each starts."}],
        max_tokens=12,
        temperature=0,
    )
    texts = [
        cluster["client"].chat.completions.create(model=m, **ask).choices[0].message.content for m in ("pd", "pdz")
    ]
    assert texts[0] == texts[1] and texts[0]
    rows = {r.model: r for r in log_rows(cluster["home"])[-2:]}
    assert rows["pd"].route == rows["pdz"].route == "pd"
    assert 0 < rows["pdz"].bytes_moved < 0.95 * rows["pd"].bytes_moved, (
        rows["pdz"].bytes_moved,
        rows["pd"].bytes_moved,
    )


def test_a_pair_reconfigured_behind_the_panels_back_still_goes_p_to_d(cluster, smol_dir):
    """Both nodes get a new context length (so a new contract) without the panel knowing: the
    panel remembers nothing of D's contract (D sends P its own, live), and the request still
    goes P -> D."""
    client, p, d = cluster["client"], cluster["p"], cluster["d"]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    first = client.chat.completions.create(model="pd", messages=messages, max_tokens=8, temperature=0)
    for agent in (p, d):
        with agent.client() as c:
            r = c.post("/v1/config", json={"engine": "torch", "model_path": str(smol_dir), "context_length": 4096})
            assert r.status_code == 200, r.text
    again = client.chat.completions.create(model="pd", messages=messages, max_tokens=8, temperature=0)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert log_rows(cluster["home"])[-1].route == "pd"
    settle(p, d)


def test_pair_with_prefiller_down_answers_through_decoder(cluster):
    client = cluster["client"]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    before = client.chat.completions.create(model="pd", messages=messages, max_tokens=20, temperature=0)
    assert log_rows(cluster["home"])[-1].route == "pd"
    cluster["p"].stop()
    after = client.chat.completions.create(model="pd", messages=messages, max_tokens=20, temperature=0)
    assert after.choices[0].message.content == before.choices[0].message.content
    row = log_rows(cluster["home"])[-1]
    assert row.route == "decode_alone" and "prefiller unreachable" in row.reason and row.outcome == "ok"
    settle(cluster["d"])


def test_first_migration_upgrades_and_data_survive_restart(tmp_path):
    db = tmp_path / "panel.db"
    engine = open_db(db, "0001")
    assert "requestlog" not in sa.inspect(engine).get_table_names()
    insert_old_pair(engine)
    engine.dispose()
    engine = open_db(db)  # what a newer panel does on start
    with Session(engine) as s:
        pool = s.exec(select(Pool)).one()
        assert (pool.name, pool.fallback, pool.local_threshold, pool.page_encoding) == ("old", "decode_alone", 0, "raw")
        s.add(RequestLog(model="old", route="pd"))
        s.commit()
    engine.dispose()
    with Session(open_db(db)) as s:  # a restart keeps everything
        assert s.exec(select(RequestLog)).one().model == "old"
        assert s.exec(select(Pool)).one().name == "old"


def test_reset_admin_password_beside_the_running_panel(tmp_path):
    """The password is printed once; `tandem panel --reset-admin-password` run while the panel
    serves writes a new one and exits (no port taken): the running panel's next login takes the
    new password, not the old. A second panel on the taken port says so, no traceback."""
    import os
    import subprocess

    import httpx

    from control_panel.security import check_admin_password

    from ..agents import TANDEM
    from .test_security import log_in

    env = {**os.environ, "TANDEM_HOME": str(tmp_path), "TANDEM_CLUSTER_KEY": "tdm_reset-test-key", "COLUMNS": "300"}

    def tandem_panel(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([TANDEM, "panel", *args], capture_output=True, text=True, env=env, timeout=120)

    with PanelProcess(tmp_path) as first:
        assert first.admin_password
    with PanelProcess(tmp_path) as running:
        assert running.admin_password is None  # stored hashed: never shown again
        reset = tandem_panel("--reset-admin-password")
        assert reset.returncode == 0, reset.stdout + reset.stderr
        new = reset.stdout.split("(shown once, stored hashed): ", 1)[1].split()[0]
        assert new != first.admin_password
        with httpx.Client(base_url=running.url, follow_redirects=False) as ui:
            assert log_in(ui, first.admin_password).status_code == 401
            assert log_in(ui, new).status_code == 303
        taken = tandem_panel("--port", running.url.rsplit(":", 1)[1])
        assert taken.returncode == 1 and "is in use: is the panel already running?" in taken.stdout, taken
        assert "Traceback" not in taken.stdout + taken.stderr
    engine = open_db(tmp_path / "panel" / "panel.db")
    assert check_admin_password(engine, new) and not check_admin_password(engine, first.admin_password)
