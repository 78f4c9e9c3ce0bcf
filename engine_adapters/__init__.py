"""Engine adapters: the only package that imports torch, transformers, mlx, vllm or sglang.

Importing this package is cheap: each adapter module (and its engine) is imported only when
`load_adapter` asks for it. The adapter contract (`base.EngineAdapter`) and the two kinds of
engine behind it (`in_process.InProcessEngine`, `server_engine.ServerEngine`) import no engine.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from tandem_protocol import ENGINES

if TYPE_CHECKING:
    from .base import EngineAdapter
    from .settings import EngineSettings

# engine name -> "module:Class"
ADAPTERS = {
    "torch": "engine_adapters.torch_adapter:TorchAdapter",
    "mlx": "engine_adapters.mlx_adapter:MLXAdapter",
    "vllm": "engine_adapters.vllm_adapter:VLLMAdapter",
    "sglang": "engine_adapters.sglang_adapter:SGLangAdapter",
}
assert tuple(ADAPTERS) == ENGINES, "tandem_protocol.ENGINES names the engines the panel offers"


def adapter_class(engine: str) -> type[EngineAdapter]:
    try:
        module, cls = ADAPTERS[engine].split(":")
    except KeyError:
        raise ValueError(f"unknown engine {engine!r}; known engines: {', '.join(ADAPTERS)}") from None
    return getattr(importlib.import_module(module), cls)


def load_adapter(
    engine: str,
    model_dir: str | Path,
    context_length: int | None = None,
    settings: EngineSettings | None = None,
    **kwargs,
) -> EngineAdapter:
    """Start `engine` on the model in `model_dir` with the process's engine `settings` (default:
    read from the environment now)."""
    # Imported here: engine processes import this package (their KV plugins use `bridge`) and
    # may not have pydantic-settings.
    from tandem_protocol.settings import load

    from . import openblas
    from .settings import EngineSettings

    settings = settings if settings is not None else load(EngineSettings)
    if engine == "mlx":
        openblas.preload(settings.openblas)  # before the adapter's module imports mlx
    return adapter_class(engine)(model_dir, context_length, settings=settings, **kwargs)
