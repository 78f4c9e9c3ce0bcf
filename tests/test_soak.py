"""The soak run (bench/soak.py) in its short form: under a minute of mixed, cancelled and
disconnected requests through a torch<->MLX pair each way, then nothing held and no RSS growth."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_soak(out: Path, *args: str) -> dict:
    """bench/soak.py with `args`, its JSON written to `out`: it exits 0 (every goal met), each way
    of ending a request happened, nothing leaked and no process's RSS grew 10%. Returns the JSON."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "soak.py"), *args, "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    result = json.loads(out.read_text())
    for action in ("complete", "cancel", "disconnect"):
        assert sum(result["requests"][action].values()) > 0, result["requests"]
    assert result["leaks"] == [], result["held_after_settle"]
    for name, m in result["rss"].items():
        assert m["growth_percent"] < 10, (name, m)
    return result


@pytest.mark.slow
def test_a_short_soak_leaves_nothing_behind(smol_dir, tmp_path):
    result = run_soak(tmp_path / "soak.json", "--duration", "40")
    assert set(result["rss"]) == {"panel", "a-torch", "b-mlx"}
