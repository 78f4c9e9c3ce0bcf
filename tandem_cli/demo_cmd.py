"""`tandem demo`: one chat answer through an in-process prefill/decode pair on the embedded model."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import typer

from engine_adapters import load_adapter
from node_agent.inprocess import PairStats, run_pair
from tandem_protocol.contract import HashCache
from tandem_protocol.handoff import FirstTokenMode
from tandem_protocol.sampling import SamplingParams
from tandem_protocol.settings import hash_cache_path

from .model_cmd import ensure_embedded_model
from .progress import console


def demo(
    prompt: str = typer.Option("Explain in three sentences why the sky is blue.", help="The user message."),
    prefill: str = typer.Option("torch", help="Engine that runs the prompt."),
    decode: str = typer.Option("mlx", help="Engine that writes the answer."),
    mode: FirstTokenMode = typer.Option(None, help="First-token mode (default: the decoder's choice)."),
    max_tokens: int = typer.Option(128, help="Longest answer in tokens."),
) -> None:
    """Stream a chat answer: PREFILL runs the prompt, its KV moves as pages, DECODE answers."""
    path = ensure_embedded_model()
    cache = HashCache(hash_cache_path())
    with console.status(f"loading {prefill} (prefill) and {decode} (decode)…"):
        p = load_adapter(prefill, path, hash_cache=cache)
        d = p if decode == prefill else load_adapter(decode, path, hash_cache=cache)
    ids = d.chat_token_ids([{"role": "user", "content": prompt}])
    stats = PairStats()
    console.print(f"[bold]user[/] {prompt}\n[bold]assistant[/] ", end="")

    async def run() -> list[int]:
        out: list[int] = []
        shown = ""
        async for token in run_pair(p, d, ids, SamplingParams(max_tokens=max_tokens), mode, stats):
            out.append(token)
            text = d.detokenize(out)
            console.print(text[len(shown) :], end="", markup=False, highlight=False)
            shown = text
        return out

    t0 = time.perf_counter()
    try:
        out = asyncio.run(run())
    finally:
        p.close()
        if d is not p:
            d.close()
    total = time.perf_counter() - t0
    decode_rate = (len(out) - 1) / (total - stats.ttft_seconds) if len(out) > 1 else 0.0
    console.print(
        f"\n\n[dim]{prefill} -> {decode} ({(mode or d.decoder_modes[0]).value}) · prompt {len(ids)} tokens · "
        f"TTFT {stats.ttft_seconds * 1000:.0f} ms · prefill {stats.prefill_seconds * 1000:.0f} ms · "
        f"moved {stats.pages} pages, {stats.wire_bytes:,} bytes ({stats.kv_tokens} tokens of KV) · "
        f"{len(out)} tokens at {decode_rate:.1f} tok/s[/]"
    )
    # Everything is closed and printed: leave without the interpreter's teardown. With torch and
    # MLX loaded, 2 runs in 14 aborted there ("terminate called without an active exception": a
    # native library's thread object destroyed at exit, with no Python frame left; not
    # identified), turning a finished demo into exit status 134.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
