"""Conversations (issue 20): TTFT and bytes on the wire per turn of a chat whose history grows,
through Tandem's pair and MLX node with their prefix caches, against mlx_lm.server (its own prompt
cache) on the same model, cores and chat, in the same run.

A ~2,000-token system prompt, then six user turns of ~40 tokens; each answer (32 tokens, greedy)
goes back into the chat, as chat clients do. Per target and turn it prints the TTFT, the prompt
tokens a cache served (`usage.prompt_tokens_details.cached_tokens`; mlx_lm.server's as it reports
them), and for the pair the page bytes P sent (its agent's `bytes_sent` before and after), beside
the KV bytes of the tokens new to the turn. Ratios: turns 2-6 ÷ turn 1 (goal ≤ 0.25 on the pair),
bytes sent ÷ (new tokens' KV + 2 pages) (goal ≤ 1), Tandem's MLX node ÷ mlx_lm.server on turns
2-6 (goal ≤ 1.1) and the pair's turn 1 ÷ mlx_lm.server's. `--link shaped` puts the two agents
in network namespaces joined by a veth shaped to `--rate` MB/s (root; tandem_cli/netns.py), as
`tandem bench ttft` does; mlx_lm.server and the panel stay in the root namespace. Results go to
bench/results/turns-<time>.{json,md}.

    .venv/bin/python bench/bench_turns.py [--turns 6] [--system-tokens 2000] [--link shaped --rate 85]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from openai import OpenAI

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_serving import start_mlx_lm_server  # noqa: E402

from engine_adapters.embedded_model import fetch  # noqa: E402
from tandem_cli.bench_ttft.link import loopback_link, random_block, shaped_link  # noqa: E402
from tandem_cli.processes import ServiceProcess, agent_serve_args  # noqa: E402
from tandem_protocol.client import AgentClient  # noqa: E402
from tandem_protocol.model_dir import inspect_model  # noqa: E402
from tandem_protocol.settings import data_dir  # noqa: E402
from tests.conftest import LONG_TEXT  # noqa: E402

KEY = "tdm_bench-turns-0123456789abcdef"
RESULTS = REPO / "bench" / "results"
QUESTIONS = [
    "Summarise the first paragraph of the text above in one sentence, please, using plain words.",
    "Which person or thing does the text mention most often? Answer with a name and one reason.",
    "Give me three keywords from the middle of the text, separated by commas, and nothing else.",
    "Rewrite your previous answer so that a ten-year-old child would understand every word of it.",
    "Does the text say anything about time or dates? Quote the words if it does, otherwise say no.",
    "Thank you. Now list two questions a reader might still have after reading the whole text.",
    "Which sentence of the text would you cut first if it had to be shorter? Explain in a few words.",
    "Write a title for the text of at most eight words, then say why you chose it in one sentence.",
]


def system_prompt(tokenizer, tokens: int) -> str:
    ids = tokenizer.encode((LONG_TEXT + " ") * 20, add_special_tokens=False)[:tokens]
    return "You answer questions about this text.\n\n" + tokenizer.decode(ids)


def chat(client: OpenAI, model: str, system: str, turns: int, stamp) -> list[dict]:
    """One conversation; per turn its TTFT, prompt and cached tokens and what `stamp` measures."""
    messages, rows = [{"role": "system", "content": system}], []
    for question in QUESTIONS[:turns]:
        messages.append({"role": "user", "content": question})
        before = stamp()
        start, first, text, usage = time.perf_counter(), None, [], None
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=32,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        details = getattr(usage, "prompt_tokens_details", None)
        rows.append(
            {
                "ttft": first - start,
                "prompt_tokens": usage.prompt_tokens,
                "cached_tokens": (details.cached_tokens or 0) if details else 0,
                "bytes_sent": stamp() - before,
            }
        )
        messages.append({"role": "assistant", "content": "".join(text)})
    return rows


def report(figures: dict, stem: Path) -> str:
    kv = figures["kv_bytes_per_token"]
    page = 64 * kv
    lines = [
        f"# Conversations, {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        f"{figures['system_tokens']}-token system prompt, {figures['turns']} turns, 32-token answers fed back; "
        f"{figures['link']}; command: `.venv/bin/python {' '.join(['bench/bench_turns.py', *sys.argv[1:]])}`",
        "",
        "| target | turn | prompt tok | new tok | cached tok | TTFT s | ÷ turn 1 | bytes sent | ÷ (new KV + 2 pages) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for target, rows in figures["targets"].items():
        for i, r in enumerate(rows):
            new = r["prompt_tokens"] - (rows[i - 1]["prompt_tokens"] if i else 0)
            sent = f"{r['bytes_sent']:,}" if target == "pair" else "—"
            bound = f"{r['bytes_sent'] / (new * kv + 2 * page):.2f}" if target == "pair" and i else "—"
            lines.append(
                f"| {target} | {i + 1} | {r['prompt_tokens']} | {new} | {r['cached_tokens']} | {r['ttft']:.2f} | "
                f"{r['ttft'] / rows[0]['ttft']:.2f} | {sent} | {bound} |"
            )
    t = figures["targets"]
    if "mlx" in t and "mlx_lm.server" in t:
        lines += ["", "**Tandem's MLX node ÷ mlx_lm.server**, TTFT per turn (same run):", ""]
        lines.append(
            "| turn | " + " | ".join(str(i + 1) for i in range(len(t["mlx"]))) + " |\n|---|" + "---:|" * len(t["mlx"])
        )
        lines.append(
            "| ratio | "
            + " | ".join(f"{a['ttft'] / b['ttft']:.2f}" for a, b in zip(t["mlx"], t["mlx_lm.server"], strict=False))
            + " |"
        )
    if "pair" in t and "mlx_lm.server" in t:
        lines.append(
            f"\npair turn 1 ÷ mlx_lm.server turn 1: {t['pair'][0]['ttft'] / t['mlx_lm.server'][0]['ttft']:.2f}"
        )
    text = "\n".join(lines) + "\n"
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps(figures, indent=2))
    return text


def torch_and_mlx_agents(stack: ExitStack, link: str, rate: float, model: Path, home: Path, key: str, prefix: str):
    """A torch agent and an MLX agent on the loopback link, or in two network namespaces joined by
    a veth shaped to `rate` MB/s (`link` "shaped"), stopped with `stack`: {engine: URL}."""
    net = stack.enter_context(shaped_link(rate, block=random_block()) if link == "shaped" else loopback_link())
    procs = {}
    for engine, place in zip(("torch", "mlx"), net.places):
        proc = ServiceProcess(
            agent_serve_args(engine, model, "--name", f"{prefix}-{engine}", host=place.host),
            env={"TANDEM_HOME": str(home / engine), "TANDEM_CLUSTER_KEY": key},
            netns=place.netns,
        )
        stack.callback(proc.stop)
        procs[engine] = (proc, place)
    return {e: f"http://{pl.addr}:{pr.wait_ready(900).rsplit(':', 1)[1]}" for e, (pr, pl) in procs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--targets", default="pair,mlx,mlx_lm.server")
    parser.add_argument("--link", choices=("loopback", "shaped"), default="loopback")
    parser.add_argument("--rate", type=float, default=85.0, help="MB/s of the shaped link")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    model, _ = fetch(data_dir())
    tokenizer = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    text = system_prompt(tokenizer, args.system_tokens)
    geometry = inspect_model(model).geometry
    figures = {
        "model": model.name,
        "turns": args.turns,
        "system_tokens": args.system_tokens,
        "kv_bytes_per_token": geometry.token_bytes,
        "link": args.link if args.link == "loopback" else f"shaped {args.rate:g} MB/s",
        "targets": {},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"turns-{time.strftime('%Y%m%d-%H%M%S')}"
    home = Path(tempfile.mkdtemp(prefix="tandem-bench-turns-"))
    targets = args.targets.split(",")
    with ExitStack() as stack:
        agents = torch_and_mlx_agents(stack, args.link, args.rate, model, home, KEY, "turns")
        panel = ServiceProcess(
            ["panel", "--port", "0", "--no-mdns", "--api-key", "bench"]
            + ["--pair", f"torch-to-mlx={agents['torch']},{agents['mlx']}"],
            env={"TANDEM_HOME": str(home / "panel"), "TANDEM_CLUSTER_KEY": KEY, "COLUMNS": "300"},
        )
        stack.callback(panel.stop)
        panel_url = panel.wait_ready() + "/v1"
        api_key = panel.lines_matching("API key")[-1].rsplit(": ", 1)[1].strip()
        client = OpenAI(base_url=panel_url, api_key=api_key, max_retries=0, timeout=600)

        async def status(url: str) -> dict:
            agent = AgentClient(url, KEY)
            try:
                return await agent.status()
            finally:
                await agent.aclose()

        def p_bytes_sent() -> int:
            return asyncio.run(status(agents["torch"]))["totals"]["bytes_sent"]

        for target in targets:
            # each target its own conversation: the MLX node is the pair's decoder, whose cache
            # would otherwise hold the pair's turns already
            system = f"Conversation with {target}. {text}"
            if target == "pair":
                rows = chat(client, "torch-to-mlx", system, args.turns, p_bytes_sent)
            elif target == "mlx":
                rows = chat(client, "node/turns-mlx", system, args.turns, lambda: 0)
            elif target == "mlx_lm.server":
                with ExitStack() as server:
                    url, name = start_mlx_lm_server(server, model, home)
                    theirs = OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
                    rows = chat(theirs, name, system, args.turns, lambda: 0)
            else:
                raise SystemExit(f"unknown target {target!r}")
            figures["targets"][target] = rows
            for i, r in enumerate(rows):
                print(
                    f"{target:14s} turn {i + 1}: TTFT {r['ttft']:.2f} s, prompt {r['prompt_tokens']}, "
                    f"cached {r['cached_tokens']}, P sent {r['bytes_sent']:,} B",
                    flush=True,
                )
            report(figures, stem)
    print(report(figures, stem))
    print(f"wrote {stem}.{{json,md}}")


if __name__ == "__main__":
    main()
