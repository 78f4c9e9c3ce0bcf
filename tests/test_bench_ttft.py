"""`tandem bench ttft` end to end on tiny settings (a smoke test of the benchmark, not a timing
test: the figures are the benchmark's to print, only their presence and coherence are checked)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from .agents import TANDEM
from .netns import needs_netns


def run_bench(tmp_path, *args: str) -> dict:
    out = subprocess.run([TANDEM, "bench", "ttft", "--samples", "1", "--warmup", "0", "--max-tokens", "4",
                          "--out", str(tmp_path), "--panel-dir", str(tmp_path / "panel"), *args],
                         capture_output=True, text=True, timeout=900,
                         env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    [result] = [json.loads(p.read_text()) for p in tmp_path.glob("ttft-*.json")]
    assert json.loads((tmp_path / "panel" / "bench" / "ttft-latest.json").read_text()) == result  # for the panel
    stem = next(tmp_path.glob("ttft-*.json")).with_suffix("")
    assert stem.with_suffix(".md").read_text().startswith("TTFT through the panel")
    assert stem.with_suffix(".png").stat().st_size > 10_000
    return result


def check_cells(result: dict, lengths: list[int], columns: set[str]) -> None:
    assert {(c["tokens"], c["column"]) for c in result["cells"]} == {(n, col) for n in lengths for col in columns}
    for c in result["cells"]:
        assert c["ttft"]["median"] > 0 and len(c["ttft"]["samples"]) == result["samples"]
        if "->" in c["column"]:
            b = c["bound"]
            assert b["prefill_seconds"] > 0 and b["transfer_seconds"] > 0 and b["pages"] == -(-c["tokens"] // 64)
            assert b["seconds"] == pytest.approx(max(b["prefill_seconds"], b["transfer_seconds"])
                                                 + b["decode_step_seconds"])
            assert c["ttft_over_bound"] == pytest.approx(c["ttft"]["median"] / b["seconds"])
            own = c["ttft_minus_own_prefill"]  # every measured request went P->D
            assert len(own["samples"]) == result["samples"] and own["median"] < c["ttft"]["median"]


def test_bench_ttft_on_loopback(tmp_path):
    result = run_bench(tmp_path, "--lengths", "51,70", "--prefill", "torch", "--decode", "mlx")
    check_cells(result, [51, 70], {"node/a-torch", "node/b-mlx", "a-torch->b-mlx", "b-mlx->a-torch"})
    assert result["pinned"] and [a["cpus"] for a in result["agents"]] == ["0", "1"]
    assert all(v["bytes_per_second"] > 1e8 for v in result["link_measured"].values())


@needs_netns
def test_bench_ttft_on_a_shaped_link(tmp_path):
    """Agents in two namespaces joined by a veth pair shaped to 40 MB/s: the raw TCP throughput
    measured in the run shows the shaping, and everything is torn down afterwards."""
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    result = run_bench(tmp_path, "--lengths", "51", "--link", "shaped", "--rate", "40", "--direction", "a2b",
                       "--prefill", "torch", "--decode", "torch")
    check_cells(result, [51], {"node/a-torch", "node/b-torch", "a-torch->b-torch"})
    link = result["link_measured"]["a-torch->b-torch"]
    assert 20e6 < link["bytes_per_second"] < 44e6, link
    # the product's page stream over the same shaped link, checked frames and all
    assert 20e6 < link["page_stream"]["bytes_per_second"] < 44e6, link
    assert link["page_stream_over_raw_tcp"] == pytest.approx(link["page_stream"]["bytes_per_second"]
                                                            / link["bytes_per_second"])
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout == before
