"""The `tandem bench ttft` command: its options, and a run on a cluster of its own."""

from __future__ import annotations

import os
import platform
import secrets
import time
from collections.abc import Callable
from pathlib import Path

import typer

from tandem_protocol.settings import data_dir

from ..progress import console
from .cluster import Cluster, cluster
from .link import Link, loopback_link, page_stream, random_block, raw_stream, raw_tcp, shaped_link
from .measure import Column, measure
from .probe_agents import decode_step_seconds
from .report import markdown_table, output_stem, write_outputs
from .running_panel import bench_running_panel

DEFAULT_LENGTHS = "51,184,744,2844"
# --fast-prefiller: torch (the quickest CPU prefiller here) into every decoder, and every server
# engine into torch, so that no slow prefill hides a decoder's import (each pair its own cluster).
FAST_PREFILLER_PAIRS = [
    ("torch", "vllm"),
    ("torch", "sglang"),
    ("torch", "mlx"),
    ("torch", "torch"),
    ("vllm", "torch"),
    ("sglang", "torch"),
]
FAST_PREFILLER_LENGTHS = "184,744,2844,6000"


def bench_ttft(
    lengths: str = typer.Option(DEFAULT_LENGTHS, help="Prompt lengths in tokens, comma-separated."),
    samples: int = typer.Option(5, min=1, help="Measured requests per cell (after the warm-up)."),
    warmup: int = typer.Option(1, min=0, help="Unmeasured requests per cell first."),
    max_tokens: int = typer.Option(32, min=1, help="Output tokens per request."),
    prefill: str = typer.Option("torch", help="Engine of agent A."),
    decode: str = typer.Option("mlx", help="Engine of agent B."),
    direction: str = typer.Option("both", help="P->D directions: a2b (A prefills), b2a, or both."),
    link: str = typer.Option("loopback", help="loopback, or shaped (namespaces + tc tbf; needs root)."),
    rate: float = typer.Option(85.0, help="Shaped link rate in MB/s."),
    delay_ms: float = typer.Option(
        0.3, help="Shaped link delay each way in ms (netem; skipped, and said so, where the kernel has none)."
    ),
    pin: bool = typer.Option(True, help="Pin each agent to its own CPU."),
    cores_per_agent: int = typer.Option(
        1, min=1, help="CPUs each pinned agent gets (1 on a 2-core machine; more on a GPU host)."
    ),
    out: Path = typer.Option(Path("bench/results"), help="Where the JSON, markdown and PNG go."),
    model_dir: Path = typer.Option(None, "--model", help="Model directory (default: the embedded model)."),
    b_cpu_only: bool = typer.Option(False, help="Hide GPUs from agent B (e.g. CUDA prefill -> CPU decode)."),
    panel_dir: Path = typer.Option(
        None,
        help="Data dir of the panel that shows the result (default: $TANDEM_HOME/panel, the panel on this machine).",
    ),
    zstd: bool = typer.Option(False, help="Also run every P->D direction with compressed pages (byte planes + zstd)."),
    fp8: bool = typer.Option(False, help="Also run every P->D direction with FP8 pages (lossy, half the bytes)."),
    int8: bool = typer.Option(
        False, help="Also run every P->D direction with INT8 pages (lossy, 0.51-0.52 the bytes)."
    ),
    staging: str = typer.Option(
        None, help="Both agents' --staging-bytes (e.g. 8GiB: the pages of a long prompt of a large model)."
    ),
    alone: bool = typer.Option(True, help="Also measure each engine alone (its node/ model)."),
    trace: bool = typer.Option(True, help="One more request per P/D cell, traced: where its time goes."),
    panel: str = typer.Option(
        None,
        help="Benchmark this running panel's models instead of starting a cluster. "
        "Run it on the panel's machine: pairs and nodes are read from --panel-dir.",
    ),
    api_key: str = typer.Option(None, envvar="TANDEM_API_KEY", help="With --panel: an API key of that panel."),
    models: str = typer.Option(None, help="With --panel: the models to measure, comma-separated (default: all)."),
    insecure_http: bool = typer.Option(
        False,
        "--insecure-http",
        help="With --panel: also send the cluster key to the panel's plain-HTTP nodes (agents started with "
        "--insecure-http), where it crosses the network readable. HTTPS nodes get it only over the certificate "
        "the panel pinned.",
    ),
    fast_prefiller: bool = typer.Option(
        False,
        help="Every decoder behind a fast prefiller: torch -> vLLM, SGLang, MLX, torch and vLLM, SGLang -> torch "
        f"(A prefills; --prefill/--decode/--direction are ignored; lengths {FAST_PREFILLER_LENGTHS} by default).",
    ),
) -> None:
    """Measure time to first token, engines alone and P->D, against the physical bound."""
    if fast_prefiller and lengths == DEFAULT_LENGTHS:
        lengths = FAST_PREFILLER_LENGTHS
    sizes = [int(x) for x in lengths.split(",") if x.strip()]
    if not sizes or min(sizes) < 2:
        raise typer.BadParameter("--lengths must be prompt lengths of at least 2 tokens, comma-separated")
    result = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "lengths": sizes,
        "samples": samples,
        "warmup": warmup,
        "max_tokens": max_tokens,
        "staging": staging,  # None: the agents' default budget
        "trace": trace,
        "cells": [],
    }
    load_start = os.getloadavg()[0]  # other work on the machine slows TTFT and the bound alike
    stem = output_stem(out, "panel" if panel else link)

    def save() -> list[Path]:
        result["load_average"] = {"start": load_start, "end": os.getloadavg()[0]}
        return write_outputs(result, stem, panel_dir)

    if panel:
        if not api_key:
            raise typer.BadParameter("--panel needs --api-key (or TANDEM_API_KEY): the panel's OpenAI API wants one")
        result |= {"panel": panel, "link": "panel", "pinned": False}
        panel_home = panel_dir or data_dir() / "panel"
        bench_running_panel(result, panel.rstrip("/"), api_key, panel_home, models, save, insecure_http)
    else:
        dirs = {"a2b": [(0, 1)], "b2a": [(1, 0)], "both": [(0, 1), (1, 0)]}.get(direction)
        if dirs is None:
            raise typer.BadParameter("--direction must be a2b, b2a or both")
        if link not in ("loopback", "shaped"):
            raise typer.BadParameter("--link must be loopback or shaped")
        result |= {"link": link, "pinned": pin}
        pairs = FAST_PREFILLER_PAIRS if fast_prefiller else [(prefill, decode)]
        dirs = [(0, 1)] if fast_prefiller else dirs
        with shaped_link(rate, delay_ms, random_block()) if link == "shaped" else loopback_link() as net:
            for engines in pairs:
                encodings = ("raw", *(e for e, on in (("zstd", zstd), ("fp8", fp8), ("int8", int8)) if on))
                own_cluster(
                    result,
                    net,
                    engines,
                    dirs,
                    model_dir,
                    pin,
                    cores_per_agent,
                    encodings,
                    alone,
                    b_cpu_only,
                    save,
                    staging,
                )
    paths = save()
    console.print(markdown_table(result))
    console.print("written: " + ", ".join(str(p) for p in paths))
    invalid = [c for c in result["cells"] if c.get("invalid_bound")]
    if invalid:
        console.print(f"[red]{len(invalid)} cells have an invalid bound (TTFT ÷ bound under 0.98): the bound is wrong")
        raise typer.Exit(1)


