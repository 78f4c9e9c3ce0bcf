"""The run's seed for generated test input (schemathesis in tests/fuzzing.py): FUZZ_SEED if set,
to reproduce a run, else drawn once per test process so that every run explores new cases.
pytest prints it in its header (tests/conftest.py)."""

from __future__ import annotations

import os
import secrets

_SEED: int | None = None


def run_seed() -> int:
    global _SEED
    if _SEED is None:
        _SEED = int(os.environ.get("FUZZ_SEED") or secrets.randbits(32))
    return _SEED
