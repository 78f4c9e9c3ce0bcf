"""The engines' settings: where the server engines come from and how they are started.

Read once by the process that loads an engine (the agent reads them at start and passes them to
`load_adapter`); a server engine's adapter turns them into its child's command line and
environment. Variables an adapter hands to its child for their own conversation (the bridge
socket) are named in engine_adapters/bridge.py, not here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt
from pydantic_settings import BaseSettings, SettingsConfigDict

from tandem_protocol.settings import ENV_PREFIX


class EngineSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_ignore_empty=True, extra="ignore")

    vllm_python: Path | None = Field(
        None, description="Python with vLLM installed (default: the repository's .venv-vllm, `make vllm`)"
    )
    vllm_start_timeout: PositiveFloat = Field(600.0, description="seconds vLLM's server may take to become healthy")
    vllm_chunk_tokens: PositiveInt = Field(
        512, description="vLLM prefills in chunks of this many tokens (--max-num-batched-tokens)"
    )
    vllm_kv_gib: PositiveInt = Field(1, description="vLLM's KV cache on CPU, GiB (VLLM_CPU_KVCACHE_SPACE)")
    vllm_threads: PositiveInt | None = Field(None, description="OpenMP threads of vLLM's CPU engine (default: vLLM's)")
    sglang_python: Path | None = Field(
        None, description="Python with SGLang and Tandem installed (default: the repository's .venv-sglang)"
    )
    sglang_device: Literal["cuda", "cpu"] | None = Field(
        None, description="where SGLang runs (default: cuda where nvidia-smi is found, else cpu)"
    )
    sglang_role: Literal["prefill", "decode"] = Field("prefill", description="the PD role SGLang starts in")
    sglang_start_timeout: PositiveFloat = Field(600.0, description="seconds SGLang's server may take to become healthy")
    sglang_chunk_tokens: PositiveInt = Field(
        512, description="SGLang prefills in chunks of this many tokens (--chunked-prefill-size)"
    )
    sglang_kv_tokens: PositiveInt = Field(16384, description="SGLang's KV pool on CPU, tokens (--max-total-tokens)")
    sglang_wait_s: PositiveInt = Field(
        300, description="seconds SGLang's decoder waits for a transfer to begin before failing it"
    )
    sglang_threads: PositiveInt | None = Field(
        None, description="OpenMP threads of SGLang's CPU engine (default: SGLang's)"
    )
    prefix_caching: bool = Field(
        True,
        description="vLLM's prefix cache and SGLang's decode-side radix cache, kept in their KV pools "
        "(a start-up option; the agent's --prefix-cache-bytes 0 turns them off)",
    )
    openblas: Path | None = Field(
        None, description="OpenBLAS library MLX uses on Linux (default: the distribution's libopenblas.so.0)"
    )
