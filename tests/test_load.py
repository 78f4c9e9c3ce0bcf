"""64 concurrent streaming requests through one pair (two torch agents) whose staging budget fits
only a few prompts: tests/load.py says what is checked."""

from __future__ import annotations

import pytest

from .agents import AgentProcess, PanelProcess
from .load import BUDGET_PAGES, PAGE_BYTES, check_load


@pytest.fixture(scope="module")
def cluster(smol_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("load")
    with AgentProcess("torch", smol_dir, home / "p", "--staging-bytes", str(BUDGET_PAGES * PAGE_BYTES)) as p, \
            AgentProcess("torch", smol_dir, home / "d") as d, \
            PanelProcess(home, "--pair", f"pd={p.url},{d.url}") as panel:
        yield p, d, panel, home


def test_64_concurrent_streams_complete_or_get_429_and_none_is_mixed_up(cluster):
    p, d, panel, home = cluster
    check_load(p, d, panel.url, panel.api_key, "pd", home)
