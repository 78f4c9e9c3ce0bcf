"""Planner regret (issue 20): over prompt lengths x cached prefix, run every feasible route of a
torch -> MLX pool and the route the planner picks, in the same run; the planner's TTFT against the
best route's.

Two agents (torch prefills fast here, MLX's CPU prefill is slower: the desk the planner exists
for), one panel with three models on them: `planner` (the pool as users get it, no threshold: the
planner estimates every route), `forced-pd` (the same nodes with threshold 1: always P/D) and
`node/<mlx>` (the decoder alone). Per cell (L tokens, a fraction c of them cached): a prefix of
c x L tokens is first sent P/D, so both nodes hold it (`--cached-on both`), or to the decoder
alone, so only it holds it (`--cached-on decoder`: a conversation the prefiller never saw); then each model gets the prefix and a
suffix of its own (nothing past the prefix is cached anywhere), one request each, the nodes idle
in between (the router measures idle nodes: a calibration prompt, a link probe). Regret = the
TTFT of the route the planner chose ÷ the best of P/D and D alone, both as measured on the forced
models (so a cell where it chose the best route is 1.00; one sample per route is noisy); goal
≤ 1.1 in ≥ 90 % of cells. The planner's own request's TTFT ÷ the best is printed beside it. The planner's route,
predicted TTFT and reason come from the panel's request log. `--link shaped` puts the agents in
network namespaces joined by a veth shaped to `--rate` MB/s (root), as `tandem bench ttft` does.
Results: bench/results/planner-<link>-<time>.{json,md}.

    .venv/bin/python bench/bench_planner.py [--lengths 64,512,2048,6000] [--cached 0,0.5,0.95] [--link shaped]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_turns import torch_and_mlx_agents  # noqa: E402

from engine_adapters.embedded_model import fetch  # noqa: E402
from tandem_cli.bench_ttft.probe_agents import prompt_ids, set_prefix_cache, ttft  # noqa: E402
from tandem_cli.processes import ServiceProcess  # noqa: E402
from tandem_protocol.model_dir import inspect_model  # noqa: E402
from tandem_protocol.settings import data_dir  # noqa: E402

KEY = "tdm_bench-planner-0123456789abcd"
RESULTS = REPO / "bench" / "results"
REGRET_GOAL, CELLS_GOAL = 1.1, 0.9
ROUTES = ("forced-pd", "alone", "planner")


def log_row(panel_home: Path, after_id: int) -> dict:
    """The newest request log row past `after_id` (the request just answered)."""
    from sqlmodel import Session, create_engine, select

    from control_panel.models import RequestLog

    with Session(create_engine(f"sqlite:///{panel_home / 'panel.db'}")) as s:
        row = s.exec(select(RequestLog).where(RequestLog.id > after_id).order_by(RequestLog.id.desc())).first()
        return row.model_dump() if row else {}


def last_id(panel_home: Path) -> int:
    return log_row(panel_home, -1).get("id", 0)


def idle(agents: list[str], settle: float = 0.5) -> None:
    """Until both agents run nothing (the router's measuring included), twice `settle` apart."""
    quiet = 0
    while quiet < 2:
        busy = False
        for url in agents:
            s = httpx.get(url + "/v1/status", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
            busy |= bool(s["active_requests"] or s["open_handoffs"])
        quiet = 0 if busy else quiet + 1
        time.sleep(settle)


def clear_prefix_cache(url: str) -> None:
    """Empty a node's prefix cache (its budget to 0 and back)."""
    headers = {"Authorization": f"Bearer {KEY}"}
    status = httpx.get(url + "/v1/status", headers=headers, timeout=30).json()
    for nbytes in (0, status["prefix_cache"]["capacity"]):
        set_prefix_cache(url, headers, status, nbytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="64,512,2048,6000")
    parser.add_argument("--cached", default="0,0.5,0.95")
    parser.add_argument("--cached-on", choices=("both", "decoder"), default="both")
    parser.add_argument("--link", choices=("loopback", "shaped"), default="loopback")
    parser.add_argument("--rate", type=float, default=85.0, help="MB/s of the shaped link")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    fractions = [float(x) for x in args.cached.split(",")]
    model, _ = fetch(data_dir())
    vocab = inspect_model(model).vocab_size
    link_name = args.link if args.link == "loopback" else f"shaped {args.rate:g} MB/s"
    result = {"model": model.name, "link": link_name, "cached_on": args.cached_on, "cells": []}
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"planner-{args.link}-cached-on-{args.cached_on}-{time.strftime('%Y%m%d-%H%M%S')}"
    home = Path(tempfile.mkdtemp(prefix="tandem-bench-planner-"))
    with ExitStack() as stack:
        urls = torch_and_mlx_agents(stack, args.link, args.rate, model, home, KEY, "planner")
        p, d = urls["torch"], urls["mlx"]
        panel = ServiceProcess(
            ["panel", "--port", "0", "--no-mdns", "--api-key", "bench"]
            + ["--pair", f"planner={p},{d}", "--pair", f"forced-pd={p},{d},threshold=1"],
            env={"TANDEM_HOME": str(home / "panel"), "TANDEM_CLUSTER_KEY": KEY, "COLUMNS": "300"},
        )
        stack.callback(panel.stop)
        http = httpx.Client(
            base_url=panel.wait_ready(),
            headers={"Authorization": f"Bearer {panel.lines_matching('API key')[-1].rsplit(': ', 1)[1].strip()}"},
            timeout=900,
        )
        models = {"forced-pd": "forced-pd", "alone": "node/planner-mlx", "planner": "planner"}
        panel_home = home / "panel" / "panel"

        # the router measures both nodes and their link once a request has used them
        ttft(http, "planner", prompt_ids(512, 1, vocab), 2)
        idle([p, d])
        for n in lengths:
            for c in fractions:
                seed = hash((n, c)) & 0xFFFF
                prefix = prompt_ids(int(c * n), seed, vocab) if c else []
                if prefix:  # both nodes hold it (P computed it, D imported it), or D alone computed it
                    warm = "forced-pd" if args.cached_on == "both" else "alone"
                    ttft(http, models[warm], prefix + prompt_ids(1, seed + 1, vocab), 1)
                    idle([p, d])
                cell = {"tokens": n, "cached_fraction": c, "cached_tokens": len(prefix)}
                # prefix on D only: P's cache is emptied before each route, the planner first (so
                # the router has not yet sent P this prefix: what it believes is true)
                order = ROUTES if args.cached_on == "both" else ("planner", "alone", "forced-pd")
                for route in order:
                    if args.cached_on == "decoder":
                        clear_prefix_cache(p)
                    ids = prefix + prompt_ids(n - len(prefix), seed + 10 + ROUTES.index(route), vocab)
                    before = last_id(panel_home)
                    cell[route] = ttft(http, models[route], ids, 4)
                    row = log_row(panel_home, before)
                    if route == "planner":
                        cell["planner_route"] = row.get("route")
                        cell["predicted"] = (row.get("predicted_ttft_ms") or 0) / 1000 or None
                        cell["reason"] = row.get("reason")
                    idle([p, d])
                best = min(cell["forced-pd"], cell["alone"])
                cell["best"] = "pd" if cell["forced-pd"] <= cell["alone"] else "decode_alone"
                chosen = cell["forced-pd"] if cell["planner_route"] == "pd" else cell["alone"]
                cell["regret"] = chosen / best
                cell["planner_over_best"] = cell["planner"] / best
                result["cells"].append(cell)
                print(
                    f"{n:5d} tokens, {c:4.0%} cached: P/D {cell['forced-pd']:.2f} s, alone {cell['alone']:.2f} s, "
                    f"planner {cell['planner_route']} {cell['planner']:.2f} s (predicted {cell['predicted']}), "
                    f"regret {cell['regret']:.2f} (its own request ÷ best {cell['planner_over_best']:.2f})",
                    flush=True,
                )
                write(result, stem)
    print(write(result, stem))


def write(result: dict, stem: Path) -> str:
    cells = result["cells"]
    ok = [c for c in cells if c["regret"] <= REGRET_GOAL]
    lines = [
        f"Planner regret, torch -> MLX pool, {result['link']} link, cached prefix on {result['cached_on']} "
        f"({result['model']}); one request per route "
        "per cell, nodes idle in between. Regret = the TTFT of the route the planner chose ÷ the best route's "
        "(both as measured on the forced models); the planner's own request ÷ the best beside it.",
        "",
        "| tokens | cached | P/D s | D alone s | best | planner's route | regret | planner's request s | ÷ best | "
        "predicted s |",
        "|---:|---:|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for c in cells:
        pred = f"{c['predicted']:.2f}" if c["predicted"] else "–"
        lines.append(
            f"| {c['tokens']} | {c['cached_fraction']:.0%} | {c['forced-pd']:.2f} | {c['alone']:.2f} | {c['best']} |"
            f" {c['planner_route']} | {c['regret']:.2f} | {c['planner']:.2f} | {c['planner_over_best']:.2f} | {pred} |"
        )
    share = len(ok) / len(cells) if cells else 0
    verdict = "met" if share >= CELLS_GOAL else "NOT met"
    lines += [
        "",
        f"Cells with regret ≤ {REGRET_GOAL}: {len(ok)} of {len(cells)} = {share:.0%} (goal ≥ 90 %: {verdict})",
    ]
    errors = [abs(c["predicted"] / c["planner"] - 1) for c in cells if c["predicted"]]
    if errors:
        lines.append(f"Predicted ÷ actual TTFT of the planner's route: median error {np.median(errors):.0%}")
    text = "\n".join(lines) + "\n"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2))
    stem.with_suffix(".md").write_text(text)
    return text


if __name__ == "__main__":
    main()
