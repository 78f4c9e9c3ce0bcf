"""The cells of one run: TTFT through the panel, and for P->D cells each request's lower bound.

The bound of one P/D request is a time that request cannot have been shorter than:

    bound = max(prefill term, link term) + D's step (recompute-last decoders only)

- prefill term: P's own timing of that very request, the prefill_seconds it put in the request's
  final frame (read as the difference of P's prefill histogram on /metrics before and after the
  request; a request that did not go through P has no bound and is counted as a fallback);
- link term: a raw TCP stream of the bytes P sent for the request (its page-bytes counter: frames
  as framed on the wire, compressed ones in +zstd cells) over the same path, between the same
  CPUs, measured in the same run, right after the cell: the fastest of three;
- D's step: a recompute-last decoder (vLLM's way) runs the last prompt token after the last page
  arrives, one forward; the fastest token gap of D alone, measured in this run. A commit-first
  decoder has its first token in P's final frame: nothing is counted.

Each term is a part of the request's own time, so TTFT ÷ bound >= 1 whatever the machine's load,
up to clock noise: a cell whose smallest ratio is under MIN_RATIO is flagged as an invalid bound.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from .cluster import Agent
from .probe_agents import prefiller_counters, prompt_ids, trace_held_on_p, trace_pd, ttft

MIN_RATIO = 0.98  # TTFT ÷ bound under this: the bound is not a lower bound


@dataclass
class Column:
    name: str  # the model's name on the panel
    p: Agent | None  # None: an engine alone
    d: Agent
    encoding: str = "raw"


# (P, D, bytes) -> (seconds those bytes take on P's link to D, how that was measured)
LinkSeconds = Callable[[Agent, Agent, int], tuple[float, str]]


@dataclass
class Sample:
    ttft: float
    prefill_seconds: float | None = None  # P's own, None where the request did not go P->D
    wire_bytes: int = 0
    pages: int = 0


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "samples": values}


def measure(
    result: dict,
    panel: str,
    api_key: str,
    key: str,
    columns: list[Column],
    link: LinkSeconds,
    on_cell: Callable[[], None] = lambda: None,
) -> None:
    """The TTFT samples of every cell (prompt length x column) through the panel, one request at
    a time, and for P->D columns each sample's bound and (where result["trace"]) one traced
    request; appended to result["cells"], `on_cell` called after each (a long run keeps what it
    measured)."""
    from rich.progress import Progress

    from ..progress import console

    sizes, samples, warmup = result["lengths"], result["samples"], result["warmup"]
    http = httpx.Client(base_url=panel, headers={"Authorization": f"Bearer {api_key}"}, timeout=600)
    try:
        with Progress(console=console) as bar:
            task = bar.add_task("TTFT", total=len(sizes) * len(columns) * (samples + warmup))
            for n in sizes:
                for col in columns:
                    taken = []
                    for k in range(warmup + samples):
                        ids = prompt_ids(n, hash((n, col.name, k)) & 0xFFFFFFFF, result["vocab"])
                        sample = timed_request(http, col, ids, result["max_tokens"], key)
                        if k >= warmup:
                            taken.append(sample)
                        bar.advance(task)
                    result["cells"].append(cell(result, col, n, taken, key, link))
                    on_cell()
    finally:
        http.close()


def timed_request(http: httpx.Client, col: Column, ids: list[int], max_tokens: int, key: str) -> Sample:
    if col.p is None:
        return Sample(ttft(http, col.name, ids, max_tokens))
    before = prefiller_counters(col.p, key)
    t = ttft(http, col.name, ids, max_tokens)  # reads the whole stream: P is done with it after
    after = prefiller_counters(col.p, key)
    if after.prefills != before.prefills + 1:  # the panel fell back to D alone (or P served another)
        return Sample(t)
    return Sample(
        t,
        after.prefill_seconds - before.prefill_seconds,
        int(after.bytes_sent - before.bytes_sent),
        int(after.pages_sent - before.pages_sent),
    )


def cell(result: dict, col: Column, n: int, taken: list[Sample], key: str, link: LinkSeconds) -> dict:
    out = {"tokens": n, "column": col.name, "ttft": summary([s.ttft for s in taken])}
    if col.p is None:
        return out
    pd = [s for s in taken if s.prefill_seconds is not None]
    out["decoder"] = col.d.name  # its alone column is node/<decoder>, in either kind of run
    out["fell_back"] = len(taken) - len(pd)
    out["trace"] = traced(result, col, n, key) if result["trace"] else {}
    if result["trace"]:
        # 64k + 1 tokens: every page P sends a recompute-last decoder comes from its cache; a
        # commit-first decoder's last page holds the last token, which P computes after the rest
        ids = prompt_ids(max(n - 1, 64) // 64 * 64 + 1, 40_000 + n, result["vocab"])
        out["held_on_p"] = trace_held_on_p(col.p, col.d, key, ids, result["max_tokens"], col.encoding)
    if not pd:
        out.update(bound=None, invalid_bound=True, ttft_over_bound=None, ttft_minus_own_prefill=None)
        return out
    out["bound"] = bound_terms(col, pd, result["decode_step_seconds"][col.d.name]["min"], link)
    ratios = [s.ttft / b for s, b in zip(pd, out["bound"]["samples"])]
    out["ttft_over_bound"] = min(ratios)  # the strictest sample: each one's bound must hold
    out["ttft_over_bound_samples"] = ratios
    out["invalid_bound"] = min(ratios) < MIN_RATIO
    out["ttft_minus_bound_ms"] = (out["ttft"]["median"] - out["bound"]["seconds"]) * 1000
    # what the product adds to P's prefill of the same request
    out["ttft_minus_own_prefill"] = summary([s.ttft - s.prefill_seconds for s in pd])
    if "parts" in out["trace"]:  # what the panel adds on top of the agents' own path
        out["trace"]["parts"]["panel and client"] = out["ttft"]["median"] - out["trace"]["total_seconds"]
    return out


def bound_terms(col: Column, pd: list[Sample], d_step_min: float, link: LinkSeconds) -> dict:
    mode = col.d.info["decoder_modes"][0]
    # fewest bytes any of the cell's requests sent: the link term is a lower bound for every one
    wire = min(s.wire_bytes for s in pd)
    link_seconds, method = link(col.p, col.d, wire)
    d_step = d_step_min if mode == "recompute-last" else 0.0
    prefills = [s.prefill_seconds for s in pd]
    bounds = [max(p, link_seconds) + d_step for p in prefills]
    return {
        "seconds": statistics.median(bounds),
        "samples": bounds,
        "prefill_seconds": statistics.median(prefills),
        "prefill_samples": prefills,
        "prefill_source": "P's own timing of each request (its final frame's prefill_seconds)",
        "wire_bytes": wire,
        "pages": min(s.pages for s in pd),
        "link_seconds": link_seconds,
        "link_method": method,
        "mode": mode,
        "decoder": col.d.name,
        "decode_step_seconds": d_step,
    }


def traced(result: dict, col: Column, n: int, key: str) -> dict:
    """One more P/D request, straight to the agents, for where its time goes."""
    t = trace_pd(col.p, col.d, key, prompt_ids(n, 30_000 + n, result["vocab"]), result["max_tokens"], col.encoding)
    if "wire_bytes" in t:  # raw FP16 bytes of its pages over what they took on the wire
        from tandem_protocol.pages import HEADER_SIZE

        t["wire_ratio"] = t["pages"] * (int(col.p.info["page_bytes"]) + HEADER_SIZE) / t["wire_bytes"]
    return t
