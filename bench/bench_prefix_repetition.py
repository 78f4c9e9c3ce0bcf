"""Prefix reuse under vLLM's own load client (issue 20): `vllm bench serve --dataset-name
prefix_repetition` against the panel's model served by a pool of two agents (torch→MLX by
default, `--engines vllm,vllm` for a vLLM→vLLM pool), with the agents' prefix caches on, then off
(`POST /v1/config {prefix_cache_bytes: 0}`; vLLM restarts to turn its own off), in the same run on
the same agents. Prints each run's TTFT p50 and p99 and the ratio on ÷ off; stores vLLM's output
beside a JSON and markdown summary in bench/results/prefix-repetition-<time>.*.

    .venv/bin/python bench/bench_prefix_repetition.py [--engines torch,mlx] [--prefix-len 1024
        --suffix-len 64 --prefixes 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_serving import run_vllm_bench  # noqa: E402

from engine_adapters.embedded_model import fetch  # noqa: E402
from tandem_cli.processes import ServiceProcess, agent_serve_args  # noqa: E402
from tandem_protocol.client import AgentClient  # noqa: E402
from tandem_protocol.settings import data_dir  # noqa: E402

KEY = "tdm_bench-prefix-rep-0123456789abcdef"
RESULTS = REPO / "bench" / "results"


def bench_serve(panel_url: str, api_key: str, model: Path, args: argparse.Namespace) -> tuple[str, dict]:
    """One `vllm bench serve` run; its output and the TTFT figures it printed (ms)."""
    cli = [
        *("--backend", "openai-chat", "--base-url", panel_url, "--endpoint", "/v1/chat/completions"),
        *("--model", "pool", "--tokenizer", str(model), "--dataset-name", "prefix_repetition"),
        *(
            "--prefix-repetition-prefix-len",
            str(args.prefix_len),
            "--prefix-repetition-suffix-len",
            str(args.suffix_len),
        ),
        *("--prefix-repetition-num-prefixes", str(args.prefixes), "--prefix-repetition-output-len", "32"),
        *("--num-prompts", str(args.prompts), "--max-concurrency", str(args.concurrency), "--ignore-eos"),
        *("--seed", "0", "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,99"),
    ]
    stdout, text = run_vllm_bench(api_key, cli)
    figures = {
        key: float(m.group(1))
        for key, pattern in (
            ("ttft_p50_ms", r"P50 TTFT \(ms\):\s+([\d.]+)"),
            ("ttft_p99_ms", r"P99 TTFT \(ms\):\s+([\d.]+)"),
            ("ttft_mean_ms", r"Mean TTFT \(ms\):\s+([\d.]+)"),
            ("successful", r"Successful requests:\s+(\d+)"),
            ("output_tok_s", r"Output token throughput \(tok/s\):\s+([\d.]+)"),
        )
        if (m := re.search(pattern, stdout))
    }
    return text, figures


async def set_cache(url: str, capacity: int | None) -> None:
    agent = AgentClient(url, KEY)
    try:
        info = await agent.info()
        body = {"engine": info["engine"], "model_path": info["model_path"], "prefix_cache_bytes": capacity}
        await agent.configure(**body)
    finally:
        await agent.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="torch,mlx", help="the pool's prefiller and decoder engines")
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--prefixes", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()
    model, _ = fetch(data_dir())
    RESULTS.mkdir(parents=True, exist_ok=True)
    engines = args.engines.split(",")
    pool = "→".join({"mlx": "MLX", "vllm": "vLLM"}.get(e, e) for e in engines)
    stem = RESULTS / f"prefix-repetition-{'-'.join(engines)}-{time.strftime('%Y%m%d-%H%M%S')}"
    home = Path(tempfile.mkdtemp(prefix="tandem-bench-prefix-rep-"))
    summary = {"model": model.name, "args": vars(args), "runs": {}}
    with ExitStack() as stack:
        urls = {}
        for role, engine in zip(("p", "d"), engines, strict=True):
            proc = ServiceProcess(
                agent_serve_args(engine, model, "--name", f"rep-{role}-{engine}"),
                env={"TANDEM_HOME": str(home / role), "TANDEM_CLUSTER_KEY": KEY},
            )
            stack.callback(proc.stop)
            urls[role] = proc
        for role, proc in urls.items():
            urls[role] = proc.wait_ready(900)
        panel = ServiceProcess(
            [
                "panel",
                "--port",
                "0",
                "--no-mdns",
                "--api-key",
                "bench",
                "--pair",
                f"pool={urls['p']},{urls['d']}",
            ],
            env={"TANDEM_HOME": str(home / "panel"), "TANDEM_CLUSTER_KEY": KEY, "COLUMNS": "300"},
        )
        stack.callback(panel.stop)
        panel_url = panel.wait_ready()
        api_key = panel.lines_matching("API key")[-1].rsplit(": ", 1)[1].strip()
        outputs = []
        for reuse in ("on", "off"):
            if reuse == "off":
                for url in urls.values():
                    asyncio.run(set_cache(url, 0))
            text, figures = bench_serve(panel_url, api_key, model, args)
            outputs.append(f"## reuse {reuse}\n{text}")
            summary["runs"][reuse] = figures
            print(f"reuse {reuse}: {figures}", flush=True)
    on, off = summary["runs"]["on"], summary["runs"]["off"]
    lines = [
        f"# prefix_repetition through the panel's {pool} pool, {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        f"{args.prefixes} prefixes of {args.prefix_len} tokens, {args.suffix_len}-token suffixes, "
        f"{args.prompts} prompts at concurrency {args.concurrency}, 32 output tokens; loopback; command: "
        f"`.venv/bin/python {' '.join(['bench/bench_prefix_repetition.py', *sys.argv[1:]])}`",
        "",
        "| reuse | successful | TTFT p50 ms | TTFT p99 ms | output tok/s |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {k} | {v.get('successful', 0):.0f} | {v.get('ttft_p50_ms', 0):.0f} | {v.get('ttft_p99_ms', 0):.0f} "
            f"| {v.get('output_tok_s', 0):.1f} |"
            for k, v in summary["runs"].items()
        ),
        "",
    ]
    if on.get("ttft_p50_ms") and off.get("ttft_p50_ms"):
        ratio = on["ttft_p50_ms"] / off["ttft_p50_ms"], on["ttft_p99_ms"] / off["ttft_p99_ms"]
        summary["on_over_off"] = {"ttft_p50": ratio[0], "ttft_p99": ratio[1]}
        lines.append(f"TTFT on ÷ off: p50 {ratio[0]:.2f}, p99 {ratio[1]:.2f}")
    Path(f"{stem}.md").write_text("\n".join(lines) + "\n")
    Path(f"{stem}.json").write_text(json.dumps(summary, indent=2))
    Path(f"{stem}.vllm-bench.txt").write_text("\n\n".join(outputs))
    print("\n".join(lines))
    print(f"wrote {stem}.{{md,json,vllm-bench.txt}}")


if __name__ == "__main__":
    main()
