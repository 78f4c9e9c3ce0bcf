"""The `tandem` command as a user runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from engine_adapters.settings import EngineSettings
from tandem_protocol.settings import TandemSettings, env_table

from ..conftest import make_tiny_checkpoint

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


REPO = Path(__file__).resolve().parents[2]


def test_every_variable_is_documented_and_printed_by_the_doctor(tmp_path):
    """Each TANDEM_* variable the code names is in the README's table and in `tandem agent
    doctor`'s environment section, which shows the value in effect (and hides secrets)."""
    named = set()
    for path in REPO.glob("**/*.py"):
        if not path.relative_to(REPO).parts[0].startswith("."):
            named |= set(re.findall(r"\bTANDEM_[A-Z][A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    named |= {var for cls in (TandemSettings, EngineSettings) for var, _, _ in env_table(cls)}
    readme = (REPO / "README.md").read_text()
    table = set(re.findall(r"^\| `(TANDEM_[A-Z0-9_]+)` \|", readme, re.MULTILINE))
    assert table == named and len(table) == 25, sorted(table ^ named)
    env = {"TANDEM_HOME": str(tmp_path / "home"), "TANDEM_VLLM_THREADS": "3", "TANDEM_CLUSTER_KEY": "k" * 20}
    result = tandem("agent", "doctor", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {m.group(1): m.group(2) for m in re.finditer(r"(TANDEM_[A-Z0-9_]+)\s*│\s*(\S+)", result.stdout)}
    assert set(rows) == table, sorted(set(rows) ^ table)
    assert rows["TANDEM_VLLM_THREADS"] == "3" and rows["TANDEM_SGLANG_ROLE"] == "prefill"
    assert rows["TANDEM_CLUSTER_KEY"] == "(set)" and "k" * 20 not in result.stdout
    assert rows["TANDEM_HOME"] == str(tmp_path / "home")


def test_a_bad_setting_is_refused_at_start(tmp_path):
    result = tandem("agent", "doctor", env={"TANDEM_HOME": str(tmp_path), "TANDEM_SGLANG_ROLE": "both"})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "bad environment variable: TANDEM_SGLANG_ROLE='both': Input should be" in result.stderr


def test_the_cluster_key_is_set_from_standard_input_never_an_argument(tmp_path):
    """Issue 22: a command line is there for every local user to read (`ps`)."""
    env = {"TANDEM_HOME": str(tmp_path / "home")}
    key = "tdm_" + "q" * 30
    r = subprocess.run(
        [TANDEM, "agent", "key", "--set"], input=key + "\n", capture_output=True, text=True, env={**os.environ, **env}
    )
    assert r.returncode == 0 and r.stdout.strip() == key, r.stdout + r.stderr
    path = tmp_path / "home" / "cluster-key"
    assert path.read_text().strip() == key and oct(path.stat().st_mode & 0o777) == "0o600"
    assert oct((tmp_path / "home").stat().st_mode & 0o777) == "0o700"
    assert tandem("agent", "key", "--set", key, env=env).returncode != 0  # no value on the command line
    short = subprocess.run(
        [TANDEM, "agent", "key", "--set"], input="short\n", capture_output=True, text=True, env={**os.environ, **env}
    )
    assert short.returncode != 0 and "16 characters" in short.stdout + short.stderr


def test_the_cluster_key_rotates_to_a_new_random_one(tmp_path):
    """`tandem agent key --rotate`: a key that may have leaked is replaced, privately, and printed
    once (alone on stdout) with what to do next; a key from the environment is not rotated here."""
    env = {"TANDEM_HOME": str(tmp_path / "home")}
    old = tandem("agent", "key", env=env).stdout.strip()
    r = tandem("agent", "key", "--rotate", env=env)
    new = r.stdout.strip()
    assert r.returncode == 0 and new.startswith("tdm_") and len(new) >= 40 and new != old, r.stdout + r.stderr
    assert "restart this machine's agents" in r.stderr
    path = tmp_path / "home" / "cluster-key"
    assert path.read_text().strip() == new and oct(path.stat().st_mode & 0o777) == "0o600"
    assert tandem("agent", "key", env=env).stdout.strip() == new
    from_env = tandem("agent", "key", "--rotate", env={**env, "TANDEM_CLUSTER_KEY": "tdm_" + "e" * 30})
    assert from_env.returncode != 0 and "TANDEM_CLUSTER_KEY" in from_env.stdout + from_env.stderr
    assert path.read_text().strip() == new
