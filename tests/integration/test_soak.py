"""The soak run (bench/soak.py) in its short form against the cluster's panel: mixed, cancelled and
disconnected requests on a pair of each engine family, then every agent idle, no request-log row
left running, each agent's RSS and its engine server's grown < 10 %, and each server engine's
pool empty."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ..agents import TEST_KEY
from ..conftest import write_report
from .cluster import pair_name

ROOT = Path(__file__).resolve().parents[2]


def run_soak(out: Path, *args: str, env: dict[str, str] | None = None) -> dict:
    """bench/soak.py with `args`, its JSON written to `out`: it exits 0 (every goal met), each way
    of ending a request happened, nothing leaked and no process's RSS grew 10%. Returns the JSON."""
    env = {
        **os.environ,
        **(env or {}),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
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


SOAK_PAIRS = [
    ("torch", "mlx"),
    ("mlx", "torch"),
    ("vllm", "vllm2"),
    ("torch", "vllm"),
    ("sglang", "sglang2"),
    ("torch", "sglang2"),
]


def test_a_short_soak_on_every_engine_leaves_nothing_behind(cluster, tmp_path):
    agents = sorted({name for pair in SOAK_PAIRS for name in pair})
    args = ["--panel", cluster.panel.url]
    # 20 s (4 s of warm-up): 61 requests alone, each way of ending one 15 times or more (was 40 s: 80 in lanes)
    args += ["--panel-db", str(cluster.panel_home / "panel" / "panel.db"), "--duration", "20"]
    args += [a for name in agents for a in ("--agent", cluster[name].url)]
    args += [a for p, d in SOAK_PAIRS for a in ("--model", pair_name(p, d))]
    keys = {"TANDEM_API_KEY": cluster.api_key, "TANDEM_CLUSTER_KEY": TEST_KEY}  # never on a command line
    result = run_soak(tmp_path / "soak.json", *args, env=keys)
    servers = {
        f"{cluster[name].status()['name']} engine" for name in agents if cluster[name].engine in ("vllm", "sglang")
    }
    assert servers <= set(result["rss"]), result["rss"]  # the engine servers' memory is watched too
    cluster.idle(*agents)
    write_report(
        "soak", {"requests": result["requests"], "total_requests": result["total_requests"], "rss": result["rss"]}
    )
