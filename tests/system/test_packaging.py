"""A wheel of Tandem carries the panel's templates, catalogs, static files and migrations, and the
panel runs from it (not only from this checkout)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import control_panel, pathlib, sys
from fastapi.testclient import TestClient
from control_panel.app import create_panel_app
app = create_panel_app(pathlib.Path(sys.argv[1]))
with TestClient(app, base_url="http://127.0.0.1") as c:
    page = c.get("/login", headers={"Accept-Language": "ja"})
    assert page.status_code == 200 and "ログイン" in page.text, page.text[:500]
    assert c.get("/static/htmx.min.js").status_code == 200
print("ok", control_panel.__file__)
"""


def test_the_panel_runs_from_a_wheel(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            tmp_path / "dist",
            ROOT,
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    wheel = next((tmp_path / "dist").glob("tandem-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for needed in (
        "control_panel/templates/base.html",
        "control_panel/templates/help.html",
        "control_panel/locales/ja/LC_MESSAGES/messages.po",
        "control_panel/static/htmx.min.js",
        "control_panel/migrations/env.py",
    ):
        assert needed in names, needed
    target = tmp_path / "target"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target, wheel],
        check=True,
        capture_output=True,
        timeout=600,
    )
    out = subprocess.run(
        [sys.executable, "-c", CHECK, tmp_path / "data"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(target)},
        timeout=300,
    )
    assert out.returncode == 0 and out.stdout.startswith("ok " + str(target)), out.stdout + out.stderr
