"""The model contract: what a prefiller and a decoder must share for KV to mean the same thing.

A contract is four fingerprints plus the page geometry:

- weights:        every *.safetensors file (name and content),
- tokenizer:      the tokenizer files and chat template (name and content),
- config:         config.json, minus keys that do not change the math,
- context_length: the context length the engine was started with.

`fingerprint` combines them; a page frame carries its first 16 bytes. `check_same` compares two
contracts field by field and names every field that differs.

Hashing uses xxh3-128 (xxhash, a well-kept C library): this is an identity check between
cooperating machines, not a defence against forgery, and it hashes gigabytes in a fraction of
the time SHA-256 needs. Hashes of large files are cached by file identity (resolved path, size,
mtime) so a restart does not re-read a multi-gigabyte checkpoint.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import xxhash

from .errors import ContractMismatch
from .model_dir import ModelInfo
from .pages import PageGeometry

# Keys of config.json that tools rewrite without changing the model's math.
_VOLATILE_CONFIG_KEYS = {"transformers_version", "_name_or_path", "use_cache", "torch_dtype", "dtype"}
_CHUNK = 16 << 20

Progress = Callable[[int, int], None]  # (bytes done, bytes total)


@dataclass(frozen=True)
class ModelContract:
    weights: str
    tokenizer: str
    config: str
    context_length: int
    layers: int
    kv_heads: int
    head_dim: int

    FIELDS = ("weights", "tokenizer", "config", "context_length")

    @property
    def geometry(self) -> PageGeometry:
        return PageGeometry(self.layers, self.kv_heads, self.head_dim)

    @cached_property  # frozen: computed once (the page path frames every page with it)
    def fingerprint(self) -> str:
        h = xxhash.xxh3_128()
        for value in (
            self.weights,
            self.tokenizer,
            self.config,
            str(self.context_length),
            f"{self.layers}/{self.kv_heads}/{self.head_dim}",
        ):
            h.update(value.encode() + b"\0")
        return h.hexdigest()

    @cached_property
    def fingerprint_bytes(self) -> bytes:
        return bytes.fromhex(self.fingerprint)

    def to_dict(self) -> dict:
        return {**asdict(self), "fingerprint": self.fingerprint}

    @classmethod
    def from_dict(cls, d: dict) -> ModelContract:
        return cls(
            **{k: d[k] for k in ("weights", "tokenizer", "config", "context_length", "layers", "kv_heads", "head_dim")}
        )

    def check_same(self, other: ModelContract) -> None:
        """Raise ContractMismatch naming every field in which `other` differs."""
        differ = [f for f in self.FIELDS if getattr(self, f) != getattr(other, f)]
        if self.geometry != other.geometry:
            differ.append("geometry")
        if differ:
            details = ", ".join(
                f"{f}: {getattr(self, f, self.geometry)} != {getattr(other, f, other.geometry)}" for f in differ
            )
            raise ContractMismatch(differ, details)


def token_digest(token_ids: Sequence[int]) -> bytes:
    """16-byte digest of a prompt's token ids (order and length included)."""
    return xxhash.xxh3_128_digest(np.asarray(token_ids, dtype="<i8").tobytes())


def config_fingerprint(config: dict) -> str:
    stable = {k: v for k, v in config.items() if k not in _VOLATILE_CONFIG_KEYS}
    return xxhash.xxh3_128_hexdigest(json.dumps(stable, sort_keys=True, separators=(",", ":")).encode())


class HashCache:
    """File-content hashes keyed by (resolved path, size, mtime_ns), kept in one JSON file."""

    def __init__(self, path: Path | None):
        self.path = path
        self._entries: dict[str, str] = {}
        if path is not None and path.is_file():
            try:
                self._entries = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                self._entries = {}  # a damaged cache only costs a re-hash

    @staticmethod
    def _key(file: Path) -> str:
        st = file.stat()
        return f"{file.resolve()}|{st.st_size}|{st.st_mtime_ns}"

    def get(self, file: Path) -> str | None:
        return self._entries.get(self._key(file))

    def put(self, file: Path, digest: str) -> None:
        self._entries[self._key(file)] = digest
        if self.path is not None:
            # Agents sharing a data dir may write at once: each through a temporary file of its
            # own, so a replace never finds its file taken by another's (the last one wins; the
            # others' entries only cost a re-hash).
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, suffix=".tmp", delete=False) as tmp:
                tmp.write(json.dumps(self._entries, indent=0))
            os.replace(tmp.name, self.path)


def hash_file(file: Path, progress: Callable[[int], None] | None = None) -> str:
    h = xxhash.xxh3_128()
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            if progress:
                progress(len(chunk))
    return h.hexdigest()


def files_fingerprint(files: Sequence[Path], cache: HashCache | None = None, progress: Progress | None = None) -> str:
    """Fingerprint a set of files by name and content, re-using cached content hashes."""
    total = sum(f.stat().st_size for f in files)
    done = 0
    combined = xxhash.xxh3_128()
    for file in sorted(files, key=lambda p: p.name):
        digest = cache.get(file) if cache else None
        if digest is None:

            def advance(n: int) -> None:
                nonlocal done
                done += n
                if progress:
                    progress(done, total)

            digest = hash_file(file, advance)
            if cache:
                cache.put(file, digest)
        else:
            done += file.stat().st_size
            if progress:
                progress(done, total)
        combined.update(f"{file.name}:{digest}\n".encode())
    return combined.hexdigest()


def compute_contract(
    info: ModelInfo, context_length: int, cache: HashCache | None = None, progress: Progress | None = None
) -> ModelContract:
    """The contract of the model in `info` served at `context_length`."""
    g = info.geometry
    return ModelContract(
        weights=files_fingerprint(info.weight_files, cache, progress),
        tokenizer=files_fingerprint(info.tokenizer_files),
        config=config_fingerprint(info.config),
        context_length=int(context_length),
        layers=g.layers,
        kv_heads=g.kv_heads,
        head_dim=g.head_dim,
    )
