"""Where a node may load models from, and checking a requested model path before anything loads.

A panel asks an agent to serve a model by path. The path is confined to the agent's model roots
(`--model-root`, repeatable; by default `$TANDEM_HOME/models`, the models registered with
`tandem model import`, and the model the agent was started with): it is resolved first, so `..`
and symlinks cannot lead outside. Then it must exist and be a checkpoint Tandem supports.
"""

from __future__ import annotations

from pathlib import Path

from tandem_protocol.errors import TandemError, UnsupportedModel
from tandem_protocol.model_dir import ModelInfo, inspect_model
from tandem_protocol.settings import data_dir

from .model_registry import ModelRegistry


class ModelPathError(TandemError):
    """The model path is missing, outside the model roots, or not a supported checkpoint."""


def default_roots(served: Path | None = None) -> list[Path]:
    roots = [data_dir() / "models"] + [m.path for m in ModelRegistry().all()]
    return _unique(roots + ([served] if served else []))


def _unique(paths: list[Path]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        p = Path(p).expanduser().resolve()
        if p not in out:
            out.append(p)
    return out


def confine(path: str, roots: list[Path]) -> Path:
    """The real path of `path` if it lies inside one of `roots`; ModelPathError otherwise."""
    if not path or not path.strip():
        raise ModelPathError("give a model path (a directory on this node)")
    p = Path(path.strip()).expanduser()
    if not p.is_absolute():
        raise ModelPathError(f"model path {path!r} must be absolute (a directory on this node)")
    real = p.resolve()  # follows symlinks and removes `..` before the check
    if not _inside(real, roots):
        raise ModelPathError(
            f"{path} is outside this node's model roots ({', '.join(map(str, roots))}); "
            "start the agent with --model-root to allow another directory"
        )
    if not real.is_dir():
        raise ModelPathError(f"{path} does not exist on this node")
    return real


def _inside(real: Path, roots: list[Path]) -> bool:
    return any(real == r or real.is_relative_to(r) for r in _unique(roots))


def check_model(path: str, roots: list[Path]) -> ModelInfo:
    """Confine `path`, then check it is a checkpoint Tandem can serve (raises ModelPathError)."""
    real = confine(path, roots)
    try:
        return inspect_model(real)
    except UnsupportedModel as e:
        raise ModelPathError(str(e)) from None


def list_models(roots: list[Path]) -> list[dict]:
    """Checkpoints found in the roots (the root itself or its direct subdirectories). A link in a
    root to a directory outside every root is not offered: POST /v1/config would refuse it."""
    found = []
    for root in _unique(roots):
        for d in [root] + (sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []):
            if _inside(d.resolve(), roots) and (d / "config.json").is_file():
                try:
                    info = inspect_model(d)
                    found.append({"path": str(d), "model_type": info.model_type, "supported": True, "reason": ""})
                except UnsupportedModel as e:
                    found.append({"path": str(d), "model_type": "", "supported": False, "reason": str(e)})
    return found
