"""64 concurrent streaming requests through one pair whose staging budget fits only a few prompts,
two torch agents and two MLX agents: tests/load.py says what is checked."""

from __future__ import annotations

import pytest

from .agents import AgentProcess, PanelProcess
from .conftest import write_report
from .load import BUDGET_PAGES, PAGE_BYTES, check_load


@pytest.fixture(scope="module", params=["torch", "mlx"])
def cluster(request, smol_dir, tmp_path_factory):
    engine = request.param
    home = tmp_path_factory.mktemp(f"load-{engine}")
    with (
        AgentProcess(engine, smol_dir, home / "p", "--staging-bytes", str(BUDGET_PAGES * PAGE_BYTES)) as p,
        AgentProcess(engine, smol_dir, home / "d") as d,
        PanelProcess(home, "--pair", f"pd={p.url},{d.url}") as panel,
    ):
        yield engine, p, d, panel, home


def test_64_concurrent_streams_complete_or_get_429_and_none_is_mixed_up(cluster):
    engine, p, d, panel, home = cluster
    write_report(f"load_{engine}", check_load(p, d, panel.url, panel.api_key, "pd", home))
