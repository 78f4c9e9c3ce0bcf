"""The outputs of one run: ttft-<link>-<time>.json (every sample and every bound term), .md
(the tables) and .png (TTFT and bound against prompt length), and the copy the panel shows."""

from __future__ import annotations

import json
import time
from pathlib import Path

from control_panel.bench_results import LATEST_TTFT
from tandem_protocol.settings import data_dir

from .measure import MIN_RATIO


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}"


def cell_row(c: dict) -> str:
    t = c["ttft"]
    row = f"| {c['tokens']} | {c['column']} | {ms(t['median'])} ({ms(t['min'])}–{ms(t['max'])}) |"
    if "bound" not in c:  # an engine alone
        return row + " |" * 8
    b = c["bound"]
    if b is None:
        return row + " | | | | | | | INVALID: no request went P->D |"
    o, d = c["ttft_minus_own_prefill"], b["decode_step_seconds"]
    verdict = f"INVALID (under {MIN_RATIO})" if c["invalid_bound"] else "ok"
    fell = f", {c['fell_back']} fell back" if c["fell_back"] else ""
    return row + (
        f" {ms(b['seconds'])} | {c['ttft_over_bound']:.2f} | {ms(b['prefill_seconds'])} |"
        f" {b['link_seconds'] * 1000:.1f} | {b['wire_bytes'] / 1e6:.1f} | {f'{d * 1000:.1f}' if d else '–'} |"
        f" {o['median'] * 1000:+.0f} ({o['min'] * 1000:+.0f}–{o['max'] * 1000:+.0f}) | {verdict}{fell} |"
    )


def markdown_table(result: dict) -> str:
    rows = [
        "| tokens | column | TTFT median ms (min–max) | bound median ms | TTFT ÷ bound (lowest sample) | "
        "prefill term ms (P's own, median) | link term ms (raw TCP of the wire bytes) | wire MB | "
        "D step ms (recompute-last) | TTFT − P's own prefill ms, median (min–max) | bound |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        *(cell_row(c) for c in result["cells"]),
    ]
    invalid = [c for c in result["cells"] if c.get("invalid_bound")]
    rows += [
        "",
        f"**{len(invalid)} cells with an invalid bound** (TTFT ÷ bound under {MIN_RATIO} in some sample): "
        + ", ".join(f"{c['tokens']} {c['column']}" for c in invalid)
        if invalid
        else f"Every P/D sample's TTFT ÷ bound is at least {MIN_RATIO}.",
    ]
    rows += alone_table(result)
    rows += trace_table(result)
    rows += import_table(result)
    return header(result) + "\n".join(rows) + "\n"


def alone_table(result: dict) -> list[str]:
    """Each P/D cell against its decoder alone at the same length, measured in the same cluster
    (the nearest alone cell before it): does P/D pay off?"""
    rows = []
    for i, c in enumerate(result["cells"]):
        if "bound" not in c:
            continue
        decoder = f"node/{c['decoder']}"
        alone = [a for a in result["cells"][:i] if a["column"] == decoder and a["tokens"] == c["tokens"]]
        if alone:
            d = alone[-1]["ttft"]["median"]
            rows.append(
                f"| {c['tokens']} | {c['column']} | {ms(c['ttft']['median'])} | {ms(d)} | {c['ttft']['median'] / d:.2f} |"
            )
    if not rows:
        return []
    return [
        "",
        "P/D against the decoder alone (TTFT medians)",
        "",
        "| tokens | column | P/D ms | decoder alone ms | P/D ÷ alone |",
        "|---:|---|---:|---:|---:|",
        *rows,
    ]


def header(result: dict) -> str:
    link = ", ".join(
        f"{k}: {v['bytes_per_second'] / 1e6:.0f} MB/s {v.get('method', 'raw TCP')}, "
        f"RTT {v['rtt_seconds'] * 1e3:.2f} ms"
        + (
            f", page stream {v['page_stream']['bytes_per_second'] / 1e6:.0f} MB/s = "
            f"{v['page_stream_over_raw_tcp']:.2f}x raw TCP"
            if "page_stream" in v
            else ""
        )
        for k, v in result["link_measured"].items()
        if isinstance(v, dict)
    )
    lm = result["link_measured"]
    if "asked_delay_ms" in lm:
        link += (
            f"; delay each way {lm['emulated_delay_ms']} ms (netem)"
            if lm["emulated_delay_ms"]
            else f"; delay {lm['asked_delay_ms']} ms asked, not emulated (no netem on this kernel)"
        )
    load = result.get("load_average")
    load = f"; load average {load['start']:.1f} at the start, {load['end']:.1f} at the end" if load else ""
    staging = f"; staging budget {result['staging']}" if result.get("staging") else ""
    return (
        f"TTFT through the panel ({result['link']} link; {link}; agents pinned: {result['pinned']}{load}{staging}; "
        f"{result['samples']} samples after {result['warmup']} warm-up, {result['max_tokens']} tokens)\n\n"
        "bound = max(P's own prefill of the same request, raw TCP stream of the same wire bytes on the same "
        "path) + D's step where D recomputes the last prompt token; TTFT ÷ bound is the lowest of the cell's "
        "samples, each against its own bound."
        + (
            " With --panel the link term is the wire bytes at the page stream's measured rate (nothing runs on "
            "the agents' machines to stream raw TCP).\n\n"
            if result["link"] == "panel"
            else "\n\n"
        )
    )


