"""The server engines the tier drives from the test process, beside the cluster's agents: a vLLM
adapter and an SGLang adapter (decode role) for log-probabilities the agents do not expose
(tests/engine_probes.py), and a plain SGLang server, as a user runs it alone, for a reference
that is not Tandem's bridge. test_agreement and test_consume_pages use them, one after the other;
they are started once, side by side (each takes the better part of a minute), and the last user
closes them, so the rest of the tier has their memory back."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

from engine_adapters.settings import EngineSettings
from engine_adapters.sglang_adapter import SGLangProcess

CONTEXT = 4096


class PlainSGLangServer(SGLangProcess):
    """SGLang as a user runs it alone: Tandem's command line for the same model and CPU recipe,
    less everything of PD disaggregation."""

    WITH_VALUE = {
        "--disaggregation-mode",
        "--disaggregation-transfer-backend",
        "--disaggregation-bootstrap-port",
        "--disaggregation-decode-retraction-backup",
    }

    def __init__(self, model_dir: Path, log_path: Path, settings: EngineSettings):
        super().__init__(model_dir, CONTEXT, log_path.with_suffix(".sock"), log_path, lambda: "null", settings)

    def command(self) -> list[str]:
        cmd, plain = iter(super().command()), []
        for arg in cmd:
            if arg in self.WITH_VALUE:
                next(cmd)
            elif arg != "--enable-pd-role-switch":
                plain.append(arg)
        return plain


class ServerEngines:
    """`engines["vllm"]`, `engines["sglang"]` (adapters), `engines["plain"]` (PlainSGLangServer)."""

    def __init__(self, model: Path, log_dir: Path):
        from engine_adapters import load_adapter

        # equal thread counts to the cluster's: outputs comparable bit for bit
        os.environ.setdefault("TANDEM_VLLM_THREADS", "1")
        os.environ.setdefault("TANDEM_SGLANG_THREADS", "1")
        settings = EngineSettings()
        self._plain = PlainSGLangServer(model, log_dir / "plain-sglang.log", settings)
        decode_role = settings.model_copy(update={"sglang_role": "decode"})
        # The pool lives until close(): a server dies with the thread that started it (its
        # PR_SET_PDEATHSIG), so those threads must outlive the servers.
        self._pool = ThreadPoolExecutor(3)
        self._jobs = {
            "vllm": self._pool.submit(load_adapter, "vllm", model, CONTEXT, settings),
            "sglang": self._pool.submit(load_adapter, "sglang", model, CONTEXT, decode_role),
            "plain": self._pool.submit(self._plain.start),
        }
        wait(self._jobs.values())  # every start has ended, one way or the other: a failed one
        self._closed = False  # fails the tests that use it

    def __getitem__(self, name: str):
        assert not self._closed, "the server engines were closed by their last user"
        started = self._jobs[name].result()  # raises what its start raised
        return self._plain if name == "plain" else started

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._plain.stop()
        for name in ("vllm", "sglang"):
            if self._jobs[name].exception() is None:
                self._jobs[name].result().close()
        self._pool.shutdown(wait=True)
