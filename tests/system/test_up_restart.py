"""`tandem up` (what `make run` runs) stopped and started again, as a user does it: its agents get
new ports, and the panel follows them instead of keeping dead twins."""

from __future__ import annotations

import os
import re
import sqlite3
from pathlib import Path

import httpx

from tandem_cli.processes import ServiceProcess
from tandem_protocol.settings import data_dir

NAMES = ["node/decode-mlx", "node/prefill-torch", "smollm2", "smollm2-reverse"]


def _up(home: Path) -> tuple[ServiceProcess, str, str, tuple[str, str]]:
    up = ServiceProcess(["up", "--panel-port", "0", "--ask", "Hi"], env={"TANDEM_HOME": str(home), "COLUMNS": "300"})
    try:
        up.wait_for("Ctrl-C stops everything", timeout=600)
    except BaseException:
        up.stop()
        raise
    out = "".join(up.log)
    panel = re.search(r"Tandem is up\s+panel (\S+)", out).group(1)
    api_key = re.search(r"API key: (tsk_\S+)", out).group(1)
    agents = re.search(r"prefill agent (\S+) \(torch\) -> decode agent (\S+) \(mlx\)", out).groups()
    return up, panel, api_key, agents


def test_a_second_tandem_up_serves_each_model_once(smol_dir, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    os.symlink(data_dir() / "models", home / "models")  # the embedded model, already fetched
    up, _, _, first_agents = _up(home)
    up.stop()
    assert up.proc.returncode == 0, "".join(up.log)
    up, panel, api_key, agents = _up(home)
    try:
        assert "unchanged since the first start" in "".join(up.log)  # the password was issued once
        assert set(agents).isdisjoint(first_agents), (first_agents, agents)  # new ports: the case at hand
        with httpx.Client(base_url=panel, headers={"Authorization": f"Bearer {api_key}"}, timeout=120) as c:
            listed = [m["id"] for m in c.get("/v1/models").json()["data"]]
            assert sorted(listed) == NAMES
            for model in listed:
                r = c.post(
                    "/v1/completions", json={"model": model, "prompt": "The capital of France is", "max_tokens": 3}
                )
                assert r.status_code == 200, (model, r.text)
                assert r.json()["usage"]["completion_tokens"] == 3, (model, r.text)
        with sqlite3.connect(f"file:{home / 'panel' / 'panel.db'}?mode=ro", uri=True) as db:
            rows = sorted(db.execute("SELECT name, url FROM node"))
        assert rows == [("decode-mlx", agents[1]), ("prefill-torch", agents[0])]
    finally:
        up.stop()