def own_cluster(
    result: dict,
    net: Link,
    engines: tuple[str, str],
    dirs: list[tuple[int, int]],
    model_dir: Path | None,
    pin: bool,
    cores_per_agent: int,
    encodings: tuple[str, ...],
    alone: bool,
    b_cpu_only: bool,
    save: Callable[[], object],
    staging: str | None = None,
) -> None:
    """Two agents on `net` and a panel; the link measured raw, then every cell."""
    from tandem_protocol.model_dir import inspect_model

    from ..model_cmd import ensure_embedded_model

    model = model_dir.resolve() if model_dir else ensure_embedded_model()
    key = "tdm_bench-" + secrets.token_hex(16)
    home = data_dir() / "bench" / secrets.token_hex(3)
    envs = ({}, {"CUDA_VISIBLE_DEVICES": ""} if b_cpu_only else {})
    agent_args = ("--staging-bytes", staging) if staging else ()
    with cluster(model, engines, net, home, key, pin, dirs, envs, encodings, cores_per_agent, agent_args) as c:
        agents = c.agents
        result["model"] = str(model)
        result["vocab"] = inspect_model(model).vocab_size
        # kept over every pair of a --fast-prefiller run (each pair's cells are measured before the next)
        result.setdefault("agents", []).extend(
            {"name": a.name, "engine": a.engine, "url": a.url, "cpus": a.cpus, "accelerator": a.info.get("accelerator")}
            for a in agents
        )
        with console.status("measuring the link (raw TCP and the page stream) and one decode step per engine…"):
            result.setdefault("link_measured", {}).update(measure_links(c, net, dirs, key))
            steps = {a.name: decode_step_seconds(a, key, result["vocab"]) for a in agents}
            result.setdefault("decode_step_seconds", {}).update(steps)
        columns = [Column(f"node/{a.name}", None, a) for a in agents] if alone else []
        columns += [
            Column(f"{agents[p].name}->{agents[d].name}{suffix}", agents[p], agents[d], encoding)
            for encoding in encodings
            for suffix in ["" if encoding == "raw" else f"+{encoding}"]
            for p, d in dirs
        ]

        def link_seconds(p, d, nbytes: int) -> tuple[float, str]:
            return min(raw_stream(p.place, d.place, nbytes, (p.cpus, d.cpus), count=3)), "raw TCP, fastest of 3"

        measure(result, c.url, c.api_key, key, columns, link_seconds, save)


def measure_links(c: Cluster, net: Link, dirs: list[tuple[int, int]], key: str) -> dict:
    """Each direction's raw TCP throughput and round trip, and the page stream on the same link,
    same size, same pinning (for the table's header: the bound's link term is measured per cell).
    The best of three of each: single pulls are noisy (on this 2-core VM at 1,170 MB/s, pulls of
    one link ranged 0.36-1.19x raw TCP; bench/bench_page_stream_shaped.py)."""
    agents, mb = c.agents, 64 if net.kind == "shaped" else 512
    measured = {}
    for p, d in dirs:
        m = raw_tcp(net.places[p], net.places[d], mb, (agents[p].cpus, agents[d].cpus), count=3)
        m["page_stream"] = max(
            (page_stream(agents[p].url, agents[p].info, net.places[d], key, mb, agents[d].cpus) for _ in range(3)),
            key=lambda r: r["bytes_per_second"],
        )
        m["page_stream_over_raw_tcp"] = m["page_stream"]["bytes_per_second"] / m["bytes_per_second"]
        measured[f"{agents[p].name}->{agents[d].name}"] = m
    if net.kind == "shaped":
        measured |= {
            "configured_rate_bytes_per_second": net.rate_mbytes * 1e6,
            "asked_delay_ms": net.asked_delay_ms,
            "emulated_delay_ms": net.delay_ms,
        }
    return measured
