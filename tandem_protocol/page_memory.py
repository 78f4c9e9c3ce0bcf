"""Keep freed page buffers in the process for the next request's pages (glibc's malloc).

Every page arrives in a buffer of its own (1.5 MB for SmolLM2, 8 MB for an 8B model), which lives
until the engine has imported it. By default glibc serves such buffers from fresh mmaps, or hands
the heap top back to the kernel once they are freed, so each request faults its whole KV into
memory again. Measured on this machine (a VM), filling 24 page buffers (35 MB) that stay alive
took 21-30 ms, against 2.5-2.9 ms once freed memory is kept: at 1,536 tokens that is as long as
torch's whole import of the pages. Raising the two thresholds keeps up to TRIM_THRESHOLD bytes of
freed heap for reuse; an idle process may hold that much more resident memory.

The agent calls `keep_freed_pages()` at start (it hosts the in-process engines and receives every
page); server engines get `malloc_env()` in their environment, which glibc reads when they start.
Other C libraries (macOS, musl) are left alone."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

MMAP_THRESHOLD = 32 << 20  # glibc's largest: buffers below it come from the heap, which is reused
TRIM_THRESHOLD = 256 << 20  # freed heap kept before glibc gives it back (a 6,000-token prompt: 138 MB)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)


def malloc_env() -> dict[str, str]:
    """The same setting for a process about to start, as glibc's environment variables."""
    if not sys.platform.startswith("linux"):
        return {}
    return {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}


def keep_freed_pages() -> bool:
    """Set the thresholds in this process; False where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl has no mallopt
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
