"""`tandem bench ttft` end to end on tiny settings (a smoke test of the benchmark, not a timing
test: the figures are the benchmark's to print, only their presence and coherence are checked)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from ..agents import TANDEM, TEST_KEY, AgentProcess, PanelProcess, side_by_side
from ..netns import needs_netns

# Link and page-stream rates and TTFT over its bound are measured here: alone, after the lanes.
pytestmark = pytest.mark.quiet


def run_bench(tmp_path, *args: str, env: dict | None = None) -> dict:
    out = subprocess.run(
        [
            TANDEM,
            "bench",
            "ttft",
            "--samples",
            "1",
            "--warmup",
            "0",
            "--max-tokens",
            "4",
            "--out",
            str(tmp_path),
            "--panel-dir",
            str(tmp_path / "panel"),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    [result] = [json.loads(p.read_text()) for p in tmp_path.glob("ttft-*.json")]
    assert json.loads((tmp_path / "panel" / "bench" / "ttft-latest.json").read_text()) == result  # for the panel
    stem = next(tmp_path.glob("ttft-*.json")).with_suffix("")
    assert stem.with_suffix(".md").read_text().startswith("TTFT through the panel")
    assert stem.with_suffix(".png").stat().st_size > 10_000
    return result


def check_cells(result: dict, lengths: list[int], columns: set[str], pairs: tuple[str, ...] = ()) -> None:
    """Every cell measured; each P/D sample's bound built from its own terms, and a lower bound."""
    assert {(c["tokens"], c["column"]) for c in result["cells"]} == {(n, col) for n in lengths for col in columns}
    for c in result["cells"]:
        assert c["ttft"]["median"] > 0 and len(c["ttft"]["samples"]) == result["samples"]
        if "->" not in c["column"] and c["column"] not in pairs:
            continue
        b = c["bound"]
        assert c["fell_back"] == 0 and len(b["prefill_samples"]) == result["samples"]  # every request went P->D
        assert b["link_seconds"] > 0 and b["wire_bytes"] > 0 and b["pages"] == -(-c["tokens"] // 64)
        step = result["decode_step_seconds"][b["decoder"]]["min"]
        assert b["decode_step_seconds"] == (0.0 if b["mode"] == "commit-first" else step)
        assert b["samples"] == [
            pytest.approx(max(p, b["link_seconds"]) + b["decode_step_seconds"]) for p in b["prefill_samples"]
        ]
        ratios = [t / bound for t, bound in zip(c["ttft"]["samples"], b["samples"])]
        assert c["ttft_over_bound"] == pytest.approx(min(ratios))
        # a true lower bound: no request was faster than its own bound (2 % for clock noise)
        assert not c["invalid_bound"] and c["ttft_over_bound"] >= 0.98, c
        own = c["ttft_minus_own_prefill"]
        assert len(own["samples"]) == result["samples"] and 0 < own["median"] < c["ttft"]["median"]


def check_alone_rows(tmp_path, result: dict) -> None:
    """The report puts each P/D cell beside its decoder alone at the same length."""
    md, cells = next(tmp_path.glob("ttft-*.md")).read_text(), {(c["tokens"], c["column"]): c for c in result["cells"]}
    rows = 0
    for (n, column), c in cells.items():
        if "decoder" in c:
            pd, alone = c["ttft"]["median"], cells[n, f"node/{c['decoder']}"]["ttft"]["median"]
            assert f"| {n} | {column} | {pd * 1000:.0f} | {alone * 1000:.0f} | {pd / alone:.2f} |" in md, md
            rows += 1
    assert rows, result["cells"]


def test_bench_ttft_on_loopback(tmp_path):
    result = run_bench(tmp_path, "--lengths", "51,70", "--prefill", "torch", "--decode", "mlx")
    check_cells(result, [51, 70], {"node/a-torch", "node/b-mlx", "a-torch->b-mlx", "b-mlx->a-torch"})
    assert result["pinned"] and [a["cpus"] for a in result["agents"]] == ["0", "1"]
    # 818 and 912 MB/s measured at load average 8 on two cores
    assert all(v["bytes_per_second"] > 1e8 for v in result["link_measured"].values())
    for c in result["cells"]:  # the traced request's stages on the decoder
        if "->" in c["column"]:
            stages = c["trace"]["decoder"]
            assert stages["first page to last page"] >= 0 and stages["last page to first token"] > 0, c["trace"]
            # the import with every page on P already: P took all but the last page from its cache
            h = c["held_on_p"]
            assert h["prompt_tokens"] % 64 == 1 and h["cached_tokens_on_p"] == h["prompt_tokens"] - 1, h
            assert h["pages"] == -(-h["prompt_tokens"] // 64), h  # both decoders are commit-first
            assert h["import_bytes_per_second"] > 0 and h["last_page_to_imported_seconds"] >= 0, h
    md = next(tmp_path.glob("ttft-*.md")).read_text()
    assert "The decoder's import with every page already on P" in md and "goal ≥ 1 GB/s on loopback" in md
    check_alone_rows(tmp_path, result)


@needs_netns
def test_bench_ttft_on_a_shaped_link(tmp_path):
    """Agents in two namespaces joined by a veth pair shaped to 40 MB/s: the raw TCP throughput
    measured in the run shows the shaping, and everything is torn down afterwards."""
    before = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    result = run_bench(
        tmp_path,
        "--lengths",
        "51",
        "--link",
        "shaped",
        "--rate",
        "40",
        "--direction",
        "a2b",
        "--prefill",
        "torch",
        "--decode",
        "torch",
    )
    check_cells(result, [51], {"node/a-torch", "node/b-torch", "a-torch->b-torch"})
    # The shaping caps both figures (44 = 40 and the bucket's burst); CPU load only lowers them
    # (38.3 MB/s at load average 8 on two cores), so the floor sits at a third of that: still
    # far above 40 Mbit/s (5 MB/s), a unit mistake.
    link = result["link_measured"]["a-torch->b-torch"]
    assert 12e6 < link["bytes_per_second"] < 44e6, link
    # the product's page stream over the same shaped link, checked frames and all
    assert 12e6 < link["page_stream"]["bytes_per_second"] < 44e6, link
    assert link["page_stream_over_raw_tcp"] == pytest.approx(
        link["page_stream"]["bytes_per_second"] / link["bytes_per_second"]
    )
    # the default 0.3 ms each way: netem where the kernel has it, and said plainly where it has not
    lm, md = result["link_measured"], next(tmp_path.glob("ttft-*.md")).read_text()
    assert lm["asked_delay_ms"] == 0.3 and lm["emulated_delay_ms"] in (0.0, 0.3)
    assert ("delay each way 0.3 ms (netem)" if lm["emulated_delay_ms"] else "not emulated (no netem") in md
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout == before


def test_bench_ttft_against_a_running_panel(tmp_path, smol_dir):
    """`--panel URL`: the models of a panel someone already runs (its pairs and paired nodes, read
    from its database), nothing started; each pair's link measured by its decoder pulling pages
    from its prefiller (POST /v1/bench/link), checked against an unknown model name first. The
    agents serve HTTPS: every probe of the benchmark pins the certificate the panel pinned."""
    with (
        side_by_side(
            lambda: AgentProcess("torch", smol_dir, tmp_path / "p", tls=True),
            lambda: AgentProcess("torch", smol_dir, tmp_path / "d", tls=True),
        ) as (p, d),
        PanelProcess(tmp_path, "--pair", f"duo={p.url},{d.url},threshold=1") as panel,
    ):
        args = ("--lengths", "51", "--panel", panel.url, "--api-key", panel.api_key)
        refused = subprocess.run(
            [TANDEM, "bench", "ttft", *args, "--models", "duo,nope", "--panel-dir", str(tmp_path / "panel")],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "TANDEM_CLUSTER_KEY": TEST_KEY, "COLUMNS": "200"},
        )
        assert refused.returncode != 0 and "the panel has no model nope" in refused.stdout + refused.stderr
        result = run_bench(tmp_path, *args, env={"TANDEM_CLUSTER_KEY": TEST_KEY})
        names = {p.status()["name"], d.status()["name"]}
    check_cells(result, [51], {"duo", *(f"node/{n}" for n in names)}, pairs=("duo",))
    check_alone_rows(tmp_path, result)
    assert result["link"] == "panel" and not result["pinned"]
    [(link_name, link)] = result["link_measured"].items()
    # loopback: 273 MB/s measured at load average 7 on two cores (the floor was 100 MB/s)
    assert link["method"] == "page stream" and link["bytes_per_second"] > 8e7 and link["rtt_seconds"] > 0, link
    assert link["bytes"] >= 64e6
