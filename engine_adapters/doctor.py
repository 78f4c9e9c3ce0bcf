"""Environment probes for `tandem agent doctor` (engine imports live here, not in the agent)."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import sys

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


def engine_imports() -> dict[str, str]:
    """Import each engine's module; 'ok' or the error a user would hit."""
    from . import ADAPTERS

    results = {}
    for engine, target in ADAPTERS.items():
        try:
            module = importlib.import_module(target.split(":")[0])
            # an engine in its own environment (vLLM) says which version it found there
            check = getattr(module, f"{engine}_environment", None)
            results[engine] = "ok" + (f": {check()}" if check else "")
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
        from .mlx_adapter import OPENBLAS_LOADED, mx

        out["metal"] = "available" if mx.metal.is_available() else "not available"
        out["blas"] = (
            "Debian OpenBLAS (fast)"
            if OPENBLAS_LOADED
            else (
                "Accelerate"
                if sys.platform == "darwin"
                else "bundled reference BLAS (slow: install libopenblas0-pthread)"
            )
        )
    except Exception as e:
        out["metal"] = f"mlx does not import: {e}"
    return out
