"""The models a node knows by name: `$TANDEM_HOME/models.json`.

Each entry records the checkpoint's path and its contract at registration time, so
`tandem model list` can show what a peer would have to match without reloading anything.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from tandem_protocol.settings import data_dir


@dataclass(frozen=True)
class RegisteredModel:
    name: str
    path: Path
    contract: dict
    added: float


class ModelRegistry:
    def __init__(self, path: Path | None = None):
        self.path = path or data_dir() / "models.json"

    def _read(self) -> dict:
        if not self.path.is_file():
            return {"models": {}}
        return json.loads(self.path.read_text())

    def _write(self, data: dict) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        os.replace(tmp, self.path)

    def register(self, name: str, path: Path, contract: dict) -> RegisteredModel:
        data = self._read()
        entry = {"path": str(Path(path).resolve()), "contract": contract, "added": time.time()}
        data["models"][name] = entry
        self._write(data)
        return RegisteredModel(name, Path(entry["path"]), contract, entry["added"])

    def all(self) -> list[RegisteredModel]:
        return [
            RegisteredModel(n, Path(e["path"]), e["contract"], e["added"])
            for n, e in sorted(self._read()["models"].items())
        ]

    def get(self, name: str) -> RegisteredModel:
        for model in self.all():
            if model.name == name:
                return model
        raise KeyError(f"no model named {name!r} is registered (see `tandem model list`)")
