"""A server engine's log tail goes into the agent's errors (a start that fails, a server that stops
answering), and from there to the panel and its log: no key of the server's may be in it (issue 43,
L14). SGLang 0.5.23 logs its arguments as it starts, its key among them: checked against the pinned
SGLang (tests/sglang_cpu/.venv), `python -c "from sglang.srt.server_args import prepare_server_args;
from sglang.srt.entrypoints.engine import _server_args_for_logging as f;
print(f(prepare_server_args(['--model-path', 'm', '--api-key=K'])))"` prints `…, 'api_key': 'K', …`,
and its launch command keeps `--api-key=K`. These tests start a stand-in server (a Python one-liner
that logs those lines and exits), not SGLang, which takes a minute to start."""

from __future__ import annotations

import sys

import pytest

from engine_adapters.server_process import LOG_TAIL_BYTES, LOG_TAIL_LINE, REDACTED, ServerProcess
from tandem_protocol.errors import TandemError

# SGLang's lines with its key (the dict entry as its engine logs it, the launch command, and the
# dataclass repr), then other forms of the option and a key that a traceback might print bare.
LOGGING = """
import os
key = os.environ["ENGINE_SERVER_KEY"]
print(f"[2026-12-06 10:00:00] server_args={{'model_path': '/models/smol', 'api_key': '{key}', 'admin_api_key': 'other-secret', 'port': 30000}}")
print(f"launch_command: python -m sglang.launch_server --model-path /models/smol --api-key={key}")
print(f"ServerArgs(model_path='/models/smol', api_key='{key}', port=30000)")
print("vllm serve /models/smol --api-key second-secret --admin-api-key=fourth-secret --port 8000")
print(f'{{"API_KEY": "third-secret"}} Authorization: Bearer {key}')
print("ValueError: the model at /models/smol has no config.json")
raise SystemExit(1)
"""


class StandIn(ServerProcess):
    engine = "sglang"

    def command(self) -> list[str]:
        return [sys.executable, "-c", LOGGING]


def test_a_failed_start_s_error_carries_the_log_tail_with_every_key_redacted(tmp_path):
    server = StandIn(tmp_path / "sglang.log", start_timeout=60)
    with pytest.raises(TandemError) as failed:
        server.start()
    error = str(failed.value)
    assert "sglang exited with code 1 while starting" in error
    secrets = [server.api_key, "other-secret", "second-secret", "third-secret", "fourth-secret"]
    assert not [secret for secret in secrets if secret in error], error
    # what the tail is read for is still there, the keys' names too
    assert "ValueError: the model at /models/smol has no config.json" in error
    assert f"'api_key': '{REDACTED}'" in error and f"--api-key={REDACTED}" in error, error
    assert f"api_key='{REDACTED}'" in error and f"--api-key {REDACTED}" in error, error
    assert f"Bearer {REDACTED}" in error and "'model_path': '/models/smol'" in error, error


def test_a_log_tail_is_read_from_the_log_s_end_its_lines_cut_and_a_key_s_end_left_out(tmp_path):
    """Only the log's last LOG_TAIL_BYTES are read (an access log grows to megabytes; a tail is read
    on the agent's event loop, server_engine.py's `_not_answering`), and its first line, read from
    its middle, is left out: it could begin with the end of a key, which no pattern knows. A line
    is cut (SGLang's arguments take several kilobytes)."""
    server = StandIn(tmp_path / "sglang.log", start_timeout=60)
    key = server.api_key
    # the last LOG_TAIL_BYTES begin halfway through the key (whole, it would be redacted by value)
    after = "y" * 5000 + "\n" + "t" * (LOG_TAIL_BYTES - 5001 - len(key) // 2 - 2) + "\n"
    (tmp_path / "sglang.log").write_text(f"starting: {key}\n" + after)
    assert server.log_tail() == "y" * LOG_TAIL_LINE + " …\n" + "t" * LOG_TAIL_LINE + " …"