DECODER_STAGES = (
    "first page to last page",
    "last page to first token",
    "last page to imported",
    "imported to first computed token",
)


def trace_table(result: dict) -> list[str]:
    traces = [c for c in result["cells"] if c.get("trace", {}).get("parts")]
    rows = []
    if traces:
        names = list(traces[0]["trace"]["parts"])
        rows += [
            "",
            "Where the time of one P/D request goes (ms; one traced request per cell, agents' clocks)",
            "",
            "| tokens | column | "
            + " | ".join(names)
            + " | raw FP16 bytes ÷ wire bytes | "
            + " | ".join(f"D: {k}" for k in DECODER_STAGES)
            + " |",
            "|---:|---|" + "---:|" * (len(names) + 1 + len(DECODER_STAGES)),
        ]
        for c in traces:
            stages = c["trace"].get("decoder", {})
            rows.append(
                f"| {c['tokens']} | {c['column']} | "
                + " | ".join(f"{c['trace']['parts'][k] * 1000:.1f}" for k in names)
                + f" | {c['trace'].get('wire_ratio', 0):.2f} | "
                + " | ".join(f"{stages[k] * 1000:.1f}" if k in stages else "–" for k in DECODER_STAGES)
                + " |"
            )
    for c in result["cells"]:
        if c.get("trace", {}).get("error"):
            rows.append(f"\nThe traced request at {c['tokens']} tokens, {c['column']}, failed: {c['trace']['error']}")
    return rows


IMPORT_GOAL = 1e9  # bytes/s: issue 18's goal for every decoder on loopback


def import_table(result: dict) -> list[str]:
    """Each decoder's import rate with the pages already on P (probe_agents.trace_held_on_p)."""
    held = [c for c in result["cells"] if c.get("held_on_p")]
    if not held:
        return []
    rows = [
        "",
        "The decoder's import with every page already on P (P's prefix cache held the prompt, 64k + 1 tokens "
        "long; P computed only its last token, which a commit-first decoder's last page carries): arrival = wire bytes ÷ (first page -> last page on D), import = wire bytes ÷ (first "
        f"page -> every page in D's engine cache){', goal ≥ 1 GB/s on loopback' if result['link'] == 'loopback' else ''}",
        "",
        "| tokens (probe) | column | pages | wire MB | tokens cached on P | arrival GB/s | import GB/s | last page -> imported ms |"
        + (" goal |" if result["link"] == "loopback" else ""),
        "|---:|---|---:|---:|---:|---:|---:|---:|" + ("---|" if result["link"] == "loopback" else ""),
    ]
    for c in held:
        h = c["held_on_p"]
        if "error" in h:
            rows.append(f"| {c['tokens']} | {c['column']} | failed: {h['error'][:200]} |")
            continue
        rate = h["import_bytes_per_second"]
        goal = (" met |" if rate and rate >= IMPORT_GOAL else " NOT met |") if result["link"] == "loopback" else ""
        rows.append(
            f"| {c['tokens']} ({h['prompt_tokens']}) | {c['column']} | {h['pages']} | {h['wire_bytes'] / 1e6:.1f} | {h['cached_tokens_on_p']} |"
            f" {(h['arrival_bytes_per_second'] or 0) / 1e9:.2f} | {(rate or 0) / 1e9:.2f} |"
            f" {h['last_page_to_imported_seconds'] * 1000:.1f} |{goal}"
        )
    return rows


def output_stem(out: Path, link: str) -> Path:
    return out / f"ttft-{link}-{time.strftime('%Y%m%d-%H%M%S')}"


def write_outputs(result: dict, stem: Path, panel_dir: Path | None = None) -> list[Path]:
    """The run's files at `stem` (.json, .md, .png), written again as cells are added."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_suffix(".json"), stem.with_suffix(".md"), stem.with_suffix(".png")]
    paths[0].write_text(json.dumps(result, indent=2))
    paths[1].write_text(markdown_table(result))
    plot(result, paths[2])
    # the panel on this machine shows the latest run on its Requests page
    panel_dir = panel_dir or data_dir() / "panel"
    (panel_dir / LATEST_TTFT).parent.mkdir(parents=True, exist_ok=True)
    (panel_dir / LATEST_TTFT).write_text(json.dumps(result))
    return paths


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    columns = sorted({c["column"] for c in result["cells"]})
    for col in columns:
        cells = [c for c in result["cells"] if c["column"] == col]
        ax.plot(
            [c["tokens"] for c in cells], [c["ttft"]["median"] * 1000 for c in cells], marker="o", label=f"{col} TTFT"
        )
        bounded = [c for c in cells if c.get("bound")]
        if bounded:
            xs, ys = [c["tokens"] for c in bounded], [c["bound"]["seconds"] * 1000 for c in bounded]
            ax.plot(xs, ys, linestyle="--", label=f"{col} bound")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (ms)")
    who = ", ".join(f"{a['name']} on {(a.get('accelerator') or {}).get('kind', '?')}" for a in result.get("agents", []))
    ax.set_title(f"Tandem TTFT, {result['link']} link ({who})", fontsize="medium")
    ax.legend(fontsize="small")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
