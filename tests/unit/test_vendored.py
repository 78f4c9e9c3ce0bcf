"""Each vendored file is the one its note names (control_panel/static/VENDORED.md)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

STATIC = Path(__file__).resolve().parents[2] / "control_panel" / "static"


def test_vendored_files_match_their_sha256():
    rows = re.findall(r"^\| `([^`]+)` \|.*\| `([0-9a-f]{64})` \|$", (STATIC / "VENDORED.md").read_text(), re.M)
    assert [name for name, _ in rows] == ["htmx.min.js"]
    for name, sha256 in rows:
        assert hashlib.sha256((STATIC / name).read_bytes()).hexdigest() == sha256, name


def test_htmx_version_is_the_noted_one():
    note = (STATIC / "VENDORED.md").read_text()
    version = re.search(r'version:"([0-9.]+)"', (STATIC / "htmx.min.js").read_text())[1]
    assert f"htmx {version} " in note and f"htmx.org@{version}`" in note
