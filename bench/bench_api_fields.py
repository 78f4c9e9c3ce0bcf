"""What log-probabilities and structured outputs cost per output token on the in-process engines
(torch, MLX), against the same engine unconstrained, in the same run.

One request alone decodes `--tokens` tokens three ways, alternating: plain; with `top_logprobs` 20
(each step also pays the sampler's log-softmax and top-20 over the vocabulary and the agent's
entry for the token: its text and bytes and those of its 20 alternatives,
`node_agent/token_stream.logprobs_entry`); and under a JSON schema (each step also fills
llguidance's token mask, applies it and advances the grammar). The schema is a long array of
short strings, so the grammar stays open for every token measured. Prints the median seconds per
output token after the first (the decode steps) and each ratio to plain (issue 21's goal for
constrained decoding: ≤ 1.15).

    .venv/bin/python bench/bench_api_fields.py [--tokens 64] [--reps 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine_adapters import load_adapter  # noqa: E402
from engine_adapters.base import EngineRequest  # noqa: E402
from engine_adapters.embedded_model import fetch  # noqa: E402
from node_agent.token_stream import logprobs_entry  # noqa: E402
from tandem_protocol.sampling import SamplingParams  # noqa: E402
from tandem_protocol.settings import data_dir  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper and the sea."


SCHEMA = json.dumps({"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 200})
KINDS = {"plain": {}, "top_logprobs 20": {"logprobs": 20}, "json schema": {"json_schema": SCHEMA}}


async def per_token(adapter, ids: list[int], tokens: int, extra: dict, rid: str) -> float:
    """Seconds per output token after the first (the decode steps), entries built as the agent does."""
    sampling = SamplingParams(max_tokens=tokens, ignore_eos=True, **extra)
    req = EngineRequest(rid, ids, sampling)
    stamps = []
    async for token in adapter.generate(req):
        if sampling.logprobs is not None:
            logprobs_entry(adapter, token, req.token_logprobs[len(stamps)])
        stamps.append(time.perf_counter())
    assert len(stamps) == tokens, f"{rid}: {len(stamps)} of {tokens} tokens"
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    model, _ = fetch(data_dir())
    print(f"{args.tokens} tokens, median of {args.reps} runs (a warm-up dropped), {PROMPT!r}\n")
    print("| engine | " + " | ".join(f"ms/token {k}" for k in KINDS) + " | logprobs ÷ plain | schema ÷ plain |")
    print("|---" * (len(KINDS) + 3) + "|")
    for name in ("torch", "mlx"):
        adapter = load_adapter(name, model)
        adapter.set_prefix_cache_bytes(0)
        ids = adapter.chat_token_ids([{"role": "user", "content": PROMPT}])
        times: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for rep in range(args.reps + 1):  # the first round warms up (and builds the grammar tokenizer)
            order = list(KINDS)[rep % len(KINDS) :] + list(KINDS)[: rep % len(KINDS)]  # no kind always first
            for kind in order:
                extra = KINDS[kind]
                t = asyncio.run(per_token(adapter, ids, args.tokens, extra, f"{kind}-{rep}"))
                if rep:
                    times[kind].append(t)
        med = {kind: statistics.median(ts) for kind, ts in times.items()}
        plain = med["plain"]
        cells = " | ".join(f"{m * 1e3:.2f}" for m in med.values())
        print(f"| {name} | {cells} | {med['top_logprobs 20'] / plain:.3f} | {med['json schema'] / plain:.3f} |")
        adapter.close()


if __name__ == "__main__":
    main()
