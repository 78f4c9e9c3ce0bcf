"""The agent and the server engines keep freed page buffers for the next request (glibc)."""

import sys

import pytest

from tandem_protocol import page_memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")
def test_the_thresholds_apply_here_and_in_a_started_server():
    assert page_memory.keep_freed_pages()
    env = page_memory.malloc_env()
    assert env == {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}
    from engine_adapters.server_process import ServerProcess

    assert env.items() <= ServerProcess.environment(None).items()  # glibc reads them at the server's start
