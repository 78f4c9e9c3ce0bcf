"""OpenBLAS for MLX on Linux.

The `mlx[cpu]` wheel's bundled reference BLAS runs a matmul at a few GFLOP/s. Loading the
distribution's OpenBLAS with RTLD_GLOBAL *before* mlx makes mlx resolve its BLAS calls there
(about 10x faster here). `load_adapter` calls `preload` with the `openblas` setting before it
imports the MLX adapter; the adapter calls it again (a no-op by then) for those who import it
directly.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

SYSTEM_PATHS = (Path("/usr/lib/x86_64-linux-gnu/libopenblas.so.0"), Path("/usr/lib/aarch64-linux-gnu/libopenblas.so.0"))

loaded: Path | None = None  # the library loaded, once it is


def preload(explicit: Path | None = None) -> Path | None:
    """Load OpenBLAS globally unless mlx is already imported (too late then); return its path."""
    global loaded
    if loaded or sys.platform != "linux" or "mlx.core" in sys.modules:
        return loaded
    for path in (explicit, *SYSTEM_PATHS):
        if path and path.exists():
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            loaded = path
            break
    return loaded
