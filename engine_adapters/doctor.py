"""Environment probes for `tandem agent doctor` (engine imports live here, not in the agent)."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import sys

from tandem_protocol.settings import TandemSettings, env_table

from . import openblas
from .bridge import SGLANG_BRIDGE_ENV, VLLM_BRIDGE_ENV
from .settings import EngineSettings

# Variables that are no setting of a Tandem process, listed so the doctor and the README name
# every TANDEM_* variable there is.
OTHER_VARIABLES = {
    VLLM_BRIDGE_ENV: "set by the agent for its vLLM server: the bridge socket Tandem's connector talks to",
    SGLANG_BRIDGE_ENV: "set by the agent for its SGLang server: the bridge socket Tandem's backend talks to",
    "TANDEM_FAILPOINTS": "fault drills and tests: name@N makes the N-th such engine step fail (failpoints.py)",
    "TANDEM_API_KEY": "`tandem bench ttft --panel`: the panel's API key (the --api-key option)",
    "TANDEM_TOKENIZER_DIR": "tests/system/test_cuda.py: a tokenizer.json for the GPU test model",
    "TANDEM_UI_SCREENSHOTS": "tests/system/test_panel_ui.py: also save screenshots of the other pages",
}
SECRET = {"TANDEM_CLUSTER_KEY", "TANDEM_API_KEY"}

PACKAGES = (
    "torch",
    "transformers",
    "mlx",
    "mlx-lm",
    "numpy",
    "safetensors",
    "gguf",
    "fastapi",
    "uvicorn",
    "aiohttp",
    "httpx",
    "zeroconf",
    "prometheus-client",
    "xxhash",
)


def package_versions() -> dict[str, str]:
    versions = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def environment(shared: TandemSettings, engine: EngineSettings) -> list[tuple[str, str, str]]:
    """(variable, value in effect, meaning) of every TANDEM_* variable; secrets show as set."""

    def shown(var: str, value) -> str:
        return "(not set)" if value is None else ("(set)" if var in SECRET else str(value))

    rows = []
    for settings in (shared, engine):
        for (var, _, meaning), name in zip(env_table(type(settings)), type(settings).model_fields, strict=True):
            rows.append((var, shown(var, getattr(settings, name)), meaning))
    rows += [(var, shown(var, os.environ.get(var)), meaning) for var, meaning in OTHER_VARIABLES.items()]
    return rows


def engine_imports(settings: EngineSettings) -> dict[str, str]:
    """Import each engine's module; 'ok' or the error a user would hit."""
    from . import ADAPTERS

    openblas.preload(settings.openblas)  # as load_adapter does, before mlx is imported
    results = {}
    for engine, target in ADAPTERS.items():
        try:
            module = importlib.import_module(target.split(":")[0])
            # an engine in its own environment (vLLM) says which version it found there
            check = getattr(module, f"{engine}_environment", None)
            results[engine] = "ok" + (f": {check(settings)}" if check else "")
        except Exception as e:  # report, don't crash the doctor
            results[engine] = f"{type(e).__name__}: {e}"
    return results


def cpu_isa() -> list[str]:
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags.update(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    wanted = ["avx2", "avx512f", "avx512_bf16", "amx_tile", "fma", "f16c", "asimd", "sve"]
    found = [f for f in wanted if f in flags]
    if platform.machine() == "arm64" and sys.platform == "darwin":
        found.append("apple-silicon")
    return found


def accelerators() -> dict[str, str]:
    out = {
        "cpu": f"{platform.machine()} {platform.processor() or ''}".strip() + f", {os.cpu_count()} cores",
        "cpu_isa": ", ".join(cpu_isa()) or "unknown",
    }
    try:
        import torch

        out["cuda"] = (
            f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"
            if torch.cuda.is_available()
            else "not available"
        )
    except Exception as e:
        out["cuda"] = f"torch does not import: {e}"
    try:
        from .mlx_adapter import mx

        out["metal"] = "available" if mx.metal.is_available() else "not available"
        out["blas"] = (
            f"OpenBLAS at {openblas.loaded} (fast)"
            if openblas.loaded
            else (
                "Accelerate"
                if sys.platform == "darwin"
                else "bundled reference BLAS (slow: install libopenblas0-pthread)"
            )
        )
    except Exception as e:
        out["metal"] = f"mlx does not import: {e}"
    return out
