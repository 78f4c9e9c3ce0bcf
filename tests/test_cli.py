"""The `tandem` command as a user runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from .conftest import make_tiny_checkpoint

TANDEM = str(Path(sys.executable).with_name("tandem"))


def tandem(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [TANDEM, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )


def test_demo_streams_an_answer_through_torch_to_mlx(smol_dir):
    result = tandem("demo", "--prompt", "What is the capital of France?", "--max-tokens", "12")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Paris" in out
    assert "torch -> mlx (commit-first)" in out
    ttft = re.search(r"TTFT (\d+) ms", out)
    moved = re.search(r"moved (\d+) pages, ([\d,]+) bytes", out)
    assert ttft and moved, out
    assert int(moved.group(1)) == 1 and int(moved.group(2).replace(",", "")) == 88 + 1_474_560


def test_model_import_and_list(tmp_path, smol_dir):
    env = {"TANDEM_HOME": str(tmp_path / "home")}
    tiny = make_tiny_checkpoint(tmp_path / "tiny-qwen3", "qwen3", smol_dir)
    result = tandem("model", "import", str(tiny), "--context-length", "256", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "registered tiny-qwen3" in result.stdout
    listing = tandem("model", "list", env=env)
    assert "tiny-qwen3" in listing.stdout and "256" in listing.stdout


def test_model_import_refuses_unsupported(tmp_path, smol_dir):
    env = {"TANDEM_HOME": str(tmp_path / "home")}
    tiny = make_tiny_checkpoint(tmp_path / "sliding", "qwen2", smol_dir, use_sliding_window=True, sliding_window=32)
    result = tandem("model", "import", str(tiny), env=env)
    assert result.returncode == 1
    assert "sliding-window attention is not supported" in result.stdout
